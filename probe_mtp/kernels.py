"""Kernels for exact decoding in reduced precision: the processor check, linear layers whose rows
do not depend on the pass, and an attention whose result for a row does not depend on the pass.

Why.  A bf16 pass of 16-32 inputs costs about one token on matrix units (AMX, AVX512-BF16, every
GPU), but a wide pass rounds differently from a one-token pass, so tree verification in bf16
drifts from ``model.generate`` (and stock PyTorch on a CPU reorders a bf16 weight into oneDNN's
blocked layout at every call).  Exactness needs each computation of a row to give the same bits
however many rows the pass holds and whatever else the pass holds (other tree nodes, masks,
padding).  This module provides the two parts of a forward pass that break that, each checked,
not assumed, on whatever device the model is on; the dtype is a parameter throughout:

- :class:`PackedLinear`: a linear layer whose weight is packed once: for oneDNN
  (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``) where oneDNN runs that
  dtype (a CPU, bf16), by MKL (:mod:`probe_mtp.mkl_gemm`: float32 on a CPU where torch carries
  MKL, whose stock product repacks the whole weight at every call of two rows or more), else
  computed with the stock product on the plain weight
  (``torch.nn.functional.linear``: an accelerator's BLAS, or a CPU without a packing library).
  Every kernel picks its algorithm from the product's shape: measured on an AMD EPYC
  (AVX512-BF16), a one-row oneDNN product sums in another order than products of 2 to 1500 rows,
  and MKL's float32 product here differs between widths.  How rows reach the kernel
  (:class:`RowPlan`: each call padded to one of a few widths, a lone row left alone where the
  check allows or padded to two, or fixed blocks of rows) is chosen per weight shape, kernel,
  dtype, device and thread count by :func:`choose_row_plan`, which compares every width a call
  can have with the one-row computation bit for bit, on that device, before the plan is used.
- :func:`exact_attention` (registered with transformers' ``AttentionInterface`` as
  :data:`EXACT_ATTENTION`): scores, softmax and the weighted sum of values in float64, rounded
  once to the model's dtype.  The products of bf16 queries and keys are exact in float64 and
  their sums almost always are, so a score does not depend on the order a kernel sums in; the
  softmax and the value sum carry rounding errors near 2^-50, which a rounding to bf16 (steps of
  2^-8) turns into a different result only when the exact value lies that close to a rounding
  boundary: about once in 2^40 elements (once in 2^26 for float32's steps of 2^-24).  sdpa's
  fused kernel and eager attention instead sum in an order that depends on the number of queries
  and on where masked keys sit (a tree node's ancestors are spread among other nodes), which
  changed rows in every wide pass measured.

Everything else in a transformer layer (norms, rotary embeddings, activations, residual adds) is
computed row by row with the same operations at any width; the architecture tests check it on
the CPU.
"""

from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.pytorch_utils import Conv1D

from . import mkl_gemm

EXACT_ATTENTION = "probe_mtp_exact"
# a call of up to MOST_ROWS rows (MOST_ROWS_LARGE for weights above LARGE_WEIGHT elements: output
# layers, 28M for SmolLM2 and 168M for Gemma 3) is zero-padded to the next of a few widths (see
# bucket_rows); longer inputs are cut into calls of at most that many rows.  oneDNN builds and keeps
# a kernel for every distinct row count it is called with (measured: 0.6 MB each for a 1536 x 576
# weight, so 320 MB after the 512 row counts of varied prompt lengths); a few widths bound that, and
# the check below covers every width a call can have
MOST_ROWS = 512
MOST_ROWS_LARGE = 128
LARGE_WEIGHT = 16 * 2**20
CHECK_ROWS = 48  # distinct random input rows per check
# each check row also holds this many pairs of large entries whose products with one output's
# weights cancel exactly, each product this many times the row's result: a kernel that sums in
# another order at another width then gives visibly different bits (random rows alone show it only
# where a sum falls near a rounding boundary, in about one output of 10^4 for bf16)
CANCELLING_PAIRS = 4
CANCELLING_SIZE = 2.0**16
ATTENTION_BYTES = 64 * 2**20  # float64 scores of one attention call are computed in query chunks of at most this
QUERY_CHUNK = 256  # ... and of at most this many queries, each chunk over the keys its queries can see


