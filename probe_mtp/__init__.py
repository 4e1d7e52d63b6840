"""probe-mtp: training-free, lossless multi-token decoding by embedding-space probing."""

from .config import ProbeConfig
from .decoder import ProbeDecoder
from .stats import DecodeStats, GenerateOutput
from .generate import custom_generate, decoder_for, generate
from .loading import EMBEDDED_MODELS, load_model
from .optimize import OptimizeError, describe, is_optimized, optimize
from .version import __version__
from .wide import PackWideError, is_packed_wide, pack_wide, unpack_wide

__all__ = [
    "ProbeConfig",
    "ProbeDecoder",
    "DecodeStats",
    "GenerateOutput",
    "generate",
    "custom_generate",
    "decoder_for",
    "load_model",
    "EMBEDDED_MODELS",
    "optimize",
    "is_optimized",
    "describe",
    "OptimizeError",
    "pack_wide",
    "unpack_wide",
    "is_packed_wide",
    "PackWideError",
    "__version__",
]
