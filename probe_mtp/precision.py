"""Whether a model computes in a precision where probe-mtp's output can differ from ``model.generate``.

Tree verification scores many positions in one wide pass; ``model.generate`` scores one at a time.
Where a wide pass rounds a row differently from a one-row pass, a near-tie between the two best
tokens can go the other way, and the outputs part from there.  In float32 with IEEE products the
differences sit in the last bits of float32 and such ties almost never decide; in fp16 / bf16
with stock kernels (or float32 with TF32 products on CUDA, which multiply with 10-bit mantissas,
or on a CPU with bf16 matrix units once ``torch.set_float32_matmul_precision`` lets oneDNN
multiply float32 in bf16) they are common enough to show within a few hundred tokens.  A model prepared by
:func:`probe_mtp.optimize` is row-invariant by construction and exact in its own precision.
:func:`exactness_warning` says which case a model is in; the decoder warns with it once.
"""

from __future__ import annotations

import torch

from .optimize import is_optimized

REDUCED = (torch.float16, torch.bfloat16)
TF32_OFF = "torch.backends.cuda.matmul.allow_tf32 = False; torch.backends.cudnn.allow_tf32 = False"


def exactness_warning(model) -> str | None:
    """A message when ``model``'s outputs under probe-mtp can differ from ``model.generate`` at
    near-ties (it computes in fp16 / bf16 without :func:`probe_mtp.optimize`, or in float32 on CUDA
    with TF32 matmuls on), saying how to stay exact; None where they cannot (float32 with IEEE
    products, or a model prepared by ``optimize``).  Reads settings only (no device work)."""
    if is_optimized(model):
        return None
    dtype, device = model.dtype, torch.device(getattr(model, "device", "cpu"))
    if dtype in REDUCED:
        return _reduced_message(dtype, device)
    if dtype == torch.float32 and device.type == "cuda" and tf32_matmuls():
        return _tf32_message(device)
    if dtype == torch.float32 and device.type == "cpu" and cpu_reduced_float32() is not None:
        return _cpu_reduced_message(cpu_reduced_float32())
    return None


def tf32_matmuls() -> bool:
    """Whether float32 matrix products on CUDA may use TF32 (or bf16) inside: ``allow_tf32`` on, or a
    float32 matmul precision other than ``"highest"`` (read per backend where the settings mix
    torch's older and newer switches, which makes the general query raise)."""
    if torch.backends.cuda.matmul.allow_tf32:
        return True
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:
        return getattr(torch.backends.cuda.matmul, "fp32_precision", "none") not in ("none", "ieee")


def cpu_reduced_float32() -> str | None:
    """``"bf16"`` or ``"tf32"`` where oneDNN may multiply float32 in that type on this CPU
    (``torch.set_float32_matmul_precision("medium")`` / ``"high"``, or
    ``torch.backends.mkldnn.matmul.fp32_precision``) and the processor has the bf16 matrix units
    that do it; None where float32 products are IEEE (the default)."""
    from .kernels import processor

    mode = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", "none")
    if mode not in ("bf16", "tf32") or not processor().has_bf16_units:
        return None
    return mode


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _stay_exact(device: torch.device) -> str:
    """How to decode exactly on ``device``: float32 (with TF32 off on CUDA) or a prepared model."""
    float32 = "float32 (model.float())"
    if device.type == "cuda":
        float32 += f" with TF32 off ({TF32_OFF})"
    return f"To stay exact, decode in {float32}, or prepare the model with probe_mtp.optimize(model)"


def _reduced_message(dtype: torch.dtype, device: torch.device) -> str:
    return (f"the model computes in {_name(dtype)} on {device} with stock kernels: a wide verification pass rounds "
            "differently from a one-token pass, so outputs can differ from model.generate where the two best tokens "
            f"are near-ties. {_stay_exact(device)} (exact {_name(torch.bfloat16)} or float32 on {device.type}, "
            "each row's bits checked against a one-row pass).")


def _cpu_reduced_message(mode: str) -> str:
    return (f"float32 matrix products on this CPU may run in {mode} inside oneDNN (set by "
            "torch.set_float32_matmul_precision or torch.backends.mkldnn.matmul.fp32_precision): stock float32 is then "
            "no longer IEEE, a wide verification pass rounds differently from a one-token pass, and outputs can differ "
            "from model.generate where the two best tokens are near-ties. To stay exact, call "
            "torch.set_float32_matmul_precision('highest'), or prepare the model with probe_mtp.optimize(model).")


def _tf32_message(device: torch.device) -> str:
    return (f"the model computes in float32 on {device} with TF32 matmuls enabled (products with 10-bit mantissas): a "
            "wide verification pass rounds differently from a one-token pass, so outputs can differ from "
            f"model.generate where the two best tokens are near-ties. To stay exact, turn TF32 off ({TF32_OFF}), "
            "or prepare the model with probe_mtp.optimize(model, dtype=torch.float32).")