# ------------------------------------------------------------------------------- the processor
@dataclass(frozen=True)
class Processor:
    """What this CPU offers: its model name, the bf16 matrix-unit flags the kernel reports
    (``amx_bf16``, ``avx512_bf16`` in ``/proc/cpuinfo``), whether oneDNN runs bf16 products and
    whether it runs float32 ones (so weights of that dtype can be packed once)."""

    name: str
    flags: frozenset = field(default_factory=frozenset)
    onednn_bf16: bool = False
    onednn_float32: bool = True
    vendor: str = ""  # /proc/cpuinfo's vendor_id: GenuineIntel, AuthenticAMD ("" where unknown)

    @property
    def matrix_units(self) -> str | None:
        """``"AMX"``, ``"AVX512-BF16"`` or None: the bf16 matrix instructions this processor has."""
        if "amx_bf16" in self.flags:
            return "AMX"
        if "avx512_bf16" in self.flags:
            return "AVX512-BF16"
        return None

    @property
    def has_bf16_units(self) -> bool:
        return self.matrix_units is not None and self.onednn_bf16

    def packs(self, dtype: torch.dtype) -> bool:
        """Whether oneDNN runs products of ``dtype`` here, so a weight of it can be packed once."""
        return (dtype == torch.bfloat16 and self.onednn_bf16) or (dtype == torch.float32 and self.onednn_float32)

    def fast_for(self, dtype: torch.dtype) -> bool:
        """Whether products of ``dtype`` run at full speed here: float32 everywhere, bf16 only on
        bf16 matrix units (elsewhere it computes, exactly as well, only more slowly than float32)."""
        return dtype == torch.float32 or (dtype == torch.bfloat16 and self.has_bf16_units)

    def describe(self) -> str:
        if self.matrix_units and not self.onednn_bf16:  # e.g. oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA)
            return f"{self.name} ({self.matrix_units}, unused: oneDNN runs no bf16 here)"
        return f"{self.name} ({self.matrix_units or 'no bf16 matrix units'})"


# environment variables that hold a processor's kernels back (or pin them) without changing its name:
# oneDNN's and MKL's instruction-set caps, ATen's vectorisation level, MKL's reproducibility mode
KERNEL_ENVIRONMENT = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY",
                      "MKL_CBWR")


def kernel_environment() -> dict[str, str]:
    """Those of :data:`KERNEL_ENVIRONMENT` that are set, with their values (empty on most machines):
    timings and choices kept per processor are kept per these too."""
    return {name: os.environ[name] for name in KERNEL_ENVIRONMENT if os.environ.get(name)}


