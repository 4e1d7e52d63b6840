"""``probe_mtp.optimize(model)``: prepare a loaded CPU model for exact decoding in bf16 on the
processor's matrix units.

After it, ``model.generate`` and :func:`probe_mtp.generate` both run on the prepared model, faster
than before, and give the same tokens: every linear layer computes in bf16 from a weight packed
once (:class:`~probe_mtp.kernels.PackedLinear`), attention runs
:func:`~probe_mtp.kernels.exact_attention`, and each is row-invariant, so a wide tree pass gives
every row the bits a one-token pass gives it.  Nothing is checked per model name: a model is
refused, before anything changes, when its attention cannot be switched (it computes attention in
its own code) or when it computes with weights outside linear layers (mixture-of-experts experts
and routers), because those could not be made row-invariant.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .heap import heap_trimmer
from .kernels import (
    EXACT_ATTENTION,
    PackedLinear,
    Processor,
    RowPlans,
    RowVarianceError,
    processor,
)

PREPARED_ATTRIBUTE = "_probe_mtp_prepared"
SUPPORTED_DTYPES = (torch.bfloat16,)
LINEAR_TYPES = (nn.Linear, Conv1D)

log = logging.getLogger("probe_mtp")


class OptimizeError(ValueError):
    """The model cannot be prepared (nothing was changed): the message says why and what to do."""


@dataclass
class Prepared:
    """What :func:`optimize` did to a model."""

    dtype: torch.dtype
    processor: Processor
    packed: bool  # weights packed for oneDNN (False: stock bf16 products, on a processor oneDNN cannot run bf16 on)
    plans: RowPlans
    layers: int  # linear layers replaced

    def describe(self) -> str:
        kernel = "linear weights packed once for oneDNN" if self.packed else "stock bf16 linear products"
        units = self.processor.matrix_units or "no bf16 matrix units"
        return (f"{str(self.dtype).replace('torch.', '')}, {kernel} ({units}; {self.plans.describe()}), "
                "float64 row-invariant attention")


def prepared(model) -> Prepared | None:
    """What :func:`optimize` did to ``model``, or None when it is not prepared."""
    found = model.__dict__.get(PREPARED_ATTRIBUTE)
    return found if isinstance(found, Prepared) else None


def is_optimized(model) -> bool:
    return prepared(model) is not None


def describe(model) -> str:
    """One line saying which dtype and kernels ``model`` computes with."""
    found = prepared(model)
    if found is not None:
        return found.describe()
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    return f"{str(model.dtype).replace('torch.', '')}, stock kernels, {attn} attention"


def weight_bytes(model) -> int:
    """Bytes of every weight of ``model``, packed ones included."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(m.weight_bytes() for m in model.modules() if isinstance(m, PackedLinear))


