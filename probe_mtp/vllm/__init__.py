"""probe-mtp inside vLLM (``make vllm`` installs vLLM's CPU build into ``.venv-vllm``).

- :class:`Proposer`: probe-mtp's drafting as vLLM's ``custom_class`` speculative method;
- :mod:`probe_mtp.vllm.engine`: the folder vLLM reads for the embedded models, an engine's settings;
- :mod:`probe_mtp.vllm.bench`: ``probe-mtp bench --engine vllm``.

Nothing else in probe_mtp imports this package, and this package imports vLLM only where it
starts an engine."""

from .proposer import Proposer, ProposerSettings

__all__ = ["Proposer", "ProposerSettings"]
