"""The machine's own cost curve: c(N), the time of one forward pass over N new inputs.

Verification width is not free on every machine: on a small CPU a pass over 16 inputs costs
well over one token's, and 2-3 inputs can cost more than 4-8 (BLAS treats 2-3 rows as separate
vector products), while on a GPU 30 inputs cost about as much as one.  The adaptive budget sizes
each tree from this curve, at the context length decoding has reached.  A curve is measured in a
few timed passes at a short and a long context (seconds) and cached on disk per model, dtype,
device, thread count and processor (a home directory shared by machines of different makes keeps
one curve for each).  Measured curves are in docs/benchmarks.md.

When the decoder runs the output layer apart from the backbone (:mod:`probe_mtp.head`), the curve
also times that layer alone at a set of row counts.  Its time is far from monotone in the rows
(CPU BLAS switches kernels with the row count: a 262k-token output layer has taken twice as long
over 7-15 rows as over 16).  The decoder therefore runs the layer only at measured row counts, padding the
rows to the cheapest one (:meth:`CostCurve.head_padding`), and the curve's passes are timed the
same way.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .attention import GROUPED_SDPA, grouped_query_attention, uses_grouped_attention
from .clock import DeviceClock
from .kernels import PackedLinear, kernel_environment, processor_name
from .wide import KERNELS, wide_kernel

CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64)
HEAD_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64)
CURVE_CONTEXT = 128
LONG_CONTEXT = 1024
CACHE_ENV = "PROBE_MTP_CACHE_DIR"
SLOW_TOLERANCE = 0.05
# 5: a prepared model's lone rows no longer padded to two where the row check allows; 4: the output
# layer timed alone by rows, passes timed with it padded (3: a second row at a long
# context; 2: one row, fastest of 3 rounds; 1: median of 2)
FORMAT_VERSION = "probe-mtp-cost-curve/5"
# a kept curve is checked at these widths when read; one slower there than this many times a pass
# timed now was measured on a busier machine (noise only adds time) and is measured again
CHECK_SIZES = (1, 8)
STALE_RATIO = 1.5


def _interpolate(sizes: tuple[int, ...], secs: tuple[float, ...], n: int) -> float:
    """Linear between measured sizes, extrapolated (never downwards) from the last two."""
    if len(sizes) == 1:
        return secs[0] * n
    if n >= sizes[-1]:
        slope = (secs[-1] - secs[-2]) / (sizes[-1] - sizes[-2])
        return secs[-1] + max(slope, 0.0) * (n - sizes[-1])
    return float(np.interp(n, sizes, secs))


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward pass over ``sizes[i]`` new inputs on top of a cache of ``context``
    tokens, and optionally the same sizes at ``long_context`` tokens.

    ``cost(n)`` interpolates linearly between measured sizes and extrapolates from the last two.
    ``cost(n, context)`` also follows the context: the time a pass spends reading the cache
    (attention, its mask) grows linearly with the context, so between and beyond the two measured
    contexts the cost is the straight line through them.  A wide pass over a long context costs
    markedly more, relative to one input, than over a short one (on SmolLM2 with 2 threads, 8
    inputs cost 1.6x one input at 128 tokens of context, and more at 1024), which is why trees are
    sized for the context decoding is at."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    context: int = CURVE_CONTEXT
    label: str = ""
    long_context: int | None = None
    long_seconds: tuple[float, ...] | None = None
    head_rows: tuple[int, ...] | None = None
    head_seconds: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        sizes = tuple(int(s) for s in self.sizes)
        seconds = tuple(float(s) for s in self.seconds)
        if len(sizes) != len(seconds) or not sizes:
            raise ValueError("a cost curve needs one time per size, and at least one size")
        if sizes[0] != 1 or any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"cost curve sizes must start at 1 and increase, got {sizes}")
        for row in (seconds, self.long_seconds or ()):
            if any(not np.isfinite(s) or s <= 0 for s in row):
                raise ValueError(f"cost curve times must be positive, got {row}")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "seconds", seconds)
        if (self.long_seconds is None) != (self.long_context is None):
            raise ValueError("a long-context row needs both long_context and long_seconds")
        if self.long_seconds is not None:
            long_seconds = tuple(float(s) for s in self.long_seconds)
            if len(long_seconds) != len(sizes):
                raise ValueError("the long-context row needs one time per size")
            if int(self.long_context) <= int(self.context):
                raise ValueError(f"long_context ({self.long_context}) must exceed context ({self.context})")
            object.__setattr__(self, "long_context", int(self.long_context))
            object.__setattr__(self, "long_seconds", long_seconds)
        if (self.head_rows is None) != (self.head_seconds is None):
            raise ValueError("the output layer's timings need both head_rows and head_seconds")
        if self.head_rows is not None:
            rows = tuple(int(r) for r in self.head_rows)
            secs = tuple(float(s) for s in self.head_seconds)
            if len(rows) != len(secs) or not rows or rows[0] < 1 or any(b <= a for a, b in zip(rows, rows[1:])):
                raise ValueError(f"head_rows must be increasing positive row counts, one time each, got {rows}")
            if any(not np.isfinite(s) or s <= 0 for s in secs):
                raise ValueError(f"output layer times must be positive, got {secs}")
            object.__setattr__(self, "head_rows", rows)
            object.__setattr__(self, "head_seconds", secs)

    @classmethod
    def from_mapping(cls, times: dict, context: int = CURVE_CONTEXT, label: str = "supplied") -> "CostCurve":
        """From ``{N: seconds}`` (for example a curve measured elsewhere, or a flat GPU-like one);
        the same at every context."""
        items = sorted((int(n), float(s)) for n, s in times.items())
        return cls(tuple(n for n, _ in items), tuple(s for _, s in items), context, label)

    def cost(self, n: int, context: int | None = None) -> float:
        """Seconds of a pass over ``n`` new inputs; at ``context`` cached tokens when given and the
        curve has a long-context row (else at the curve's own context)."""
        if n < 1:
            raise ValueError(f"a pass has at least one input, got {n}")
        short = _interpolate(self.sizes, self.seconds, n)
        if context is None or self.long_seconds is None:
            return short
        long = _interpolate(self.sizes, self.long_seconds, n)
        slope = (long - short) / (self.long_context - self.context)
        # below the short context the line can only fall so far: half the short-context time
        return max(short + slope * (context - self.context), 0.5 * short)

    def relative(self, n: int, context: int | None = None) -> float:
        """c(n) / c(1), at ``context`` when given."""
        return self.cost(n, context) / self.cost(1, context)

    def is_efficient(self, n: int, context: int | None = None) -> bool:
        """False where some larger pass is clearly cheaper (by more than ``SLOW_TOLERANCE``): the
        2-3 input trap of CPU BLAS.  Such a size is never chosen."""
        c = self.cost(n, context)
        return not any(
            self.cost(m, context) * (1 + SLOW_TOLERANCE) < c for m in range(n + 1, max(self.sizes[-1], n) + 1)
        )

    def speedup_bound(self, tau: float, inputs: int, context: int | None = None) -> float:
        """The best wall-clock speedup a decoder with mean accepted length ``tau`` can reach with
        ``inputs`` per pass: ``tau / (c(inputs) / c(1))``."""
        return tau / self.relative(inputs, context)

    def head_padding(self, max_rows: int) -> np.ndarray:
        """``rows[m]``: how many rows to run the output layer on when ``m`` rows' logits are wanted
        (``m`` <= ``max_rows``): of the measured row counts from ``m`` to ``max_rows``, the one that
        took least time; ``m`` itself when none was measured there (or the curve has no timings of
        the output layer: a supplied curve)."""
        return _head_padding(self.head_rows, self.head_seconds, max_rows)

    def as_dict(self) -> dict:
        out = {
            "format": FORMAT_VERSION,
            "sizes": list(self.sizes),
            "seconds": list(self.seconds),
            "context": self.context,
            "label": self.label,
        }
        if self.long_seconds is not None:
            out["long_context"] = self.long_context
            out["long_seconds"] = list(self.long_seconds)
        if self.head_rows is not None:
            out["head_rows"] = list(self.head_rows)
            out["head_seconds"] = list(self.head_seconds)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "CostCurve":
        long_seconds = data.get("long_seconds")
        head_rows, head_seconds = data.get("head_rows"), data.get("head_seconds")
        return cls(
            tuple(data["sizes"]),
            tuple(data["seconds"]),
            int(data.get("context", CURVE_CONTEXT)),
            data.get("label", ""),
            data.get("long_context"),
            None if long_seconds is None else tuple(long_seconds),
            None if head_rows is None else tuple(head_rows),
            None if head_seconds is None else tuple(head_seconds),
        )

    def __str__(self) -> str:
        rows = [(self.context, self.seconds)]
        if self.long_seconds is not None:
            rows.append((self.long_context, self.long_seconds))
        text = "; ".join(
            f"context {ctx}: {{" + ", ".join(f"{n}: {s * 1000:.1f}" for n, s in zip(self.sizes, secs)) + "}"
            for ctx, secs in rows
        )
        if self.head_rows is not None:
            text += "; output layer by rows: {" + ", ".join(f"{r}: {s * 1000:.1f}" for r, s in zip(self.head_rows, self.head_seconds)) + "}"
        return f"CostCurve(ms by inputs, {text})"


def _head_padding(head_rows, head_seconds, max_rows: int) -> np.ndarray:
    rows = np.arange(max_rows + 1)
    if head_rows is None:
        return rows
    measured = np.array([r for r in head_rows if r <= max_rows], dtype=np.int64)
    seconds = np.array([s for r, s in zip(head_rows, head_seconds) if r <= max_rows])
    for m in range(1, max_rows + 1):
        at_least = measured >= m
        if at_least.any():
            rows[m] = int(measured[at_least][np.argmin(seconds[at_least])])
    return rows


# ---------------------------------------------------------------------------- measuring
def _random_ids(vocab: int, length: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """``[1, length]`` token ids drawn reproducibly (a CPU generator, the same ids on every device),
    then put on ``device``.  Every tensor is made on an explicit device: under another default
    device (``torch.set_default_device``) nothing here changes."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (1, length), generator=gen, device="cpu").to(device)


def _random_hidden(rows: int, width: int, like: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """``[rows, width]`` normal values drawn reproducibly on the CPU, in ``like``'s dtype and on its
    device."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(rows, width, generator=gen, device="cpu").to(device=like.device, dtype=like.dtype)


def _long_context_for(model, context: int, long_context: int | None, widest: int) -> int | None:
    """The long context to measure at, within the model's positions; None when there is no room
    for one well beyond ``context``."""
    if long_context is None:
        return None
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit:
        long_context = min(long_context, int(limit) - widest)
    return long_context if long_context >= 2 * context else None


@torch.no_grad()
def measure_cost_curve(
    model,
    sizes: tuple[int, ...] = CURVE_SIZES,
    context: int = CURVE_CONTEXT,
    rounds: int = 3,
    long_context: int | None = LONG_CONTEXT,
    head=None,
    head_rows: tuple[int, ...] = HEAD_ROWS,
    logits_to_keep: int = 0,
) -> CostCurve:
    """Time one forward pass over N new inputs on top of a ``context``-token cache, and of a
    ``long_context``-token one, for each N in ``sizes``: a few untimed warm-up passes, then
    ``rounds`` rounds visiting the sizes in alternating order (machine noise spreads over all
    sizes alike); the fastest pass per size is kept (noise only ever adds time, so the minimum is
    the steadiest estimate on a shared machine).  Inputs are
    causal chains with an explicit 4D mask and all logits, as in a verification pass.

    With ``head`` (a usable :class:`~probe_mtp.head.SplitHead`) the output layer is first timed
    alone at each of ``head_rows`` rows, then each pass runs as the decoder runs it: the backbone,
    then the output layer on the rows :meth:`CostCurve.head_padding` pads N to.  Without it,
    ``logits_to_keep`` (transformers' argument; 0: every row) says how many of the last rows get
    logits: 1 times a pass as a prompt is read.

    Each pass is timed by a :class:`~probe_mtp.clock.DeviceClock` on the model's device: on an
    accelerator the time the device spent on it (events on its stream, after the work queued
    before it has finished), not the time the host took to queue its kernels; on a CPU the wall
    clock, as before."""
    from .architectures import attention_format
    from .kv import attention_inputs, keep_accepted, new_cache, start_recording

    head_seconds = measure_head(head, head_rows, rounds) if head is not None else None
    padding = _head_padding(head_rows, head_seconds, max(sizes)) if head is not None else None

    device = model.device
    clock = DeviceClock(device)
    fmt = attention_format(model)
    vocab = model.get_input_embeddings().num_embeddings
    long_context = _long_context_for(model, context, long_context, max(sizes))
    contexts = (context,) if long_context is None else (context, long_context)
    ids = _random_ids(vocab, contexts[-1] + max(sizes), device)
    caches = {}
    for ctx in contexts:
        with torch.device(device):  # transformers' sliding-window cache layers make a tensor without a device
            caches[ctx] = new_cache(model, capacity=ctx + max(sizes))
        start_recording(caches[ctx])  # sliding-window layers keep a pass's entries until rollback
        model(input_ids=ids[:, :ctx], cache=caches[ctx], use_cache=True, logits_to_keep=1)

    def one_pass(ctx: int, n: int) -> float:
        cache = caches[ctx]
        visible = np.tril(np.ones((n, n), dtype=bool))
        positions = torch.arange(ctx, ctx + n, device=device)
        attn = attention_inputs(cache, visible, positions, fmt)
        inputs = dict(input_ids=ids[:, ctx : ctx + n], attention_mask=attn, position_ids=positions[None], cache=cache, use_cache=True)
        if head is None:
            _, elapsed = clock.elapsed(model, **inputs, logits_to_keep=logits_to_keep)
        else:
            _, elapsed = clock.elapsed(lambda: head.logits(head.hidden_states(**inputs), rows=int(padding[n])))
        keep_accepted(cache, n, np.zeros(0, dtype=np.int64))
        return elapsed

    with grouped_query_attention(model):  # passes run as the decoder runs them
        fastest = _fastest_of_rounds(sizes, lambda n: [one_pass(ctx, n) for ctx in contexts], rounds)
    row = lambda i: tuple(float(fastest[n][i]) for n in sizes)  # noqa: E731
    long_row = None if long_context is None else row(1)
    head_args = (None, None) if head is None else (tuple(head_rows), head_seconds)
    return CostCurve(tuple(sizes), row(0), context, "measured", long_context, long_row, *head_args)


def _fastest_of_rounds(sizes: tuple[int, ...], run, rounds: int) -> dict[int, np.ndarray]:
    """Per size, the fastest of ``rounds`` calls ``run(size)`` (each returning its timings, one per
    variant, as a sequence), after untimed warm-up calls (allocator, BLAS, kernels) on the first,
    middle and last size.  Rounds visit the sizes in alternating order, so machine noise spreads
    over all sizes alike; the minimum is kept (noise only ever adds time)."""
    for n in sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]}):
        run(n)
    timings: dict[int, list] = {n: [] for n in sizes}
    for r in range(rounds):
        for n in sizes if r % 2 == 0 else tuple(reversed(sizes)):
            timings[n].append(run(n))
    return {n: np.min(np.asarray(timings[n], dtype=float), axis=0) for n in sizes}


