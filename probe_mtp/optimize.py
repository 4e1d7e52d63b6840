"""``probe_mtp.optimize(model)``: prepare a loaded model for exact decoding in bf16 (or float32) on
whatever device it is on.

After it, ``model.generate`` and :func:`probe_mtp.generate` both run on the prepared model and give
the same tokens: every linear layer becomes a :class:`~probe_mtp.kernels.PackedLinear` (on a CPU,
its weight packed once, which is also faster: bf16 for oneDNN where it runs bf16, float32 by MKL on
an Intel processor and for oneDNN on others (see :func:`~probe_mtp.kernels.packing`); elsewhere, an
accelerator included, the stock product on the plain weight), each under a row plan checked bit
for bit against the one-row computation on that device before it is used; attention runs
:func:`~probe_mtp.kernels.exact_attention`.  So a wide tree pass gives every row the bits a
one-token pass gives it.  Nothing is checked per model name or device kind: a model is refused,
before anything changes, when its attention cannot be switched (it computes attention in its own
code), when it computes with weights outside linear layers (mixture-of-experts experts and
routers), when its device cannot compute in float64, or when a layer shape's product cannot be
made row-invariant there.

Moving a prepared model (``.to(device or dtype)``, ``.float()``, ``.cuda()``) keeps it prepared and
exact: packed layers become stock-product layers on the new device, and every layer's plan is
checked there before its first product.  :func:`describe` says which state a model is in.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .heap import heap_trimmer
from .kernels import (
    EXACT_ATTENTION,
    MKL,
    ONEDNN,
    STOCK,
    PackedLinear,
    Processor,
    RowPlans,
    RowVarianceError,
    device_description,
    holds_data,
    packing,
    processor,
)
from .wide import KERNELS, wide_kernel, wide_layers

PREPARED_ATTRIBUTE = "_probe_mtp_prepared"
AUTO_ATTRIBUTE = "_probe_mtp_auto"  # what dtype="auto" chose for a model (probe_mtp.choice.AutoChoice)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
LINEAR_TYPES = (nn.Linear, Conv1D, PackedLinear)

log = logging.getLogger("probe_mtp")


class OptimizeError(ValueError):
    """The model cannot be prepared (nothing was changed): the message says why and what to do."""


@dataclass
class Prepared:
    """What :func:`optimize` did to a model: the dtype and device it prepared it for, what computes
    there (the processor with its bf16 matrix units, or the accelerator's name), the row plans its
    linear layers share and how many linear layers it replaced."""

    dtype: torch.dtype
    device: torch.device
    hardware: str
    plans: RowPlans
    layers: int


def prepared(model) -> Prepared | None:
    """What :func:`optimize` did to ``model``, or None when it is not prepared (never was, or its
    attention was switched away from the exact one afterwards)."""
    found = model.__dict__.get(PREPARED_ATTRIBUTE)
    if not isinstance(found, Prepared) or _attention(model) != EXACT_ATTENTION:
        return None
    return found


def is_optimized(model) -> bool:
    return prepared(model) is not None


def describe(model) -> str:
    """One line saying which dtype, device and kernels ``model`` computes with: stock, prepared by
    :func:`optimize` where it stands, or prepared and moved since (still exact, its row plans
    checked on first use there); for a model ``dtype="auto"`` loaded, also what it chose and why."""
    record = model.__dict__.get(PREPARED_ATTRIBUTE)
    if not isinstance(record, Prepared):
        packed = wide_layers(model)
        kernels = (f"stock one-row products, products of 2+ rows with the weights of {packed} linear layers packed "
                   f"once by {KERNELS[wide_kernel(model)].by} (probe_mtp.pack_wide)" if packed else "stock kernels")
        return f"{_name(model.dtype)}, {kernels}, {_attention(model)} attention" + _auto_note(model)
    return ", ".join([_name(model.dtype), _where(model, record), _linear_kernels(model, record),
                      _attention_state(model)]) + _auto_note(model)


def _auto_note(model) -> str:
    """``"; chosen by dtype auto: <its reason>"`` for a model ``dtype="auto"`` loaded, else empty."""
    choice = model.__dict__.get(AUTO_ATTRIBUTE)
    reason = getattr(choice, "reason", None)
    return f"; chosen by dtype auto: {choice.name} ({reason})" if reason else ""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _attention(model) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def _where(model, record: Prepared) -> str:
    """The model's device now, and where it was prepared when it has moved since."""
    device, dtype = _model_device(model), model.dtype
    here = f"on {device}"
    if not holds_data(device):
        return f"{here} (no data: nothing checked or computed there; prepared as {_name(record.dtype)} on {record.device})"
    if (device, dtype) == (record.device, record.dtype):
        return f"{here} ({record.hardware})"
    return f"{here}, moved after optimize (prepared as {_name(record.dtype)} on {record.device}; still exact)"


def _linear_kernels(model, record: Prepared) -> str:
    """How the linear layers compute, and their row plans where they now are."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    kinds = Counter(m.kind for m in layers)
    named = {ONEDNN: "packed once for oneDNN", MKL: "packed once by MKL", STOCK: "with stock products"}
    if len(kinds) == 1:
        kernel = {ONEDNN: "linear weights packed once for oneDNN", MKL: "linear weights packed once by MKL",
                  STOCK: "stock linear products"}[next(iter(kinds))]
    else:
        kernel = ", ".join(f"{count} linear layers {named[kind]}" for kind, count in sorted(kinds.items()))
    plans = record.plans.describe(_model_device(model), model.dtype)
    return f"{kernel} ({plans})"


def _attention_state(model) -> str:
    attn = _attention(model)
    if attn == EXACT_ATTENTION:
        return "float64 row-invariant attention"
    return f"{attn} attention (switched after optimize: not row-invariant, so not exact)"


def _model_device(model) -> torch.device:
    return torch.device(getattr(model, "device", "cpu"))


def weight_bytes(model) -> int:
    """Bytes of every weight of ``model``, packed ones included, each weight once (a plain weight that
    shares an embedding's storage counted once; not MKL's packed copies of float32 weights, whose
    reserved size, 2-8x a small weight, says little of the memory they hold)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    counted = {p.data_ptr() for p in model.parameters()}
    for module in model.modules():
        if isinstance(module, PackedLinear):
            if module.plain is None or module.plain.data_ptr() not in counted:
                total += module.weight_bytes()
    return total


def optimize(model, dtype: torch.dtype = torch.bfloat16, *, require_matrix_units: bool = True):
    """Prepare ``model`` in place for exact decoding in ``dtype`` (bf16 or float32) on the device it
    is on, and return it.

    Every ``nn.Linear`` (and GPT-2 style ``Conv1D``) becomes a :class:`~probe_mtp.kernels.PackedLinear`
    computing in ``dtype``: on a CPU its weight packed once (bf16 for oneDNN, where it runs bf16: a
    tied output layer gets a packed copy while the embedding keeps its own for lookups; float32 by
    MKL on an Intel processor where torch has it, a second copy of the weights made at each layer's
    first product, and for oneDNN on others);
    elsewhere the stock product on the plain weight (no copy where the weight is already in
    ``dtype``).  The
    other parameters are cast to ``dtype`` and the attention becomes
    :data:`~probe_mtp.kernels.EXACT_ATTENTION`.  Before anything changes, each distinct weight
    shape is checked to be row-invariant where it computes, at the current thread count and math
    settings (:func:`~probe_mtp.kernels.choose_row_plan`).

    ``require_matrix_units``: on a CPU, refuse bf16 on a processor without bf16 matrix units (AMX
    or AVX512-BF16), where bf16 would be slower than float32 (False: prepare anyway; bf16 computes
    on any CPU, exactly as well, only more slowly).  It does not apply to float32 or to
    accelerators.  Raises :class:`OptimizeError` (the model left as it was) for another dtype, a
    model with weights on ``meta``, a device without float64, a model that cannot be made
    row-invariant, or a layer shape whose product is not row-invariant there (the message names
    the layer, its shape and why).  A model already prepared for ``dtype`` where it is is returned
    as it is; one moved since, or prepared for another dtype, is prepared again where it is now.
    Says what it did in a log line (logger ``probe_mtp``, info)."""
    if _prepare(model, dtype, require_matrix_units):
        log.info("probe_mtp.optimize: %s", describe(model))
    return model


def optimize_if_supported(model, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Prepare ``model`` for ``dtype`` as :func:`optimize` does, on any processor and without a log
    line of its own (``dtype="auto"`` says what it chose in one line): None when it is prepared,
    else optimize's reason for refusing (the model left as it was)."""
    try:
        _prepare(model, dtype, require_matrix_units=False)
    except OptimizeError as exc:
        return str(exc)
    return None


def _prepare(model, dtype: torch.dtype, require_matrix_units: bool) -> bool:
    """:func:`optimize` without its log line: whether it prepared ``model`` now (False: it already
    was, for ``dtype`` where it is)."""
    cpu = processor()
    if _as_prepared(model, dtype, cpu):
        return False
    _check_can_optimize(model, dtype, cpu, require_matrix_units)
    plans = RowPlans()
    layers = _linear_layers(model)
    # a weight the input embedding shares (a tied output layer) is cast once, for both
    tied = _tied_to_embedding(model, layers, dtype)
    checked = _check_kernels(layers, plans, dtype, cpu, tied)
    count = len(layers)
    _replace_layers(layers, checked, plans, dtype, cpu, tied)
    _cast_parameters(model, dtype, {id(model.get_input_embeddings().weight): w for w in tied.values()})
    tied.clear()
    model.set_attn_implementation(EXACT_ATTENTION)
    model.config.dtype = dtype
    device = _model_device(model)
    trim = heap_trimmer(device, every=1)
    if trim is not None:
        trim()  # the float32 weights' pages go back to the system now, not at some later step
    hardware = cpu.describe() if device.type == "cpu" else device_description(device)
    model.__dict__[PREPARED_ATTRIBUTE] = Prepared(dtype, device, hardware, plans, count)
    model.__dict__.pop(AUTO_ATTRIBUTE, None)  # what dtype auto chose no longer describes the model
    return True


def _as_prepared(model, dtype: torch.dtype, cpu: Processor) -> bool:
    """Whether ``model`` is prepared for ``dtype`` where it now is, as :func:`optimize` would leave it:
    marked there, exact attention, every linear layer in ``dtype`` and packed where it can be."""
    record = prepared(model)
    if record is None or (record.device, record.dtype) != (_model_device(model), dtype):
        return False
    return all(isinstance(child, PackedLinear) and child.dtype == dtype
               and child.kind == _packing(child.device, dtype, cpu)
               for _, _, _, child in _linear_layers(model))


def _check_can_optimize(model, dtype, cpu: Processor, require_matrix_units: bool) -> None:
    name = type(model).__name__
    if dtype not in SUPPORTED_DTYPES:
        raise OptimizeError(f"optimize() prepares models for {' or '.join(map(str, SUPPORTED_DTYPES))}, not {dtype}")
    empty = sorted({n.rsplit(".", 1)[0] for n, p in model.named_parameters() if not holds_data(p.device)})
    if empty:
        raise OptimizeError(f"{name} has weights on meta (no data: offloaded or not loaded yet), e.g. in {empty[0]}; "
                            "load it onto a device first")
    device = _model_device(model)
    if not _computes_float64(device):
        raise OptimizeError(f"{device} does not compute in float64, which the exact attention needs; "
                            "decode this model in float32 there")
    if require_matrix_units and device.type == "cpu" and not cpu.fast_for(dtype):
        why = "oneDNN cannot run bf16 here" if not cpu.onednn_bf16 else "no AMX or AVX512-BF16 instructions"
        raise OptimizeError(
            f"this processor ({cpu.name}) has no bf16 matrix units ({why}): {dtype} would be slower than float32 "
            "here, so the model was left as it was (float32 is exact and fastest on this machine). "
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


def _computes_float64(device: torch.device) -> bool:
    """Whether ``device`` multiplies float64 matrices (Apple's MPS, for one, has no float64)."""
    try:
        ones = torch.ones(2, 2, dtype=torch.float64, device=device)
        return (ones @ ones).dtype == torch.float64
    except (TypeError, RuntimeError):
        return False


def _weights_outside_linear_layers(model) -> list[str]:
    """Parameters of two or more dimensions that a forward uses in products of their own: not a
    linear layer's, not an embedding table's."""
    found = []
    for module_name, module in model.named_modules():
        if isinstance(module, LINEAR_TYPES + (nn.Embedding,)):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if param.dim() >= 2:
                found.append(f"{type(module).__name__}.{param_name}")
    return sorted(set(found))


def _linear_layers(model) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """``(qualified name, parent, attribute, layer)`` of every linear layer of ``model``."""
    return [(f"{path}.{name}" if path else name, parent, name, child)
            for path, parent in model.named_modules() for name, child in parent.named_children()
            if isinstance(child, LINEAR_TYPES)]


def _layer_device(module: nn.Module) -> torch.device:
    return module.device if isinstance(module, PackedLinear) else module.weight.device


def _packing(device: torch.device, dtype: torch.dtype, cpu: Processor) -> str:
    """How a layer on ``device`` computing in ``dtype`` packs its weight (see :func:`kernels.packing`):
    on a CPU by oneDNN or by MKL, elsewhere not at all."""
    return packing(dtype, cpu) if device.type == "cpu" else STOCK


def _tied_to_embedding(model, layers, dtype) -> dict[int, torch.Tensor]:
    """``{id(layer): its weight cast to dtype}`` for the linear layers whose weight is the input
    embedding's (at most one: a tied output layer)."""
    embed = model.get_input_embeddings()
    shared = getattr(embed, "weight", None)
    return {id(child): shared.detach().to(dtype) for _, _, _, child in layers
            if isinstance(child, nn.Linear) and shared is not None and child.weight is shared}


def _new_layer(child: nn.Module, plans: RowPlans, dtype: torch.dtype, cpu: Processor,
               tied: dict[int, torch.Tensor]) -> PackedLinear:
    """The :class:`PackedLinear` that replaces ``child``, packed where its device allows."""
    return PackedLinear.from_module(child, plans, _packing(_layer_device(child), dtype, cpu), tied.get(id(child)), dtype)


def _check_kernels(layers, plans: RowPlans, dtype: torch.dtype, cpu: Processor,
                   tied: dict[int, torch.Tensor]) -> dict[int, PackedLinear]:
    """Build the first layer of every distinct weight shape on every device and choose (so check)
    its row plan, before the model changes; returns those layers by the ``id`` of the layer they
    replace (kept for the conversion, so no weight is packed twice and nothing larger than the
    model's own layers is ever allocated).  :class:`OptimizeError` naming the layer, its shape and
    why where no plan holds."""
    first: dict[int, PackedLinear] = {}
    seen = set()
    for qualified, _, _, child in layers:
        key = (_out_in_shape(child), _layer_device(child))
        if key in seen:
            continue
        seen.add(key)
        layer = _new_layer(child, plans, dtype, cpu, tied)
        try:
            plans.plan(layer)
        except RowVarianceError as exc:
            raise OptimizeError(f"layer {qualified}: {exc}; the model was left as it was") from None
        first[id(child)] = layer
    return first


def _replace_layers(layers, checked: dict[int, PackedLinear], plans: RowPlans, dtype: torch.dtype, cpu: Processor,
                    tied: dict[int, torch.Tensor]) -> None:
    """Put a :class:`PackedLinear` in place of every layer of ``layers`` (emptied as it goes: each
    old weight goes as soon as its replacement is in place)."""
    layers.reverse()
    while layers:
        _, parent, name, child = layers.pop()
        layer = checked.pop(id(child), None) or _new_layer(child, plans, dtype, cpu, tied)
        setattr(parent, name, layer)
        del child, layer


def _out_in_shape(module) -> tuple[tuple[int, int], bool]:
    if isinstance(module, Conv1D):
        return (int(module.weight.shape[1]), int(module.weight.shape[0])), module.bias is not None
    return (int(module.out_features), int(module.in_features)), module.bias is not None


def _cast_parameters(model, dtype: torch.dtype, cast: dict[int, torch.Tensor]) -> None:
    """Cast every floating parameter outside the linear layers to ``dtype`` (buffers such as rotary
    frequencies keep their dtype, as in a model loaded in ``dtype``); ``cast``: parameters already
    cast, by ``id``."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                done = cast.pop(id(param), None)
                param.data = done if done is not None else param.data.to(dtype)
