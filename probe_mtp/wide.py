"""``probe_mtp.pack_wide(model)``: float32 as the stock kernels compute it, without repacking the
weights at every pass of several inputs.

Why.  Stock float32 ``nn.Linear`` on a CPU multiplies one row with a matrix-vector product that
reads the weight as it is, but two rows or more with a GEMM that first repacks the whole weight:
held to AVX2, a SmolLM2 pass over 2 inputs costs 1.8 one-input passes, over 8 inputs 2.0, so
verifying even a short draft costs almost a second step and trees rarely pay on processors
without bf16 matrix units.  :func:`pack_wide` keeps each float32 linear layer's one-row product
as it is (a plain decoding step computes the bits it computes on the stock model) and multiplies
two rows or more with a copy of the weight packed once by the MKL inside torch
(:mod:`probe_mtp.mkl_gemm`): held to AVX2 the 2- and 8-input passes then cost 1.2 and 1.5
one-input passes.

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

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from . import mkl_gemm

WIDE_KERNEL = "MKL, wide products only"  # how the linear layers of a packed model compute (cost-curve keys)


class PackWideError(ValueError):
    """The model cannot be packed (nothing was changed): the message says why."""


class _WideProducts:
    """What a packed layer adds to its stock class: products of two rows or more with the weight
    packed once by MKL (float32 on the CPU, outside autograd), every other product the stock one
    (its class's own ``forward``)."""

    _wide_pack: tuple | None = None  # (what the weight was when packed, the packed copy)

    def _out_in_weight(self) -> torch.Tensor:
        """The weight as ``[out, in]`` (what MKL packs)."""
        raise NotImplementedError

    def _in_out(self) -> tuple[int, int]:
        """``(in_features, out_features)``."""
        raise NotImplementedError

    def _packs(self, x: torch.Tensor) -> bool:
        weight = self.weight
        if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" \
                or weight.device.type != "cpu":
            return False
        return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))

    def _packed(self) -> torch.Tensor:
        """The packed copy of the weight as it now is (packed again after the weight changed)."""
        weight = self.weight
        state = (weight.data_ptr(), weight._version, tuple(weight.shape))
        found = self._wide_pack
        if found is None or found[0] != state:
            found = self._wide_pack = (state, mkl_gemm.pack(self._out_in_weight()))
        return found[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_features, out_features = self._in_out()
        rows = x.numel() // max(in_features, 1)
        if rows < 2 or not self._packs(x):
            return super().forward(x)
        bias = None if self.bias is None else self.bias.detach()
        out = mkl_gemm.product(x.reshape(rows, in_features).contiguous(), self._packed(), out_features, bias)
        return out.view(*x.shape[:-1], out_features)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_wide_pack", None)  # valid only where MKL wrote it: packed again when next needed
        return state


class WideLinear(_WideProducts, nn.Linear):
    """An ``nn.Linear`` whose products of two rows or more use its weight packed once by MKL."""

    def _out_in_weight(self) -> torch.Tensor:
        return self.weight.detach()

    def _in_out(self) -> tuple[int, int]:
        return self.in_features, self.out_features


class WideConv1D(_WideProducts, Conv1D):
    """GPT-2's ``Conv1D`` (weight ``[in, out]``) whose products of two rows or more use its weight
    packed once by MKL."""

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


def why_not_pack_wide(model) -> str | None:
    """Why :func:`pack_wide` would refuse ``model``, or None where it packs it."""
    from .kernels import PackedLinear  # the prepared layers of probe_mtp.optimize

    if not mkl_gemm.available():
        return ("this torch carries no MKL whose packed float32 product probe-mtp can call (macOS, ARM, a build "
                "without MKL)")
    if any(isinstance(module, PackedLinear) for module in model.modules()):
        return ("the model is prepared by probe_mtp.optimize (its layers already compute with packed, "
                "row-invariant products)")
    layers = [module for module in model.modules() if type(module) in WIDE_CLASSES]
    if not layers:
        return f"{type(model).__name__} has no nn.Linear or Conv1D layers to pack"
    found = {(module.weight.dtype, module.weight.device.type) for module in layers}
    if found != {(torch.float32, "cpu")}:
        where = ", ".join(sorted(f"{str(dtype).replace('torch.', '')} on {device}" for dtype, device in found))
        return f"packing is for float32 weights on the CPU; this model's linear layers hold {where}"
    return None


def pack_wide(model):
    """Pack every float32 linear layer of ``model`` (on the CPU) once by MKL for its products of two
    rows or more, in place; one-row products stay the stock ones (see the module's notes for what
    that guarantees).  Returns the model.  :class:`PackWideError` (nothing changed) where it cannot:
    no MKL in this torch, weights not float32 on the CPU, a model prepared by ``optimize``."""
    reason = why_not_pack_wide(model)
    if reason is not None:
        raise PackWideError(f"cannot pack {type(model).__name__} for wide products: {reason}")
    for module in list(model.modules()):
        wide = WIDE_CLASSES.get(type(module))
        if wide is not None:
            module.__class__ = wide
            module._packed()  # now, not in the first pass
    return model


def unpack_wide(model):
    """Turn every layer :func:`pack_wide` packed back into its stock class (the packed copies freed);
    returns the model."""
    for module in model.modules():
        stock = STOCK_CLASSES.get(type(module))
        if stock is not None:
            module.__dict__.pop("_wide_pack", None)
            module.__class__ = stock
    return model