def optimize(model, dtype: torch.dtype = torch.bfloat16, *, require_matrix_units: bool = True):
    """Prepare ``model`` (loaded, on the CPU) in place for exact decoding in ``dtype`` and return it.

    Every ``nn.Linear`` (and GPT-2 style ``Conv1D``) becomes a :class:`~probe_mtp.kernels.PackedLinear`
    (its bf16 weight packed once for oneDNN; a tied output layer gets a packed copy while the
    embedding keeps its own for lookups, so the model holds as many bytes as in float32, less the
    other layers' halves), the other parameters are cast to ``dtype``, and the attention becomes
    :data:`~probe_mtp.kernels.EXACT_ATTENTION`.  Before anything changes, each distinct weight shape
    is checked to be row-invariant on this processor at this thread count
    (:func:`~probe_mtp.kernels.choose_row_plan`).

    ``require_matrix_units``: refuse on a processor without bf16 matrix units (AMX or
    AVX512-BF16), where bf16 would be slower than float32 (False: prepare anyway; bf16 computes on
    any CPU, exactly as well, only more slowly).  Raises :class:`OptimizeError` (the model left as
    it was) for another dtype, a model off the CPU, a model that cannot be made row-invariant, or
    kernels that are not row-invariant here.  A model already prepared is returned as it is."""
    found = prepared(model)
    if found is not None:
        if found.dtype != dtype:
            raise OptimizeError(f"the model is already prepared for {found.dtype}; load it again to prepare it for {dtype}")
        return model
    cpu = processor()
    _check_can_optimize(model, dtype, cpu, require_matrix_units)
    plans = RowPlans()
    pack = cpu.onednn_bf16
    layers = _linear_layers(model)
    # a weight the input embedding shares (a tied output layer) is cast once, for both
    tied = _tied_to_embedding(model, layers, dtype)
    checked = _check_kernels(layers, plans, pack, tied)
    count = len(layers)
    layers.reverse()
    while layers:  # each float32 weight goes as soon as its packed copy is in place
        parent, name, child = layers.pop()
        packed = checked.pop(id(child), None) or PackedLinear.from_module(child, plans, pack, tied.get(id(child)))
        setattr(parent, name, packed)
        del child, packed
    _cast_parameters(model, dtype, {id(model.get_input_embeddings().weight): w for w in tied.values()})
    tied.clear()
    model.set_attn_implementation(EXACT_ATTENTION)
    model.config.dtype = dtype
    trim = heap_trimmer(torch.device("cpu"), every=1)
    if trim is not None:
        trim()  # the float32 weights' pages go back to the system now, not at some later step
    result = Prepared(dtype, cpu, pack, plans, count)
    model.__dict__[PREPARED_ATTRIBUTE] = result
    log.info("probe_mtp.optimize: %s", result.describe())  # dtype auto says which through this line
    return model


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype ``dtype="auto"`` loads a model in on ``device``: bf16 where :func:`optimize` will
    prepare it (a CPU with bf16 matrix units), float32 elsewhere (saying why, logger ``probe_mtp``).
    Loading straight in bf16 casts each weight as ``optimize`` would (round to nearest even) and
    keeps no float32 copy; while transformers casts, the float32 file's pages are still resident
    (a load peak above the float32 model's, for about a second; docs/exact-bf16.md)."""
    if torch.device(device).type != "cpu":
        log.info("dtype auto: float32 on %s (optimize() prepares CPU models)", device)
        return torch.float32
    cpu = processor()
    if not cpu.has_bf16_units:
        log.info("dtype auto: float32 (this processor, %s, has no bf16 matrix units)", cpu.describe())
        return torch.float32
    return torch.bfloat16


def optimize_if_supported(model) -> bool:
    """``dtype="auto"``: prepare ``model`` for bf16 where :func:`auto_dtype` chose bf16 and the model
    can be prepared.  Says which (logger ``probe_mtp``: info when prepared, a warning naming the
    reason when a model could not be prepared on a processor that has the units) and returns whether
    it prepared the model; a model it could not prepare is for the caller to load in float32."""
    if auto_dtype(getattr(model, "device", "cpu")) != torch.bfloat16:
        return False
    try:
        optimize(model)
    except OptimizeError as exc:
        log.warning("dtype auto: float32, because %s", exc)
        return False
    return True


def _check_can_optimize(model, dtype, cpu: Processor, require_matrix_units: bool) -> None:
    name = type(model).__name__
    if dtype not in SUPPORTED_DTYPES:
        raise OptimizeError(f"optimize() prepares models for torch.bfloat16 only, not {dtype}; "
                            "float32 needs no preparation (it is exact with the stock kernels)")
    device = getattr(model, "device", torch.device("cpu"))
    if torch.device(device).type != "cpu":
        raise OptimizeError(f"optimize() prepares models on the CPU; {name} is on {device}")
    if require_matrix_units and not cpu.has_bf16_units:
        why = "oneDNN cannot run bf16 here" if not cpu.onednn_bf16 else "no AMX or AVX512-BF16 instructions"
        raise OptimizeError(
            f"this processor ({cpu.name}) has no bf16 matrix units ({why}): bf16 would be slower than float32 here, "
            "so the model was left as it was (float32 is exact and fastest on this machine). "
            "Pass require_matrix_units=False to prepare it anyway")
    can_switch = getattr(model, "_can_set_attn_implementation", None)
    if not callable(can_switch) or not can_switch():
        raise OptimizeError(
            f"{name} computes attention in its own code (it does not use transformers' AttentionInterface), so its "
            "attention cannot be made row-invariant; decode it in float32")
    foreign = _weights_outside_linear_layers(model)
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise OptimizeError(
            f"{name} computes with weights outside linear layers ({shown}: mixture-of-experts experts or routers), "
            "which optimize() cannot make row-invariant; decode it in float32")


def _weights_outside_linear_layers(model) -> list[str]:
    """Parameters of two or more dimensions that a forward uses in products of their own: not a
    linear layer's, not an embedding table's."""
    found = []
    for module_name, module in model.named_modules():
        if isinstance(module, LINEAR_TYPES + (nn.Embedding, PackedLinear)):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if param.dim() >= 2:
                found.append(f"{type(module).__name__}.{param_name}")
    return sorted(set(found))


def _linear_layers(model) -> list[tuple[nn.Module, str, nn.Module]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, LINEAR_TYPES)]


def _tied_to_embedding(model, layers, dtype) -> dict[int, torch.Tensor]:
    """``{id(layer): its weight cast to dtype}`` for the linear layers whose weight is the input
    embedding's (at most one: a tied output layer)."""
    embed = model.get_input_embeddings()
    shared = getattr(embed, "weight", None)
    return {id(child): shared.detach().to(dtype) for _, _, child in layers
            if isinstance(child, nn.Linear) and shared is not None and child.weight is shared}


def _check_kernels(layers, plans: RowPlans, pack: bool, tied: dict[int, torch.Tensor]) -> dict[int, PackedLinear]:
    """Pack the first layer of every distinct weight shape and choose (so check) its row plan,
    before the model changes; returns those packed layers by the ``id`` of the layer they replace
    (kept for the conversion, so no weight is packed twice and nothing larger than the model's own
    packed layers is ever allocated)."""
    first: dict[int, PackedLinear] = {}
    seen = set()
    for _, _, child in layers:
        key = _out_in_shape(child)
        if key in seen:
            continue
        seen.add(key)
        packed = PackedLinear.from_module(child, plans, pack, tied.get(id(child)))
        try:
            plans.plan(packed)
        except RowVarianceError as exc:
            raise OptimizeError(f"{exc}; the model was left as it was") from None
        first[id(child)] = packed
    return first


def _out_in_shape(module) -> tuple[tuple[int, int], bool]:
    if isinstance(module, Conv1D):
        return (int(module.weight.shape[1]), int(module.weight.shape[0])), module.bias is not None
    return (int(module.out_features), int(module.in_features)), module.bias is not None


def _cast_parameters(model, dtype: torch.dtype, cast: dict[int, torch.Tensor]) -> None:
    """Cast every floating parameter outside the packed layers to ``dtype`` (buffers such as rotary
    frequencies keep their dtype, as in a model loaded in ``dtype``); ``cast``: parameters already
    cast, by ``id``."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                done = cast.pop(id(param), None)
                param.data = done if done is not None else param.data.to(dtype)
