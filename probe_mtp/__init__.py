"""probe-mtp: training-free, lossless multi-token decoding by embedding-space probing."""

from .config import ProbeConfig
from .decoder import DecodeStats, GenerateOutput, ProbeDecoder
from .generate import custom_generate, generate
from .loading import EMBEDDED_MODELS, load_model

__version__ = "0.1.0"

__all__ = [
    "ProbeConfig",
    "ProbeDecoder",
    "DecodeStats",
    "GenerateOutput",
    "generate",
    "custom_generate",
    "load_model",
    "EMBEDDED_MODELS",
]