def _cpuinfo_field(name: str) -> str | None:
    """The first ``name : value`` of ``/proc/cpuinfo`` (None where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.lower().startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def processor_name() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` says)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def processor_vendor() -> str:
    """The processor's vendor as ``/proc/cpuinfo`` names it (``GenuineIntel``, ``AuthenticAMD``);
    empty where unknown."""
    return _cpuinfo_field("vendor_id") or ""


def mkl_first(cpu: "Processor") -> bool:
    """Whether float32 weights are packed by MKL before oneDNN on ``cpu``: on an Intel processor
    (on a Xeon, free and held to AVX2, MKL's packed products were the faster; on AMD EPYCs 1.4-2x
    slower than oneDNN's at 2-16 rows)."""
    return cpu.vendor == "GenuineIntel"


def _cpu_flags() -> frozenset:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def processor() -> Processor:
    """This machine's processor (read once: it does not change while a process runs)."""
    onednn = bool(torch.backends.mkldnn.is_available())
    if onednn:
        try:
            onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            onednn = False
    wanted = {"amx_bf16", "avx512_bf16"}
    return Processor(processor_name(), frozenset(f for f in _cpu_flags() if f in wanted), onednn,
                     bool(torch.backends.mkldnn.is_available()), processor_vendor())


def device_description(device: torch.device) -> str:
    """What computes on ``device``: the processor (with its bf16 matrix units) for the CPU, the
    accelerator's name where torch can tell it, else the device itself."""
    device = torch.device(device)
    if device.type == "cpu":
        return processor().describe()
    backend = getattr(torch, device.type, None)
    name = getattr(backend, "get_device_name", None)
    if callable(name):
        try:
            return f"{name(device)} ({device})"
        except (RuntimeError, AssertionError, ValueError):
            pass
    return str(device)


def holds_data(device: torch.device) -> bool:
    """Whether tensors on ``device`` hold values (not ``meta``, which keeps shapes only: nothing
    there can be checked, and nothing computed there is a result)."""
    return torch.device(device).type != "meta"


def math_settings(device: torch.device) -> tuple:
    """The global switches that decide how products on ``device`` round: the thread count (oneDNN
    splits by it), float32 matmul precision (TF32 or bf16 inside float32 products) and, on CUDA,
    reduced-precision reductions in bf16 / fp16 products.  A row plan holds for one setting of
    them; another is checked again before its first product."""
    settings = (torch.get_num_threads(), torch.get_float32_matmul_precision())
    if torch.device(device).type == "cuda":
        matmul = torch.backends.cuda.matmul
        settings += (matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction,
                     matmul.allow_fp16_reduced_precision_reduction)
    return settings


# ------------------------------------------------------------------------------- linear layers
@dataclass(frozen=True)
class RowPlan:
    """How the rows of a product reach the kernel.  ``block`` 0: each call zero-padded to the next
    of a few widths (:func:`bucket_rows`; by default a lone row becomes two, for kernels whose
    one-row product sums in another order); ``block`` B: always in calls of exactly B rows,
    zero-padded.  ``most``: the most rows one call may hold (longer inputs are cut into calls of at most that many).
    ``least``: under the padding plan, the fewest rows a call holds (a lone row is padded to it)."""

    block: int = 0
    most: int = MOST_ROWS
    least: int = 2

    def describe(self) -> str:
        if self.block:
            return f"rows in blocks of {self.block}"
        first = f"{self.least}-8, by 8" if self.least < 8 else f"{self.least}, by 8"
        return (f"calls zero-padded to a few row counts ({first} to 128, by 16 to 256, by 32 beyond; "
                f"at most {self.most} rows a call)")

    def widths(self) -> tuple[int, ...]:
        """Every row count a call to the kernel can have under this plan."""
        if self.block:
            return (self.block,)
        return tuple(sorted({bucket_rows(rows, self.most, self.least) for rows in range(1, self.most + 1)}))


def describe_plans(plans) -> str:
    """Several layers' plans in one phrase: the padding scheme once, with each call's largest row
    count and where a lone row is padded, and each block size."""
    padded = [plan for plan in plans if not plan.block]
    parts = []
    if padded:
        most = " or ".join(str(m) for m in sorted({plan.most for plan in padded}))
        lone = sorted({plan.least for plan in padded if plan.least > 1})
        where = "" if all(plan.least > 1 for plan in padded) else " in some layers"
        lone_rows = f"; a lone row padded to {' or '.join(map(str, lone))}{where}" if lone else ""
        parts.append(f"calls zero-padded to a few row counts (up to 8 as they are, then by 8 to 128, by 16 to 256, "
                     f"by 32 beyond; at most {most} rows a call{lone_rows})")
    parts += [f"rows in blocks of {block}" for block in sorted({plan.block for plan in plans if plan.block})]
    return ", ".join(parts)


def bucket_rows(rows: int, most: int = MOST_ROWS, least: int = 2) -> int:
    """The row count a call of ``rows`` rows (``1 <= rows <= most``) is padded to: ``least`` (2: a
    lone row becomes two) for ``rows`` up to it, the count itself up to 8, the next multiple of 8 up
    to 128, then of 16 up to 256 and of 32 beyond (``most``, a multiple of 32, at most).  38 widths
    up to 512; past 64 rows, where a call costs in proportion to its rows, the padding stays under
    1/8 of them."""
    if rows <= least:
        return least
    if rows <= 8:
        return rows
    step = 8 if rows <= 128 else 16 if rows <= 256 else 32
    return min(-(-rows // step) * step, most)


# tried in this order; a plan's ``most`` is lowered to the weight's (see most_rows).  A lone row
# first goes to the kernel as it is: measured on the Xeon (AMX, and held to AVX2, 2 threads) packed
# bf16 products sum a row alike at 1 row and at every width the check tries, and the one-row call
# is cheaper (a prepared SmolLM2 pass over one input 45.0 -> 42.0 ms with AMX, 54.5 -> 44.4 ms held
# to AVX2); on the AVX512-BF16 EPYC the one-row product sums in another order, and the plans that
# pad it to two follow.  Packed bf16 down projections sum in another order from 160 rows on there,
# so calls of at most 128 rows come next; MKL's float32 product and the stock bf16 product differ
# between widths, and run in blocks
PLANS = (RowPlan(0, least=1), RowPlan(0, MOST_ROWS_LARGE, least=1), RowPlan(0), RowPlan(0, MOST_ROWS_LARGE),
         RowPlan(16), RowPlan(32))
# MKL's packed float32 product (probe_mtp.mkl_gemm) first without padding a lone row: measured here it
# sums a row of any width alike, except held to AVX2, where the output layers and most of Gemma 3's
# layers sum calls of 1-7 rows in another order than wider ones (their lone rows are padded to 8)
MKL_PLANS = (RowPlan(0, least=1), RowPlan(0, least=4), RowPlan(0, least=8), RowPlan(0, MOST_ROWS_LARGE, least=4),
             RowPlan(16), RowPlan(32))


class RowVarianceError(RuntimeError):
    """A kernel rounds a row differently depending on how many rows a product holds, for every plan
    tried: decoding with it could not stay exact."""


def run_rows(kernel, x2d: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """``kernel`` (a function of a ``[M, K]`` tensor) applied to ``x2d`` along ``plan``."""
    rows = x2d.shape[0]
    if rows > plan.most:
        return torch.cat([run_rows(kernel, x2d[start : start + plan.most], plan)
                          for start in range(0, rows, plan.most)])
    if plan.block:
        step = plan.block
        padded = -(-rows // step) * step
        x2d = _pad_rows(x2d, padded)
        parts = [kernel(x2d[i : i + step]) for i in range(0, padded, step)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
    else:
        out = kernel(_pad_rows(x2d, bucket_rows(rows, plan.most, plan.least)))
    return out if out.shape[0] == rows else out[:rows]


def _pad_rows(x2d: torch.Tensor, rows: int) -> torch.Tensor:
    if rows == x2d.shape[0]:
        return x2d
    return torch.cat([x2d, x2d.new_zeros(rows - x2d.shape[0], x2d.shape[1])])


def check_rows(in_features: int, dtype: torch.dtype, device: torch.device | str = "cpu",
               weight_columns=None) -> torch.Tensor:
    """The :data:`CHECK_ROWS` input rows a check feeds a kernel, in ``dtype`` on ``device``: random
    rows of a realistic spread of magnitudes, drawn on the CPU (the same rows for every device).
    With ``weight_columns`` (positions -> the weight's columns there, ``[len, out]``) each row also
    holds :data:`CANCELLING_PAIRS` pairs of large entries whose products with the weights of one
    output (a different one per row) cancel exactly, so that output's bits depend on the order
    the kernel sums in (see :data:`CANCELLING_SIZE`)."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    rows = torch.randn(CHECK_ROWS, in_features, generator=gen, device="cpu", dtype=torch.float64)
    scale = torch.exp2(torch.randint(-3, 4, (CHECK_ROWS, 1), generator=gen, device="cpu").double())
    rows *= scale
    if weight_columns is not None and in_features >= 2 * CANCELLING_PAIRS:
        _add_cancelling_pairs(rows, scale, weight_columns, gen)
    return rows.to(device=device, dtype=dtype)


def _add_cancelling_pairs(rows: torch.Tensor, scale: torch.Tensor, weight_columns, gen: torch.Generator) -> None:
    """Write into ``rows`` (float64, ``[R, K]``) pairs ``x[k1] = b * w[j, k2]``, ``x[k2] = -b * w[j, k1]``
    for output ``j`` of row r: products ``b * w1 * w2`` and its negative, exact in any dtype (``b``
    a power of two), sized :data:`CANCELLING_SIZE` times the row's expected result."""
    count, in_features = rows.shape
    positions = torch.randperm(in_features, generator=gen, device="cpu")[: 2 * CANCELLING_PAIRS]
    columns = weight_columns(positions).detach().to(device="cpu", dtype=torch.float64)  # [2P, out]
    out_features = columns.shape[1]
    targets = torch.arange(count, device="cpu") * out_features // count
    first, second = columns[0::2, targets], columns[1::2, targets]  # [P, R]
    typical = columns.pow(2).mean().sqrt() * in_features**0.5 * scale.t()  # [1, R]: the size of a row's result
    product = (first * second).abs()
    size = torch.exp2(torch.round(torch.log2(CANCELLING_SIZE * typical / product.clamp_min(1e-300))))
    size = torch.where(product > 0, size, torch.zeros_like(size))
    rows[:, positions[0::2]] = (size * second).t()
    rows[:, positions[1::2]] = (-size * first).t()


@torch.no_grad()
def rows_agree(kernel, in_features: int, plan: RowPlan, widths: tuple[int, ...] | None = None,
               dtype=torch.bfloat16, device: torch.device | str = "cpu", weight_columns=None) -> bool:
    """Whether every row of a product of each width in ``widths`` (default: every width a call can
    have under ``plan``) equals the same row computed alone, bit for bit, under ``plan``, with the
    input rows of :func:`check_rows` in ``dtype`` on ``device`` (the kernel's); ``weight_columns``:
    see there (without it, a kernel that sums in another order at another width is caught only
    where a sum falls near a rounding boundary)."""
    rows = check_rows(in_features, dtype, torch.device(device), weight_columns)
    alone = torch.cat([run_rows(kernel, rows[i : i + 1], plan) for i in range(CHECK_ROWS)])
    for width in plan.widths() if widths is None else widths:
        index = torch.arange(width, device=rows.device) % CHECK_ROWS
        if not torch.equal(run_rows(kernel, rows[index], plan), alone[index]):
            return False
    return True


def most_rows(out_features: int, in_features: int) -> int:
    """The most rows one call with a weight of this shape may hold."""
    return MOST_ROWS_LARGE if out_features * in_features > LARGE_WEIGHT else MOST_ROWS


def plans_for(out_features: int, in_features: int, kind: str | None = None) -> list[RowPlan]:
    """The plans of :data:`PLANS` (:data:`MKL_PLANS` for ``kind`` :data:`MKL`) for a weight of this
    shape, in order, each call at most :func:`most_rows` rows (duplicates dropped)."""
    most = most_rows(out_features, in_features)
    found = []
    for plan in MKL_PLANS if kind == MKL else PLANS:
        plan = RowPlan(plan.block, min(plan.most, most), plan.least)
        if plan not in found:
            found.append(plan)
    return found


def choose_row_plan(kernel, out_features: int, in_features: int, dtype=torch.bfloat16,
                    device: torch.device | str = "cpu", weight_columns=None, kind: str | None = None) -> RowPlan:
    """The first plan of :func:`plans_for` (``kind``: the kernel's, see there) under which
    ``kernel`` (computing on ``device``) is row-invariant with the current :func:`math_settings`
    (see :func:`rows_agree`, at every width a call can have); :class:`RowVarianceError`, naming
    the weight shape, when none is."""
    for plan in plans_for(out_features, in_features, kind):
        if rows_agree(kernel, in_features, plan, dtype=dtype, device=device, weight_columns=weight_columns):
            return plan
    raise RowVarianceError(
        f"on {device_description(device)} ({torch.get_num_threads()} threads) a {dtype} product with a "
        f"[{out_features}, {in_features}] weight rounds a row differently depending on how many rows it holds, "
        f"under every plan tried ({'; '.join(p.describe() for p in plans_for(out_features, in_features, kind))}); exact decoding in {dtype} is not "
        f"possible here: {_wider_advice(dtype)}"
    )


def _wider_advice(dtype: torch.dtype) -> str:
    """What to decode in where ``dtype`` cannot be made row-invariant."""
    if dtype == torch.float32:
        return "decode with the stock kernels (float32 differs from a one-row pass only at near-ties)"
    return "decode in float32"


def onednn_kernel(packed: torch.Tensor, bias: torch.Tensor | None):
    def kernel(x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x2d, packed, bias, "none", [], "")

    return kernel


def mkl_kernel(packed: torch.Tensor, out_features: int, bias: torch.Tensor | None):
    """A float32 product with a weight packed once by MKL (:func:`probe_mtp.mkl_gemm.pack`)."""

    def kernel(x2d: torch.Tensor) -> torch.Tensor:
        return mkl_gemm.product(x2d, packed, out_features, bias)

    return kernel


def stock_kernel(weight: torch.Tensor, bias: torch.Tensor | None):
    def kernel(x2d: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x2d, weight, bias)

    return kernel


class PlanKey(NamedTuple):
    """What a row plan holds for: a weight shape (and whether a bias is added), the kernel (packed
    or stock), the dtype, the device and the :func:`math_settings` there."""

    out_features: int
    in_features: int
    bias: bool
    kind: str
    dtype: torch.dtype
    device: torch.device
    settings: tuple


class RowPlans:
    """The row plan of each :class:`PlanKey`, chosen (so checked) on first use and shared by every
    layer of one prepared model: a model prepared at 2 threads and later run at 4, or moved to
    another device or dtype, is checked again there before its first product."""

    def __init__(self):
        self._plans: dict[PlanKey, RowPlan] = {}

    def plan(self, layer: "PackedLinear") -> RowPlan:
        """The plan for ``layer`` where it now computes (on ``meta``, which holds no values, the
        padding plan, unchecked: a pass there computes shapes only)."""
        if not holds_data(layer.device):
            return plans_for(layer.out_features, layer.in_features, layer.kind)[0]
        key = PlanKey(layer.out_features, layer.in_features, layer.bias is not None, layer.kind,
                      layer.dtype, layer.device, math_settings(layer.device))
        found = self._plans.get(key)
        if found is None:
            found = self._plans[key] = layer.choose_plan()
        return found

    def describe(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> str:
        """The plans chosen so far (on ``device`` in ``dtype`` where given)."""
        plans = {plan for key, plan in self._plans.items()
                 if (device is None or key.device == torch.device(device)) and (dtype is None or key.dtype == dtype)}
        return describe_plans(plans) if plans else "row plans checked on first use"


def _as_out_in(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``[out, in]`` weight and the bias of an ``nn.Linear``, a GPT-2 style ``Conv1D`` or a
    :class:`PackedLinear`."""
    bias = None if module.bias is None else module.bias.detach()
    if isinstance(module, Conv1D):
        return module.weight.detach().t(), bias
    return module.weight.detach(), bias


# how a PackedLinear computes: its weight packed once for oneDNN, packed once by MKL (float32), or
# the stock product on the plain weight
ONEDNN, MKL, STOCK = "oneDNN", "MKL", "stock"


def packing(dtype: torch.dtype, cpu: "Processor | None" = None) -> str:
    """How a CPU layer computing in ``dtype`` packs its weight here: float32 on an Intel processor by
    MKL where this torch has it (measured on a Xeon, free and held to AVX2, faster than oneDNN's
    packed float32 and than the stock product at every width from 1 to 32 rows), elsewhere by
    oneDNN (on an AMD EPYC MKL's packed products ran 1.4-2x slower than oneDNN's), by MKL where
    oneDNN runs no float32; other dtypes by oneDNN where it runs them; else not at all."""
    cpu = cpu or processor()
    if dtype == torch.float32 and mkl_gemm.available() and (mkl_first(cpu) or not cpu.packs(dtype)):
        return MKL
    return ONEDNN if cpu.packs(dtype) else STOCK


class PackedLinear(nn.Module):
    """A linear layer computing in one dtype (bf16 by default), row-invariant under the row plan its
    :class:`RowPlans` chooses where it computes.

    ``kind`` says how: :data:`ONEDNN`, ``packed`` holds the weight packed once for oneDNN (an
    opaque tensor; no other copy is kept); :data:`MKL` (float32), ``plain`` holds the ``[out, in]``
    weight and ``mkl_pack`` a copy packed by MKL (:mod:`probe_mtp.mkl_gemm`, made at the first
    product, again after a copy or unpickling); :data:`STOCK`, ``plain`` is multiplied with the stock
    product (``torch.nn.functional.linear``: on an accelerator, on a CPU without a packing library
    for the dtype, or after a move).  ``pack=True`` picks :func:`packing` for the dtype, False the
    stock product; a kind may be named instead.  A plain weight in the dtype and on the device it
    was given is used as it is (no copy: a tied output layer shares the embedding's storage).

    What a plain layer offers still works: ``state_dict()`` gives the weight unpacked under
    ``weight`` and ``load_state_dict`` repacks it; ``weight`` reads the unpacked weight;
    ``copy.deepcopy`` and pickling unpack and repack.  ``.to()`` / ``.float()`` / ``.cuda()`` to
    another dtype or device turn a packed layer into a plain one there, and every layer stays
    row-invariant: its plan for the new device and dtype is checked before its first product
    there (:class:`RowVarianceError` from that product where no plan holds)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plans: RowPlans, pack: bool | str = True,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.plans = plans
        weight = weight.detach().to(dtype).contiguous()
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        kind = pack if isinstance(pack, str) else packing(dtype) if pack else STOCK
        if kind not in (ONEDNN, MKL, STOCK) or (kind == MKL and dtype != torch.float32):
            raise ValueError(f"a {dtype} layer cannot compute as {kind!r} (kinds: {ONEDNN}, {MKL} for float32, {STOCK})")
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if kind == ONEDNN else None
        self.plain = None if kind == ONEDNN else weight
        self.mkl = kind == MKL  # the plain weight multiplied packed by MKL
        self.mkl_pack: torch.Tensor | None = None
        self._ready = None  # (math settings, plan, kernel) of the last product: see _plan_and_kernel

    @classmethod
    def from_module(cls, module: nn.Module, plans: RowPlans, pack: bool | str = True,
                    weight: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> "PackedLinear":
        """The form of ``module`` (an ``nn.Linear``, ``Conv1D`` or :class:`PackedLinear`) computing in
        ``dtype``, packed as ``pack`` says; ``weight``: its ``[out, in]`` weight already in ``dtype``
        (a tied output layer's, cast once for the embedding too)."""
        own, bias = _as_out_in(module)
        return cls(own if weight is None else weight, bias, plans, pack, dtype)

    @property
    def kind(self) -> str:
        return ONEDNN if self.packed is not None else MKL if self.mkl else STOCK

    def kernel(self):
        bias = None if self.bias is None else self.bias.detach()
        if self.packed is not None:
            return onednn_kernel(self.packed, bias)
        if self.mkl:
            if self.mkl_pack is None:
                self.mkl_pack = mkl_gemm.pack(self.plain)
            return mkl_kernel(self.mkl_pack, self.out_features, bias)
        return stock_kernel(self.plain, bias)

    def choose_plan(self) -> RowPlan:
        return choose_row_plan(self.kernel(), self.out_features, self.in_features, self.dtype, self.device,
                               self.columns, self.kind)

    def columns(self, positions: torch.Tensor) -> torch.Tensor:
        """The weight's columns at ``positions``, ``[len(positions), out]``: read from the plain
        weight, or through the packed weight's bias-free kernel on one-hot rows (each output then
        one product by 1, exact)."""
        if self.packed is None:
            return self.plain[:, positions.to(self.plain.device)].t()
        basis = torch.zeros(len(positions), self.in_features, dtype=self.dtype, device="cpu")
        basis[torch.arange(len(positions), device="cpu"), positions] = 1
        return run_rows(onednn_kernel(self.packed, None), basis, RowPlan())

    @property
    def dtype(self) -> torch.dtype:
        return (self.packed if self.packed is not None else self.plain).dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.packed is not None else self.plain.device

    @property
    def weight(self) -> torch.Tensor:
        """The weight ``[out, in]``, unpacked (a copy when packed for oneDNN)."""
        return self.packed.to_dense() if self.packed is not None else self.plain

    def weight_bytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2d = x.reshape(-1, self.in_features)
        if x2d.dtype != self.dtype:
            x2d = x2d.to(self.dtype)
        plan, kernel = self._plan_and_kernel()
        out = run_rows(kernel, _aligned(x2d.contiguous()), plan)
        return out.reshape(*shape[:-1], self.out_features)

    def _plan_and_kernel(self):
        """The row plan and kernel of a product now, kept while the math settings stay as they were
        (looked up at every product they cost 10 us each, 2 ms of a SmolLM2 pass); a change of
        weight, device or dtype drops them."""
        settings = math_settings(self.device)
        ready = self._ready
        if ready is None or ready[0] != settings:
            ready = self._ready = (settings, self.plans.plan(self), self.kernel())
        return ready[1], ready[2]

    def extra_repr(self) -> str:
        kind = {ONEDNN: f"packed {self.dtype} (oneDNN)", MKL: f"packed {self.dtype} (MKL)",
                STOCK: f"stock product, {self.dtype} on {self.device}"}[self.kind]
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kind}"

    # ---- what a plain layer offers
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key in state_dict:
            weight = state_dict[key]
            if tuple(weight.shape) != (self.out_features, self.in_features):
                error_msgs.append(f"size mismatch for {key}: {tuple(weight.shape)} instead of "
                                  f"{(self.out_features, self.in_features)}")
                return
            self._set_weight(weight.detach())
        elif strict:
            missing_keys.append(key)
        bias_key = prefix + "bias"
        if self.bias is not None:
            if bias_key in state_dict:
                with torch.no_grad():
                    self.bias.copy_(state_dict[bias_key])
            elif strict:
                missing_keys.append(bias_key)

    def _set_weight(self, weight: torch.Tensor) -> None:
        """Take ``weight`` (``[out, in]``) in this layer's dtype, on its device, packed if it is."""
        weight = weight.to(device=self.device, dtype=self.dtype).contiguous()
        self._ready = None
        if self.packed is not None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        else:
            self.plain, self.mkl_pack = weight, None

    def _apply(self, fn, recurse=True):
        # where fn sends a tensor of this layer's dtype and device, learnt from an empty one (a
        # packed weight is not unpacked for a move that changes nothing)
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        moved = (probe.dtype, probe.device) != (self.dtype, self.device)
        self._ready = None
        if self.packed is None:
            plain, self.plain = self.plain, fn(self.plain)
            if moved:
                self.mkl, self.mkl_pack = False, None
            elif self.plain is not plain:
                self.mkl_pack = None
        elif moved:
            self.packed, self.plain = None, fn(self.weight)
        return super()._apply(fn, recurse)

    def __getstate__(self):
        state = self.__dict__.copy()
        if state.get("packed") is not None:
            state["packed"] = None
            state["_unpacked"] = self.packed.to_dense()
        state["mkl_pack"] = None  # never copied (valid only where MKL wrote it): packed again at the first product
        state["_ready"] = None
        return state

    def __setstate__(self, state):
        unpacked = state.pop("_unpacked", None)
        state.setdefault("mkl", False)
        state.setdefault("mkl_pack", None)
        state["_ready"] = None
        super().__setstate__(state)
        if unpacked is not None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(unpacked, 1)


def _aligned(x2d: torch.Tensor) -> torch.Tensor:
    """``x2d``, copied when its data do not start on a 16-byte boundary: BLAS libraries (cuBLASLt)
    choose kernels by operand alignment too, and the checks run on aligned rows."""
    return x2d.clone() if x2d.data_ptr() % 16 else x2d


# ------------------------------------------------------------------------------- attention
def _visible(attention_mask, heads_kv: int, groups: int, queries: int, keys: int, causal: bool,
             device: torch.device):
    """The mask as ``[B | 1, H_kv | 1, G | 1, N, T]`` (bool: True = attend, or additive float), or
    None: every key.  A mask made here is made on ``device`` (the queries')."""
    if attention_mask is None:
        if queries == 1 or not causal:
            return None
        # no mask with several queries: causal, the queries being the last ``queries`` keys
        rows = torch.arange(keys - queries, keys, device=device)[:, None]
        return (rows >= torch.arange(keys, device=device)[None])[None, None, None]
    mask = attention_mask[..., :keys]
    heads = mask.shape[1]
    if heads == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], heads_kv, groups, queries, keys)


def exact_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                    softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """Attention whose result for a query row depends only on that row's query and the keys and
    values it attends to, not on how many queries the pass holds or where masked keys sit.

    ``query`` ``[B, H, N, D]``, ``key`` / ``value`` ``[B, H_kv, T, D | Dv]`` (grouped queries share
    key heads without copies), ``attention_mask``: None (causal; a lone query sees every key),
    boolean (True = attend) or additive float, ``[B, 1 | H, N, >= T]``.  Computed in float64 and
    rounded once to the query's dtype (see the module's notes); every tensor it makes is made on
    the query's device.  Returns ``([B, N, H, Dv], None)``.
    Softcapping (Gemma 2) is applied to the scores; attention sinks (``s_aux``) are refused."""
    if s_aux is not None:
        raise NotImplementedError("exact attention does not implement attention sinks (s_aux)")
    if dropout and module.training:
        raise NotImplementedError("exact attention is for inference (dropout > 0 in training mode)")
    batch, heads, queries, dim = query.shape
    heads_kv, keys = key.shape[1], key.shape[2]
    groups = heads // heads_kv
    scale = dim**-0.5 if scaling is None else scaling
    keys64 = key.to(torch.float64).transpose(-1, -2)  # [B, H_kv, D, T]
    values64 = value.to(torch.float64)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = _visible(attention_mask, heads_kv, groups, queries, keys, causal, query.device)
    per_query = heads * keys * 8 * batch
    step = max(1, min(queries, QUERY_CHUNK, ATTENTION_BYTES // max(per_query, 1)))
    outputs = []
    for start in range(0, queries, step):
        stop = min(queries, start + step)
        part = None if mask is None else mask[..., start:stop, :]
        # keys after the last one these queries see add exact zeros: a long causal prefill in
        # chunks skips half its products.  Finding them reads the mask on the host (a wait on an
        # accelerator), so a pass of one chunk (every decoding step) does not look
        seen = _keys_seen(part, keys) if step < queries else keys
        if part is not None and seen < keys:
            part = part[..., :seen]
        outputs.append(_attend(query[:, :, start:stop], keys64[..., :seen], values64[:, :, :seen], part, scale,
                               softcap, groups))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # [B, H, N, Dv]
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _keys_seen(mask, keys: int) -> int:
    """How many leading keys a chunk of queries can see (all of them for an additive mask)."""
    if mask is None or mask.dtype != torch.bool:
        return keys
    columns = mask.reshape(-1, mask.shape[-1]).any(dim=0).nonzero()
    return int(columns[-1]) + 1 if columns.numel() else keys


def _attend(query, keys64, values64, mask, scale: float, softcap: float | None, groups: int) -> torch.Tensor:
    batch, heads, queries, dim = query.shape
    heads_kv, keys = keys64.shape[1], keys64.shape[-1]
    q = query.reshape(batch, heads_kv, groups * queries, dim).to(torch.float64)
    scores = torch.matmul(q, keys64).mul_(scale)  # [B, H_kv, G*N, T]
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    grid = scores.view(batch, heads_kv, groups, queries, keys)
    if mask is not None:
        if mask.dtype == torch.bool:
            grid.masked_fill_(~mask, -math.inf)
        else:
            grid.add_(mask.to(torch.float64))
    top = scores.amax(dim=-1, keepdim=True)
    top.masked_fill_(top == -math.inf, 0.0)  # a row that sees nothing (a padding query): zeros
    weights = scores.sub_(top).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights, values64).div_(total.clamp_min_(torch.finfo(torch.float64).tiny))
    return out.view(batch, heads, queries, -1)


AttentionInterface.register(EXACT_ATTENTION, exact_attention)
AttentionMaskInterface.register(EXACT_ATTENTION, sdpa_mask)

