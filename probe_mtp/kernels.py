"""Kernels for exact bf16 decoding on a CPU's matrix units: the processor check, linear layers
packed once, and an attention whose result for a row does not depend on the pass.

Why.  A bf16 pass of 16-32 inputs costs about one token on matrix units (AMX, AVX512-BF16), but
stock PyTorch reorders a bf16 weight into oneDNN's blocked layout at every call, and a wide pass
rounds differently from a one-token pass, so tree verification in bf16 drifts from
``model.generate``.  Exactness needs each computation of a row to give the same bits however many
rows the pass holds and whatever else the pass holds (other tree nodes, masks, padding).  This
module provides the two parts of a forward pass that break that, each checked, not assumed:

- :class:`PackedLinear`: a linear layer whose bf16 weight is packed once for oneDNN
  (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``).  oneDNN picks its kernel
  from the product's shape: measured on an AMD EPYC (AVX512-BF16), a one-row product sums in
  another order than products of 2 to 1500 rows, which all agree row for row.  How rows reach the
  kernel (:class:`RowPlan`: each call padded to one of a few widths, a lone row to two, or fixed
  blocks of rows) is chosen per weight shape and thread count by :func:`choose_row_plan`, which
  compares every width a call can have with the one-row computation bit for bit before the plan
  is used.
- :func:`exact_attention` (registered with transformers' ``AttentionInterface`` as
  :data:`EXACT_ATTENTION`): scores, softmax and the weighted sum of values in float64, rounded
  once to the model's dtype.  The products of bf16 queries and keys are exact in float64 and
  their sums almost always are, so a score does not depend on the order a kernel sums in; the
  softmax and the value sum carry rounding errors near 2^-50, which a rounding to bf16 (steps of
  2^-8) turns into a different result only when the exact value lies that close to a rounding
  boundary: about once in 2^40 elements.  sdpa's fused kernel and eager attention instead sum in
  an order that depends on the number of queries and on where masked keys sit (a tree node's
  ancestors are spread among other nodes), which changed rows in every wide pass measured.

Everything else in a transformer layer (norms, rotary embeddings, activations, residual adds) is
computed row by row with the same operations at any width; the architecture tests check it.
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.pytorch_utils import Conv1D

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
ATTENTION_BYTES = 64 * 2**20  # float64 scores of one attention call are computed in query chunks of at most this
QUERY_CHUNK = 256  # ... and of at most this many queries, each chunk over the keys its queries can see


# ------------------------------------------------------------------------------- the processor
@dataclass(frozen=True)
class Processor:
    """What this CPU offers for bf16: its model name, the matrix-unit flags the kernel reports
    (``amx_bf16``, ``avx512_bf16`` in ``/proc/cpuinfo``) and whether oneDNN runs bf16 at all."""

    name: str
    flags: frozenset = field(default_factory=frozenset)
    onednn_bf16: bool = False

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

    def describe(self) -> str:
        units = self.matrix_units or "no bf16 matrix units"
        return f"{self.name} ({units})"


def processor_name() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` says)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    return Processor(processor_name(), frozenset(f for f in _cpu_flags() if f in wanted), onednn)


# ------------------------------------------------------------------------------- linear layers
@dataclass(frozen=True)
class RowPlan:
    """How the rows of a product reach the kernel.  ``block`` 0: each call zero-padded to the next
    of a few widths (:func:`bucket_rows`; a lone row becomes two, because the one-row kernel sums
    in another order); ``block`` B: always in calls of exactly B rows, zero-padded.  ``most``: the
    most rows one call may hold (longer inputs are cut into calls of at most that many)."""

    block: int = 0
    most: int = MOST_ROWS

    def describe(self) -> str:
        if self.block:
            return f"rows in blocks of {self.block}"
        return "calls zero-padded to a few row counts (2-8, by 8 to 128, by 16 to 256, by 32 beyond)"

    def widths(self) -> tuple[int, ...]:
        """Every row count a call to the kernel can have under this plan."""
        if self.block:
            return (self.block,)
        return tuple(sorted({bucket_rows(rows, self.most) for rows in range(1, self.most + 1)}))


def bucket_rows(rows: int, most: int = MOST_ROWS) -> int:
    """The row count a call of ``rows`` rows (``1 <= rows <= most``) is padded to: 2 for a lone row,
    the count itself up to 8, the next multiple of 8 up to 128, then of 16 up to 256 and of 32
    beyond (``most``, a multiple of 32, at most).  38 widths up to 512; past 64 rows, where a call
    costs in proportion to its rows, the padding stays under 1/8 of them."""
    if rows <= 1:
        return 2
    if rows <= 8:
        return rows
    step = 8 if rows <= 128 else 16 if rows <= 256 else 32
    return min(-(-rows // step) * step, most)


PLANS = (RowPlan(0), RowPlan(16), RowPlan(32))


class RowVarianceError(RuntimeError):
    """This processor's bf16 kernels round a row differently depending on how many rows a product
    holds, for every plan tried: decoding on them could not stay exact."""


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
        out = kernel(_pad_rows(x2d, bucket_rows(rows, plan.most)))
    return out if out.shape[0] == rows else out[:rows]


def _pad_rows(x2d: torch.Tensor, rows: int) -> torch.Tensor:
    if rows == x2d.shape[0]:
        return x2d
    return torch.cat([x2d, x2d.new_zeros(rows - x2d.shape[0], x2d.shape[1])])


def rows_agree(kernel, in_features: int, plan: RowPlan, widths: tuple[int, ...] | None = None,
               dtype=torch.bfloat16) -> bool:
    """Whether every row of a product of each width in ``widths`` (default: every width a call can
    have under ``plan``) equals the same row computed alone, bit for bit, under ``plan`` (random
    rows of a realistic spread of magnitudes)."""
    gen = torch.Generator().manual_seed(1234)
    rows = torch.randn(CHECK_ROWS, in_features, generator=gen)
    rows *= torch.exp2(torch.randint(-3, 4, (CHECK_ROWS, 1), generator=gen).float())
    rows = rows.to(dtype)
    alone = torch.cat([run_rows(kernel, rows[i : i + 1], plan) for i in range(CHECK_ROWS)])
    for width in plan.widths() if widths is None else widths:
        index = torch.arange(width) % CHECK_ROWS
        if not torch.equal(run_rows(kernel, rows[index], plan), alone[index]):
            return False
    return True


def most_rows(out_features: int, in_features: int) -> int:
    """The most rows one call with a weight of this shape may hold."""
    return MOST_ROWS_LARGE if out_features * in_features > LARGE_WEIGHT else MOST_ROWS


def choose_row_plan(kernel, out_features: int, in_features: int, dtype=torch.bfloat16) -> RowPlan:
    """The first plan of :data:`PLANS` under which ``kernel`` is row-invariant at this thread
    count (see :func:`rows_agree`, at every width a call can have); :class:`RowVarianceError`
    when none is."""
    most = most_rows(out_features, in_features)
    for plan in PLANS:
        plan = RowPlan(plan.block, most)
        if rows_agree(kernel, in_features, plan, dtype=dtype):
            return plan
    raise RowVarianceError(
        f"on this processor ({processor().describe()}, {torch.get_num_threads()} threads) a {dtype} product with a "
        f"[{out_features}, {in_features}] weight rounds a row differently depending on how many rows it holds, "
        f"under every plan tried ({', '.join(p.describe() for p in PLANS)}); exact decoding in {dtype} is not "
        "possible here: decode in float32"
    )


def onednn_kernel(packed: torch.Tensor, bias: torch.Tensor | None):
    def kernel(x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x2d, packed, bias, "none", [], "")

    return kernel


def stock_kernel(weight: torch.Tensor, bias: torch.Tensor | None):
    def kernel(x2d: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x2d, weight, bias)

    return kernel


class RowPlans:
    """The row plan of each weight shape at each thread count, chosen on first use and shared by
    every layer of one prepared model (a model prepared at 2 threads and later run at 4 is checked
    again at 4 before its first product there)."""

    def __init__(self):
        self._plans: dict[tuple, RowPlan] = {}

    def plan(self, layer: "PackedLinear") -> RowPlan:
        key = (layer.out_features, layer.in_features, layer.bias is not None, layer.packed is not None,
               torch.get_num_threads())
        found = self._plans.get(key)
        if found is None:
            found = self._plans[key] = layer.choose_plan()
        return found

    def describe(self) -> str:
        kinds = sorted({p.describe() for p in self._plans.values()})
        return ", ".join(kinds) if kinds else "not checked yet"


def _as_out_in(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``[out, in]`` weight and the bias of an ``nn.Linear`` or a GPT-2 style ``Conv1D``."""
    if isinstance(module, Conv1D):
        return module.weight.detach().t(), None if module.bias is None else module.bias.detach()
    return module.weight.detach(), None if module.bias is None else module.bias.detach()


