"""``probe_mtp.pack_wide(model)``: float32 as the stock kernels compute it, without repacking the
weights at every pass of several inputs.

Why.  Stock float32 ``nn.Linear`` on a CPU multiplies one row with a matrix-vector product that
reads the weight as it is, but two rows or more with a GEMM that first repacks the whole weight:
held to AVX2, a SmolLM2 pass over 2 inputs costs 1.8 one-input passes, over 8 inputs 2.0, so
verifying even a short draft costs almost a second step and trees rarely pay on processors
without bf16 matrix units.  :func:`pack_wide` keeps each float32 linear layer's one-row product
as it is (a plain decoding step computes the bits it computes on the stock model) and multiplies
two rows or more with a copy of the weight packed once: by the MKL inside torch
(:mod:`probe_mtp.mkl_gemm`, ``kernel="mkl"``) or by oneDNN (``kernel="onednn"``, the packing
vLLM's CPU backend gives its float32 weights).  Held to AVX2 on a Xeon, MKL's 2- and 8-input
passes then cost 1.2 and 1.5 one-input passes (oneDNN's 1.5 and 1.9, stock's 1.6 and 1.9);
on an AVX2 EPYC a oneDNN-packed 2-input pass cost 1.2 stock one-input passes against stock's 1.7.
Which is faster depends on the processor, so ``dtype="auto"`` measures both.

What it guarantees.  A wide product sums in another order than a one-row product, as stock
float32's own wide product does: decoding on a packed model is token-identical to
``model.generate`` on the unpacked model wherever stock float32 decoding is (a different token
would need two logits within float32 rounding of each other; the identity tests check it on the
embedded models' prompts), but not bit for bit: ``probe_mtp.optimize(model, torch.float32)`` is the
configuration that is (each row's bits independent of the pass, at the price of a slower one-input
pass: its float64 attention and padded lone rows).  The prompt, read in wide passes, is also
summed in another order than the stock GEMM sums it.

How.  Each ``nn.Linear`` (and GPT-2's ``Conv1D``) computing in float32 on the CPU becomes an
instance of a subclass of its own class, in place (the module, its parameters, tied weights, hooks
and ``state_dict`` keys stay as they were; :func:`unpack_wide` turns it back).  The packed copy is
made at packing and again after the weight changes (``load_state_dict``, a move); off the CPU, in
another dtype, or where autograd records the product (tuning mask vectors backpropagates through
the frozen model) a product is the stock one.  The copies cost memory: MKL reserves 2-9x a weight's
bytes for its packed form (a small weight most) and touches about twice them.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from . import mkl_gemm

MKL, ONEDNN = "mkl", "onednn"
# the row count oneDNN lays a packed weight out for.  Held to AVX2 (Xeon, SmolLM2 passes of 2-16
# inputs), a copy laid out for 1 row computed them 1.1-1.2x slower than one laid out for 8 or 64
ONEDNN_ROWS = 8


class WideKernel(NamedTuple):
    """How the products of two rows or more are computed: ``pack(weight [out, in]) -> packed`` once,
    then ``product(x2d, packed, out_features, bias) -> [rows, out]``; ``by`` names the library
    (:func:`probe_mtp.describe`), ``label`` the kernel in cost-curve keys."""

    by: str
    label: str
    available: Callable[[], bool]
    pack: Callable[[torch.Tensor], torch.Tensor]
    product: Callable


def _onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ONEDNN_ROWS)


def _onednn_product(x2d: torch.Tensor, packed: torch.Tensor, out_features: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x2d, packed, bias, "none", [], "")


KERNELS = {
    MKL: WideKernel("MKL", "MKL, wide products only", lambda: mkl_gemm.available(), mkl_gemm.pack, mkl_gemm.product),
    ONEDNN: WideKernel("oneDNN", "oneDNN, wide products only", _onednn_available, _onednn_pack, _onednn_product),
}


class PackWideError(ValueError):
    """The model cannot be packed (nothing was changed): the message says why."""


class _WideProducts:
    """What a packed layer adds to its stock class: products of two rows or more with the weight
    packed once by its kernel (float32 on the CPU, outside autograd), every other product the stock
    one (its class's own ``forward``)."""

    _wide_pack: tuple | None = None  # (what the weight was when packed, the packed copy)
    _wide_kernel: str = MKL  # a key of KERNELS (set per layer by pack_wide)

    def _out_in_weight(self) -> torch.Tensor:
        """The weight as ``[out, in]`` (what the kernels pack)."""
        raise NotImplementedError

    def _in_out(self) -> tuple[int, int]:
        """``(in_features, out_features)``."""
        raise NotImplementedError

    def _packs(self, x: torch.Tensor) -> bool:
        weight = self.weight
        if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" \
                or weight.device.type != "cpu":
            return False
        if weight.is_inference():  # no version counter: a packed copy could not tell a change in place
            return False
        return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))

    def _packed(self) -> torch.Tensor:
        """The packed copy of the weight as it now is (packed again after the weight changed)."""
        weight = self.weight
        state = (weight.data_ptr(), weight._version, tuple(weight.shape))
        found = self._wide_pack
        if found is None or found[0] != state:
            found = self._wide_pack = (state, KERNELS[self._wide_kernel].pack(self._out_in_weight()))
        return found[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_features, out_features = self._in_out()
        rows = x.numel() // max(in_features, 1)
        if rows < 2 or not self._packs(x):
            return super().forward(x)
        bias = None if self.bias is None else self.bias.detach()
        product = KERNELS[self._wide_kernel].product
        out = product(x.reshape(rows, in_features).contiguous(), self._packed(), out_features, bias)
        return out.view(*x.shape[:-1], out_features)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_wide_pack", None)  # valid only where it was written: packed again when next needed
        return state


class WideLinear(_WideProducts, nn.Linear):
    """An ``nn.Linear`` whose products of two rows or more use its weight packed once (MKL or oneDNN)."""

    def _out_in_weight(self) -> torch.Tensor:
        return self.weight.detach()

    def _in_out(self) -> tuple[int, int]:
        return self.in_features, self.out_features


class WideConv1D(_WideProducts, Conv1D):
    """GPT-2's ``Conv1D`` (weight ``[in, out]``) whose products of two rows or more use its weight
    packed once (MKL or oneDNN)."""

    def _out_in_weight(self) -> torch.Tensor:
        return self.weight.detach().t()

    def _in_out(self) -> tuple[int, int]:
        return self.weight.shape[0], self.nf


WIDE_CLASSES = {nn.Linear: WideLinear, Conv1D: WideConv1D}
STOCK_CLASSES = {wide: stock for stock, wide in WIDE_CLASSES.items()}


def is_packed_wide(model) -> bool:
    """Whether any linear layer of ``model`` is packed by :func:`pack_wide`."""
    return any(isinstance(module, _WideProducts) for module in model.modules())


def wide_layers(model) -> int:
    return sum(isinstance(module, _WideProducts) for module in model.modules())


def wide_kernel(model) -> str | None:
    """The kernel (a key of :data:`KERNELS`) of ``model``'s packed layers, None where none is packed."""
    return next((module._wide_kernel for module in model.modules() if isinstance(module, _WideProducts)), None)


def default_kernel(vendor: str | None = None) -> str | None:
    """The kernel :func:`pack_wide` takes unless told: on an Intel processor MKL where this torch
    carries it (on a Xeon, free and held to AVX2, the faster of the two), elsewhere oneDNN (on AMD
    EPYCs, with AVX2 only or AVX512-BF16, MKL's packed products ran 1.4-2x slower than oneDNN's
    at 2-16 rows); the other where that one is absent; None where neither.  ``vendor``: the
    processor's (:func:`~probe_mtp.kernels.processor_vendor`, this machine's by default)."""
    from dataclasses import replace

    from .kernels import mkl_first, processor

    cpu = processor() if vendor is None else replace(processor(), vendor=vendor)
    order = (MKL, ONEDNN) if mkl_first(cpu) else (ONEDNN, MKL)
    return next((name for name in order if KERNELS[name].available()), None)


def why_not_pack_wide(model, kernel: str | None = None) -> str | None:
    """Why :func:`pack_wide` would refuse ``model`` (with ``kernel``), or None where it packs it."""
    from .kernels import PackedLinear  # the prepared layers of probe_mtp.optimize

    if kernel is not None and kernel not in KERNELS:
        return f"kernel must be one of {', '.join(map(repr, KERNELS))}, not {kernel!r}"
    if kernel == MKL and not KERNELS[MKL].available():
        return ("this torch carries no MKL whose packed float32 product probe-mtp can call (macOS, ARM, a build "
                "without MKL); kernel='onednn' may be available")
    if kernel == ONEDNN and not KERNELS[ONEDNN].available():
        return "this torch is built without oneDNN (torch.backends.mkldnn.is_available() is False)"
    if kernel is None and default_kernel() is None:
        return "this torch carries neither MKL's packed float32 product nor oneDNN"
    if any(isinstance(module, PackedLinear) for module in model.modules()):
        return ("the model is prepared by probe_mtp.optimize (its layers already compute with packed, "
                "row-invariant products)")
    if is_packed_wide(model):
        return f"the model is packed already (by {wide_kernel(model)}; probe_mtp.unpack_wide turns it back)"
    layers = [module for module in model.modules() if type(module) in WIDE_CLASSES]
    if not layers:
        return f"{type(model).__name__} has no nn.Linear or Conv1D layers to pack"
    found = {(module.weight.dtype, module.weight.device.type) for module in layers}
    if found != {(torch.float32, "cpu")}:
        where = ", ".join(sorted(f"{str(dtype).replace('torch.', '')} on {device}" for dtype, device in found))
        return f"packing is for float32 weights on the CPU; this model's linear layers hold {where}"
    if any(module.weight.is_inference() for module in layers):
        return ("its weights were made under torch.inference_mode, which keeps no version counter, so a packed copy "
                "could not tell when a weight changes; load or build the model outside inference_mode (using it "
                "under inference_mode afterwards is fine)")
    return None


def pack_wide(model, kernel: str | None = None):
    """Pack every float32 linear layer of ``model`` (on the CPU) once for its products of two rows or
    more, in place; one-row products stay the stock ones (see the module's notes for what that
    guarantees).  ``kernel``: ``"mkl"`` (the MKL inside torch), ``"onednn"``, or None: MKL on an
    Intel processor, oneDNN elsewhere, where this torch carries them (:func:`default_kernel`).  Returns the model.
    :class:`PackWideError` (nothing changed) where it cannot: the kernel absent from this torch,
    weights not float32 on the CPU, a model prepared by ``optimize`` or packed already."""
    reason = why_not_pack_wide(model, kernel)
    if reason is not None:
        raise PackWideError(f"cannot pack {type(model).__name__} for wide products: {reason}")
    kernel = kernel or default_kernel()
    for module in list(model.modules()):
        wide = WIDE_CLASSES.get(type(module))
        if wide is not None:
            module.__class__ = wide
            module._wide_kernel = kernel
            module._packed()  # now, not in the first pass
    return model


def unpack_wide(model):
    """Turn every layer :func:`pack_wide` packed back into its stock class (the packed copies freed);
    returns the model."""
    for module in model.modules():
        stock = STOCK_CLASSES.get(type(module))
        if stock is not None:
            module.__dict__.pop("_wide_pack", None)
            module.__dict__.pop("_wide_kernel", None)
            module.__class__ = stock
    return model