@torch.no_grad()
def measure_head(head, rows: tuple[int, ...] = HEAD_ROWS, rounds: int = 3) -> tuple[float, ...]:
    """Seconds of the output layer alone (with its soft-capping) on each of ``rows`` rows of hidden
    states: warmed up, then the fastest of ``rounds`` rounds in alternating order."""
    layer = head.head
    width = getattr(layer, "in_features", None) or layer.weight.shape[-1]
    like = head.model.get_input_embeddings().weight  # the model's dtype and device (a packed layer has no plain weight)
    hidden = _random_hidden(max(rows), width, like)
    clock = DeviceClock(like.device)

    def one(m: int) -> float:
        return clock.elapsed(head.logits, hidden[:m])[1]

    fastest = _fastest_of_rounds(tuple(rows), lambda m: [one(m)], rounds)
    return tuple(float(fastest[m][0]) for m in rows)


# ---------------------------------------------------------------------------- the disk cache
def cache_dir() -> Path:
    """``$PROBE_MTP_CACHE_DIR``, else ``$XDG_CACHE_HOME/probe-mtp``, else ``~/.cache/probe-mtp``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "probe-mtp"


def accelerator_name(device: torch.device | str, runtime=None) -> str | None:
    """The accelerator ``device`` names, as a curve's key records it: its kind, the device's own
    name, its compute capability and the runtime torch was built with (``"cuda: NVIDIA H100 80GB
    HBM3, capability 9.0, CUDA 12.8"``); None for the CPU (the processor is keyed on its own).

    ``runtime``: torch's module for the device type (``torch.cuda``, ``torch.xpu``; read when None),
    or a stand-in with the same ``get_device_name(device)`` / ``get_device_capability(device)``
    functions and a ``version`` string.  What the runtime cannot say is left out, so a build of
    torch without that runtime gives the device's kind alone, never an error."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return None
    runtime = runtime if runtime is not None else _runtime(device.type)
    parts = [_ask(runtime, "get_device_name", device)]
    capability = _ask(runtime, "get_device_capability", device)
    if isinstance(capability, (tuple, list)) and capability:
        parts.append("capability " + ".".join(str(c) for c in capability))
    elif isinstance(capability, dict) and capability:  # torch.xpu: a dict of the device's properties
        parts.append("capability " + ", ".join(f"{k}={capability[k]}" for k in sorted(capability)))
    version = getattr(runtime, "version", None)
    if version:
        parts.append(str(version))
    named = ", ".join(str(p) for p in parts if p)
    return f"{device.type}: {named}" if named else device.type


def _runtime(kind: str):
    """torch's module for device type ``kind`` with a ``version`` attribute added in a stand-in
    namespace (``torch.version.cuda`` / ``hip`` / ``xpu``); None where torch has no such module."""
    from types import SimpleNamespace

    module = getattr(torch, kind, None)
    if module is None:
        return None
    versions = {"cuda": ("cuda", "hip"), "xpu": ("xpu",)}.get(kind, ())
    found = [f"{name.upper()} {getattr(torch.version, name)}" for name in versions
             if getattr(torch.version, name, None)]
    return SimpleNamespace(get_device_name=getattr(module, "get_device_name", None),
                           get_device_capability=getattr(module, "get_device_capability", None),
                           version=found[0] if found else None)


def _ask(runtime, function: str, device: torch.device):
    """``runtime.function(device)``, or None where the runtime lacks it or cannot answer (a build
    of torch without that device, no driver)."""
    call = getattr(runtime, function, None)
    if not callable(call):
        return None
    try:
        return call(device)
    except (RuntimeError, AssertionError, AttributeError, ValueError, TypeError):
        return None


def curve_key(model, split_head: bool = False) -> dict:
    """What a curve depends on: the model, its dtype, device, attention implementation, torch's
    thread count and version, the machine's processor model and count, the environment variables
    that hold its kernels back where set (:func:`~probe_mtp.kernels.kernel_environment`), how a prepared
    model's linear layers compute, whether passes run the output layer apart from the backbone and,
    off the CPU, the accelerator
    (:func:`accelerator_name`: two GPUs of different makes keep a curve each)."""
    key = _model_key(model, split_head)
    accelerator = accelerator_name(model.device)
    if accelerator is not None:  # absent on the CPU: the keys (and files) of CPU curves stay as they were
        key["accelerator"] = accelerator
    held = kernel_environment()
    if held:  # kernels held back by the environment (ONEDNN_MAX_CPU_ISA=AVX2, ...): another curve
        key["kernel_environment"] = held
    linear = sorted({m.kind for m in model.modules() if isinstance(m, PackedLinear)})
    if linear:  # prepared by optimize: how its linear layers compute (oneDNN, MKL, stock)
        key["linear"] = linear
    elif (packed := wide_kernel(model)) is not None:  # float32 packed for wide products (probe_mtp.pack_wide)
        key["linear"] = [KERNELS[packed].label]
    return key


def _model_key(model, split_head: bool) -> dict:
    config = model.config
    return {
        "split_head": bool(split_head),
        "model": str(getattr(config, "name_or_path", "")) or type(model).__name__,
        "class": type(model).__name__,
        "hidden": int(getattr(config.get_text_config(), "hidden_size", 0) or 0),
        "layers": int(getattr(config.get_text_config(), "num_hidden_layers", 0) or 0),
        "dtype": str(model.dtype),
        "device": str(model.device),
        "attn": GROUPED_SDPA if uses_grouped_attention(model) else str(getattr(config, "_attn_implementation", "")),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "processor": processor_name(),
    }


def curve_path(model, directory: Path | None = None, split_head: bool = False) -> Path:
    key = json.dumps(curve_key(model, split_head), sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return (directory or cache_dir()) / f"cost-curve-{digest}.json"


def measured_busy(kept: CostCurve, now: CostCurve) -> bool:
    """Whether ``kept`` is slower than ``now`` (a short check on the same model, here and now) by
    more than :data:`STALE_RATIO` at one of ``now``'s widths: it was measured while something else
    ran (a busy first measurement would otherwise price every later tree on a flat, wrong curve)."""
    return any(kept.cost(n) > STALE_RATIO * t for n, t in zip(now.sizes, now.seconds))


def cost_curve_for(model, use_disk: bool = True, directory: Path | None = None, head=None) -> CostCurve:
    """The model's cost curve: read from the disk cache when one was measured under the same
    conditions, else measured now (and written, unless ``use_disk`` is False).  A kept curve is
    checked by a few passes timed now (:data:`CHECK_SIZES`, about half a second for a model of
    100-300M parameters on 2 cores) and measured again where it was measured on a busier machine
    (:func:`measured_busy`).  A cache that cannot be read or written is ignored: the curve is then
    measured each time.  ``head``: the decoder's usable :class:`~probe_mtp.head.SplitHead`, if any
    (the curve then times the output layer too)."""
    key = curve_key(model, split_head=head is not None)
    path = curve_path(model, directory, split_head=head is not None)
    if use_disk and path.is_file():
        try:
            data = json.loads(path.read_text())
            kept = CostCurve.from_dict(data["curve"]) if data.get("format") == FORMAT_VERSION and data.get("key") == key else None
        except (OSError, ValueError, KeyError, TypeError):
            kept = None
        if kept is not None and not measured_busy(kept, measure_cost_curve(
                model, sizes=CHECK_SIZES, context=kept.context, rounds=1, long_context=None)):
            return kept
    curve = measure_cost_curve(model, head=head)
    if use_disk:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes writing at once never share one
            tmp.write_text(json.dumps({"format": FORMAT_VERSION, "key": key, "curve": curve.as_dict()}, indent=1))
            tmp.replace(path)
        except OSError:
            pass
    return curve