class PackedLinear(nn.Module):
    """A linear layer computed in bf16 with its weight packed once for the processor's kernels
    (oneDNN), row-invariant under the row plan its :class:`RowPlans` chooses.

    The packed weight is an opaque oneDNN tensor: this module keeps no other copy.  What a plain
    layer offers still works: ``state_dict()`` gives the weight unpacked (bf16) under ``weight``
    and ``load_state_dict`` repacks it; ``weight`` reads the unpacked weight; ``copy.deepcopy`` and
    pickling unpack and repack.  ``.to()`` / ``.float()`` to another dtype or device turn the layer
    into a plain (unpacked) one of that dtype, as for any layer (it is then no longer row-invariant;
    :func:`probe_mtp.optimize.optimize` prepares a model again)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plans: RowPlans, pack: bool = True):
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.plans = plans
        weight = weight.to(torch.bfloat16).contiguous()
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if pack else None
        self.plain = None if pack else weight

    @classmethod
    def from_module(cls, module: nn.Module, plans: RowPlans, pack: bool = True,
                    weight: torch.Tensor | None = None) -> "PackedLinear":
        """The packed form of ``module`` (an ``nn.Linear`` or ``Conv1D``); ``weight``: its ``[out, in]``
        weight already in bf16 (a tied output layer's, cast once for the embedding too)."""
        own, bias = _as_out_in(module)
        return cls(own if weight is None else weight, bias, plans, pack)

    def kernel(self):
        bias = None if self.bias is None else self.bias.detach()
        if self.packed is not None:
            return onednn_kernel(self.packed, bias)
        return stock_kernel(self.plain, bias)

    def choose_plan(self) -> RowPlan:
        return choose_row_plan(self.kernel(), self.out_features, self.in_features, self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.packed is not None else self.plain.dtype

    @property
    def weight(self) -> torch.Tensor:
        """The weight ``[out, in]``, unpacked (a copy when packed)."""
        return self.packed.to_dense() if self.packed is not None else self.plain

    def weight_bytes(self) -> int:
        return self.out_features * self.in_features * (2 if self.packed is not None else self.plain.element_size())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2d = x.reshape(-1, self.in_features)
        if x2d.dtype != self.dtype:
            x2d = x2d.to(self.dtype)
        if self.packed is not None or self.plain.device.type == "cpu":
            out = run_rows(self.kernel(), x2d.contiguous(), self.plans.plan(self))
        else:  # moved off the CPU by .to(): a plain layer
            out = self.kernel()(x2d)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kind = "packed bf16" if self.packed is not None else f"plain {self.dtype}"
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
            self._set_weight(weight.detach().to(self.dtype))
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
        if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and self.packed is not None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        else:
            self.packed, self.plain = None, weight.contiguous()

    def _apply(self, fn, recurse=True):
        moved = fn(self.weight)
        if moved.dtype != torch.bfloat16 or moved.device.type != "cpu" or self.packed is None:
            self.packed, self.plain = None, moved
        return super()._apply(fn, recurse)

    def __getstate__(self):
        state = self.__dict__.copy()
        if state.get("packed") is not None:
            state["packed"] = None
            state["_unpacked"] = self.packed.to_dense()
        return state

    def __setstate__(self, state):
        unpacked = state.pop("_unpacked", None)
        super().__setstate__(state)
        if unpacked is not None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(unpacked, 1)


# ------------------------------------------------------------------------------- attention
def _visible(attention_mask, heads_kv: int, groups: int, queries: int, keys: int, causal: bool):
    """The mask as ``[B | 1, H_kv | 1, G | 1, N, T]`` (bool: True = attend, or additive float), or
    None: every key."""
    if attention_mask is None:
        if queries == 1 or not causal:
            return None
        # no mask with several queries: causal, the queries being the last ``queries`` keys
        rows = torch.arange(keys - queries, keys)[:, None]
        return (rows >= torch.arange(keys)[None])[None, None, None]
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
    rounded once to the query's dtype (see the module's notes); returns ``([B, N, H, Dv], None)``.
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
    mask = _visible(attention_mask, heads_kv, groups, queries, keys, causal)
    per_query = heads * keys * 8 * batch
    step = max(1, min(queries, QUERY_CHUNK, ATTENTION_BYTES // max(per_query, 1)))
    outputs = []
    for start in range(0, queries, step):
        stop = min(queries, start + step)
        part = None if mask is None else mask[..., start:stop, :]
        # keys after the last one these queries see add exact zeros: a long causal prefill in
        # chunks skips half its products
        seen = _keys_seen(part, keys)
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

