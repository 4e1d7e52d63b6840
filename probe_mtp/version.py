"""The package version (one place; ``probe_mtp.__version__`` and the report read it)."""

__version__ = "0.1.0"
