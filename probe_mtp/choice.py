"""``dtype="auto"``: the fastest exact configuration of a model on this machine, chosen from measured
cost curves and kept on disk.

The candidates are the configurations in which probe-mtp is token-identical to ``model.generate`` on
the same model: bf16 prepared by :func:`probe_mtp.optimize` (oneDNN's packed products where it runs
bf16, the stock products under checked row plans elsewhere), float32 prepared by
``probe_mtp.optimize(model, torch.float32)`` (weights packed once by MKL; both bit for bit), float32
with the stock kernels, and float32 packed for wide passes (:func:`probe_mtp.pack_wide`: stock
one-row products, weights packed once for products of two rows or more, by MKL or by oneDNN,
measured apart since which is faster depends on the processor; identical to
``model.generate`` on the stock model wherever stock float32 decoding is, as its wide products sum
in another order than a one-row product just as the stock ones do). Each is judged by the seconds
per new token the default decoder can expect with it, from its measured cost curve c after a
:data:`CHOICE_CONTEXT`-token cache: on most steps the narrow pass that costs least per token
(:data:`WEAK_TAU`: one input, or two where that pays) and, on :data:`CONFIDENT_SHARE` of them, a pass
of the width N that suits c best, accepting :data:`CONFIDENT_TAU` [N] tokens
(:func:`seconds_per_token`), plus reading the prompt in wide passes (:func:`measure_prompt_reading`:
a :data:`PREFILL_WIDTH`-input pass with logits at its last input only, as the prompt pass runs).  How
many prompt tokens come with each new one is the workload's, so each configuration is judged at
each ratio of :data:`PROMPT_RATIOS` (a chat turn to a long document) against the fastest there, and
the one whose worst shortfall is least wins (:func:`shortfalls`), stock float32 credited with
:data:`STOCK_PREFERENCE`.

The processor decides: on a 2-core Intel Xeon with AMX a prepared bf16 pass over 16 inputs cost 1.4
one-token float32 passes (a float32 one 2.0), so prepared bf16 won there for both embedded models
(docs/exact-bf16.md). Without bf16 units, bf16 halves a pass bound by reading the weights but
computes wide passes slowly (prompts too): it is measured there as well, and wins only where its
narrow passes and its prompt reading beat float32's (for neither embedded model on the Xeon held to
AVX2; on an AMD EPYC held to AVX2 it decoded fastest, and read prompts at a third of float32's
speed). There float32 packed for wide passes won for both (its one-input pass the stock one, its 2-
and 8-input passes 1.2x and 1.5x that against stock's 1.6x and 1.8x on the Xeon, 0.77x and 1.0x
on the EPYC). The choice, its one-line
reason and the curves are kept in the cost-curve cache folder (:func:`probe_mtp.cost.cache_dir`,
``$PROBE_MTP_CACHE_DIR`` where set), keyed by the model's files, the processor, torch's version and
thread count: later loads read it and load only the chosen configuration.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from .contention import QUIET_SHARE, run_watched
from .cost import CostCurve, accelerator_name, cache_dir, measure_cost_curve
from .heap import heap_trimmer
from .kernels import Processor, kernel_environment, processor
from .optimize import AUTO_ATTRIBUTE, optimize_if_supported
from .wide import MKL, ONEDNN, pack_wide, unpack_wide, why_not_pack_wide

log = logging.getLogger("probe_mtp")

PREPARED_BF16 = "prepared bfloat16"
PREPARED_FP32 = "prepared float32"
STOCK_FP32 = "stock float32"
PACKED_WIDE_FP32 = "float32 packed for wide passes"
PACKED_WIDE_FP32_ONEDNN = "float32 packed for wide passes by oneDNN"
# name: (dtype the model computes in, prepared by optimize)
CONFIGURATIONS = {PREPARED_BF16: (torch.bfloat16, True), PREPARED_FP32: (torch.float32, True),
                  STOCK_FP32: (torch.float32, False), PACKED_WIDE_FP32: (torch.float32, False),
                  PACKED_WIDE_FP32_ONEDNN: (torch.float32, False)}
# the configurations of probe_mtp.pack_wide and the kernel each packs with
WIDE_PACKINGS = {PACKED_WIDE_FP32: MKL, PACKED_WIDE_FP32_ONEDNN: ONEDNN}
# The default decoder sizes every step's pass from its drafts (budget="auto"): where they are weak it
# runs a narrow pass, where they are long and likely (a copied span, a confident probe) a wide one.
# So a configuration is credited with a mix: CONFIDENT_SHARE of the steps at the pass width N that
# suits its curve best, accepting CONFIDENT_TAU[N] tokens, the rest at the narrow width that costs
# least per token (WEAK_TAU).  A single tau per width (the first criterion: 1.5 at N=2 ... 2.3 at
# N=32 for every step) cannot explain what was measured held to AVX2 on the Xeon: stock float32,
# whose 2-input pass costs 1.6 one-input passes, ran 1.28x float32 generate (tau 1.56), while
# prepared float32 (flatter, its one-input pass 1.2x stock's) ran 1.05x (tau 1.76) though that
# criterion expected it 12% faster.  Calibrated on SmolLM2's and Gemma 3's runs on the Xeon, free
# and held to AVX2 (docs/exact-bf16.md); wide passes' tokens raised (4: 2.1 -> 2.3, 8: 2.6 -> 2.9,
# 16: 3.0 -> 3.3, 32: 3.3 -> 3.6) on the AMD EPYC's: where the curve is flat from 2 to 8 inputs the
# decoder accepted 1.86-1.90 tokens a step over SmolLM2's stream (Gemma 3's: 2.78-3.06), which the
# mix at N=8 credited with 1.69 (now 1.78)
CONFIDENT_SHARE = 0.3
CONFIDENT_TAU = {2: 1.9, 4: 2.3, 8: 2.9, 16: 3.3, 32: 3.6}
# a step with weak drafts: a one-input pass, or a two-input pass (a mask, or a likely draft) where
# that costs less per token.  Before, weak steps were charged the one-input pass whatever it cost,
# and float32 packed for wide passes by oneDNN, whose lone rows take the stock product and whose
# pairs the packed one (on the AMD EPYC held to AVX2, SmolLM2: c(1) 57.8 ms, c(2) 44.3), lost
# to prepared bf16 there (expected 43.4 against 40.2 ms/token) though it ran 1.69x float32 generate
# against 1.32x: the decoder ran its every step at two inputs or more
WEAK_TAU = {1: 1.0, 2: 1.3}
# a prepared configuration is chosen only where it beats stock float32 by more than this share of its
# expected time: closer than that the estimate cannot tell them apart (SmolLM2 on the Xeon: prepared
# bf16 26.1 against stock float32 26.2 ms/token expected; measured in two quiet runs, 1.37x against
# 1.31x float32 generate, as close), and the stock model is what model.generate runs without probe-mtp
STOCK_PREFERENCE = 0.05
# a request's prompt is read in wide passes before decoding, at a configuration's cost per token in a
# pass of PREFILL_WIDTH inputs (with logits at the last input only, as the prompt pass computes them:
# measure_prompt_reading).  How many prompt tokens come with each new one is the workload's: in
# Spec-Bench's stream at 96 new tokens, 0.14 (qa, Gemma 3) to 8 (summarization); 3.3 over SmolLM2's
# stream, 2.45 over Gemma 3's.  A configuration is therefore judged at each of these ratios against
# the fastest there, and the one whose worst shortfall is least is chosen: bf16 without bf16 units,
# fast on short prompts (its one-input pass halved) and slow on long ones (wide products computed
# slowly, prompts read at a third of float32's speed), ran summarization at 0.87x float32 generate
# when chosen by a single ratio of 2
PROMPT_RATIOS = (0.5, 1.0, 2.0, 4.0, 8.0)
PREFILL_WIDTH = 64
CHOICE_SIZES = (1, *CONFIDENT_TAU, PREFILL_WIDTH)  # WEAK_TAU's widths among them
# the cache a choice's passes read: Spec-Bench's first turns hold 310 prompt tokens and decode ~100
# more.  Prepared configurations attend in float64, whose cost grows with the cache: at 128 tokens
# prepared float32 looked faster than it decodes
CHOICE_CONTEXT = 384
CHOICE_ROUNDS = 3
# measurements of one configuration at most, while other work keeps taking its cores
MEASURE_TRIES = 3
# 10: weak steps at the cheaper of one and two inputs, wide passes credited with more tokens,
# prompts charged at every ratio of PROMPT_RATIOS (the least worst shortfall wins); 9:
# configurations measured again while other work takes their cores (a choice kept before may
# have been measured so, unseen); 8: prompt reading measured as the prompt pass runs (logits at its
# last input only), not taken from the curve's 64-input pass (logits at every input); 7: float32
# packed for wide passes by oneDNN measured too; 6: float32 packed for wide passes measured too; 5:
# prepared bf16's lone rows unpadded where the row check allows; 4: prepared float32 packed once by
# MKL, steps credited as a mix, 384-token cache; 3: prompts charged; 2: bf16 measured without bf16
# units too
CHOICE_FORMAT = "probe-mtp-dtype-choice/10"


@dataclass(frozen=True)
class Candidate:
    """One configuration as ``dtype="auto"`` found it: its name (a key of :data:`CONFIGURATIONS`)
    and its measured cost curve, or, where it was not measured, why (the reason ``optimize`` gave
    for refusing the model)."""

    name: str
    curve: CostCurve | None = None
    refused: str | None = None
    prompt: float | None = None  # seconds per prompt token, read as a prompt is (None: from the curve)
    # the share of its cores other work took in the quietest of its measurements (None: quiet, or unknown)
    contended: float | None = None

    def prompt_seconds(self) -> float:
        """Seconds per prompt token: as measured (:func:`measure_prompt_reading`), else estimated from
        the curve's :data:`PREFILL_WIDTH`-input pass (logits at every row: an overestimate)."""
        return self.prompt if self.prompt is not None else prefill_seconds_per_token(self.curve)

    def decoding(self) -> "DecodingEstimate | None":
        """What the default decoder can expect per new token from the curve (:func:`seconds_per_token`),
        None when not measured."""
        return None if self.curve is None else seconds_per_token(self.curve)

    def expected(self, ratio: float) -> float:
        """Expected seconds per new token with ``ratio`` prompt tokens read per new token."""
        return self.decoding().seconds + ratio * self.prompt_seconds()

    def summary(self) -> str:
        """``"stock float32 47.7 ms/token (N=8) + 2.7 ms a prompt token"``, or
        ``"prepared bfloat16 not measured (why)"``."""
        found = self.decoding()
        if found is None:
            return f"{self.name} not measured ({self.refused})"
        busy = "" if self.contended is None else f", measured while other work took {self.contended:.0%} of its cores"
        return (f"{self.name} {found.seconds * 1e3:.1f} ms/token ({found.describe()}{busy}) + "
                f"{self.prompt_seconds() * 1e3:.1f} ms a prompt token")

    def as_dict(self) -> dict:
        return {"name": self.name, "curve": None if self.curve is None else self.curve.as_dict(),
                "refused": self.refused, "prompt": self.prompt, "contended": self.contended}

    @classmethod
    def from_dict(cls, data: dict) -> "Candidate":
        curve, prompt, contended = data.get("curve"), data.get("prompt"), data.get("contended")
        return cls(str(data["name"]), None if curve is None else CostCurve.from_dict(curve), data.get("refused"),
                   None if prompt is None else float(prompt), None if contended is None else float(contended))


def prefill_seconds_per_token(curve: CostCurve) -> float:
    """Seconds per prompt token when the prompt is read :data:`PREFILL_WIDTH` tokens a pass."""
    return curve.cost(PREFILL_WIDTH) / PREFILL_WIDTH


class DecodingEstimate(NamedTuple):
    """Expected ``seconds`` per new token, the width of the confident steps' passes (``wide``; 0: no
    step pays for a wide pass) and that of the other steps' (``narrow``: 1 or 2)."""

    seconds: float
    wide: int
    narrow: int = 1

    def describe(self) -> str:
        narrow = "" if self.narrow == 1 else f", weak steps at N={self.narrow}"
        return f"N={self.wide}{narrow}" if self.wide else f"plain, N={self.narrow}"


def seconds_per_token(curve: CostCurve, share: float = CONFIDENT_SHARE, tau: dict[int, float] = CONFIDENT_TAU,
                      weak: dict[int, float] = WEAK_TAU) -> DecodingEstimate:
    """What the default decoder can expect per token with this curve: each step with weak drafts at
    the width n of ``weak`` that costs least per token (``c(n) / weak(n)``), and the least, over the
    widths N of ``tau``, of ``((1 - share) c(n) + share c(N)) / ((1 - share) weak(n) + share tau(N))``
    where a confident share of wide passes pays, else those narrow steps alone."""
    narrow = min(weak, key=lambda n: (curve.cost(n) / weak[n], n))
    cost, tokens = curve.cost(narrow), weak[narrow]
    mixed = [DecodingEstimate(((1 - share) * cost + share * curve.cost(n)) / ((1 - share) * tokens + share * t), n,
                              narrow) for n, t in tau.items()]
    return min([DecodingEstimate(cost / tokens, 0, narrow), *mixed], key=lambda found: found.seconds)


@dataclass(frozen=True)
class AutoChoice:
    """What ``dtype="auto"`` chose for a model here: the configuration's ``name``, the ``reason`` (one
    line: every candidate's score, or why it was not measured), the ``candidates`` as measured, the
    seconds that preparing and measuring them took at the first load (the float32 load excluded),
    where it is kept (``path``; None where it was not written) and whether this load read it from
    there (``cached``)."""

    name: str
    reason: str
    candidates: tuple[Candidate, ...] = ()
    measure_seconds: float = 0.0
    path: str | None = None
    cached: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return CONFIGURATIONS[self.name][0]

    @property
    def prepared(self) -> bool:
        return CONFIGURATIONS[self.name][1]

    def line(self) -> str:
        """The one log line: which, why, how long measuring took and where the choice is kept."""
        if not self.candidates:
            return f"dtype auto: {self.name} ({self.reason})"
        where = "" if self.path is None else (f"; read from {self.path}" if self.cached else f"; kept in {self.path}")
        when = "at the first load" if self.cached else "now"
        return (f"dtype auto: {self.name} ({self.reason}; curves measured {when} in {self.measure_seconds:.1f} s"
                f"{where})")

    def as_dict(self) -> dict:
        return {"name": self.name, "reason": self.reason, "candidates": [c.as_dict() for c in self.candidates],
                "measure_seconds": self.measure_seconds}

    @classmethod
    def from_dict(cls, data: dict, path: str | None = None) -> "AutoChoice":
        name = str(data["name"])
        if name not in CONFIGURATIONS:
            raise ValueError(f"unknown configuration {name!r}")
        return cls(name, str(data["reason"]), tuple(Candidate.from_dict(c) for c in data.get("candidates", ())),
                   float(data.get("measure_seconds", 0.0)), path, cached=True)


def shortfalls(candidates) -> dict[str, float]:
    """Each measured candidate's largest shortfall against the fastest, over the prompt ratios of
    :data:`PROMPT_RATIOS`: ``max over r of expected(r) / (least expected(r)) - 1`` (0: fastest
    everywhere), stock float32's expected time credited with :data:`STOCK_PREFERENCE`."""
    def expected(candidate: Candidate, ratio: float) -> float:
        return candidate.expected(ratio) * (1 - STOCK_PREFERENCE if candidate.name == STOCK_FP32 else 1)

    measured = [c for c in candidates if c.curve is not None]
    fastest = {r: min(expected(c, r) for c in measured) for r in PROMPT_RATIOS}
    return {c.name: max(expected(c, r) / fastest[r] for r in PROMPT_RATIOS) - 1 for c in measured}


def choose(candidates: list[Candidate] | tuple[Candidate, ...], where: str) -> AutoChoice:
    """The candidate whose largest shortfall against the fastest, over the prompt ratios of
    :data:`PROMPT_RATIOS`, is least (:func:`shortfalls`; stock float32, measured or not, where none
    was measured), and the reason, one line naming every candidate's estimate and ``where`` (the
    processor and thread count)."""
    if not any(c.curve is not None for c in candidates):
        reason = "; ".join(c.summary() for c in candidates) or "nothing measured"
        return AutoChoice(STOCK_FP32, f"{reason}; {where}", tuple(candidates))
    behind = shortfalls(candidates)
    best = min((c for c in candidates if c.curve is not None), key=lambda c: behind[c.name])  # first of equals
    found = best.decoding()
    few, many = PROMPT_RATIOS[0], PROMPT_RATIOS[-1]
    narrow = f"c({found.narrow}) {best.curve.cost(found.narrow) * 1e3:.1f} ms"
    decoding = (f"plain decoding ({narrow})" if not found.wide else
                f"decoding at {narrow}, {CONFIDENT_SHARE:.0%} of steps at N={found.wide} (c({found.wide}) "
                f"{best.curve.cost(found.wide) * 1e3:.1f} ms / tau {CONFIDENT_TAU[found.wide]})")
    busy = "" if best.contended is None else f" (measured while other work took {best.contended:.0%} of its cores)"
    others = [c.summary() + ("" if c.curve is None else f", up to {behind[c.name]:.0%} behind")
              for c in candidates if c is not best]
    lead = ("the fastest" if behind[best.name] == 0 else f"at most {behind[best.name]:.1%} behind the fastest")
    reason = (f"{lead} from {few:g} to {many:g} prompt tokens per new token, expected {best.expected(few) * 1e3:.1f}"
              f"-{best.expected(many) * 1e3:.1f} ms/token{busy}: {decoding}, prompts at "
              f"{best.prompt_seconds() * 1e3:.1f} ms a token; against " + ", ".join(others) + f"; {where}")
    return AutoChoice(best.name, reason, tuple(candidates))


# ---------------------------------------------------------------------------- the disk cache
def choice_key(identity: dict, attn_implementation: str, device: torch.device, cpu: Processor) -> dict:
    """What a choice depends on: the model's files (``identity``), the attention implementation,
    the device (and accelerator), the processor ``cpu``, whether oneDNN runs bf16 on it and the
    environment variables holding its kernels back (:func:`~probe_mtp.kernels.kernel_environment`), torch's
    thread count and version, the CPU count and the criterion itself (widths, tau, cache length)."""
    return {"format": CHOICE_FORMAT, "model": identity, "attn": attn_implementation, "device": str(device),
            "accelerator": accelerator_name(device), "processor": cpu.name, "units": cpu.matrix_units,
            "onednn_bf16": cpu.onednn_bf16, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "tau": {str(n): t for n, t in CONFIDENT_TAU.items()},
            "confident_share": CONFIDENT_SHARE, "weak_tau": {str(n): t for n, t in WEAK_TAU.items()},
            "prompt_ratios": list(PROMPT_RATIOS),
            "context": CHOICE_CONTEXT, "kernel_environment": kernel_environment()}


def choice_path(key: dict, directory: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory or cache_dir()) / f"dtype-choice-{digest}.json"


def read_choice(key: dict, directory: Path | None = None) -> AutoChoice | None:
    """The choice kept for ``key``, or None (none kept, another key, a damaged file)."""
    path = choice_path(key, directory)
    try:
        data = json.loads(path.read_text())
        if data.get("format") != CHOICE_FORMAT or data.get("key") != key:
            return None
        return AutoChoice.from_dict(data["choice"], str(path))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_choice(key: dict, choice: AutoChoice, directory: Path | None = None) -> AutoChoice:
    """Keep ``choice`` for ``key`` (atomically: processes writing at once never share a file); the
    choice with its path, or as it was where the cache cannot be written."""
    path = choice_path(key, directory)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": CHOICE_FORMAT, "key": key, "choice": choice.as_dict()}, indent=1))
        tmp.replace(path)
    except OSError:
        return choice
    return AutoChoice(choice.name, choice.reason, choice.candidates, choice.measure_seconds, str(path))


# ---------------------------------------------------------------------------- measuring and loading
def measure_choice_curve(model) -> CostCurve:
    """The short curve a choice compares: :data:`CHOICE_SIZES` inputs after a
    :data:`CHOICE_CONTEXT`-token cache, fastest of :data:`CHOICE_ROUNDS` rounds (about 1-3 s for a
    model of 100-300M parameters on 2 cores)."""
    return measure_cost_curve(model, sizes=CHOICE_SIZES, context=CHOICE_CONTEXT, rounds=CHOICE_ROUNDS,
                              long_context=None)


def measure_prompt_reading(model) -> float:
    """Seconds per prompt token as the decoder reads a prompt: a pass over :data:`PREFILL_WIDTH`
    inputs after a :data:`CHOICE_CONTEXT`-token cache with logits at the last input only (the
    prompt pass computes the output layer on a few rows; the curve's passes on every row, which for
    Gemma 3's 262k-token output layer, and for bf16 without bf16 units, is most of their cost)."""
    curve = measure_cost_curve(model, sizes=(1, PREFILL_WIDTH), context=CHOICE_CONTEXT, rounds=CHOICE_ROUNDS,
                               long_context=None, logits_to_keep=1)
    return curve.cost(PREFILL_WIDTH) / PREFILL_WIDTH


def bf16_copy(model):
    """A copy of the float32 ``model`` with every parameter cast to bf16 (round to nearest even, the
    weights a bf16 load gives), made without a second float32 copy; ties stay tied."""
    cast = {id(p): torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False) for p in model.parameters()}
    return copy.deepcopy(model, cast)


@dataclass
class Loader:
    """How ``dtype="auto"`` gets at a model: ``load(dtype) -> (model, tokenizer)`` loads it afresh,
    ``identity`` names its files (the cache key), ``device`` and ``attn_implementation`` as asked,
    ``measure(model) -> CostCurve`` times a configuration (:func:`measure_choice_curve`; tests pass
    fixed curves), ``measure_prompt(model) -> seconds`` its prompt reading per token
    (:func:`measure_prompt_reading`; None: estimated from the curve), ``directory`` is the cache
    folder (None: :func:`~probe_mtp.cost.cache_dir`) and ``cpu`` the processor whose oneDNN decides
    whether bf16 is measured at all (this machine's)."""

    load: Callable
    identity: dict
    device: torch.device
    attn_implementation: str = "sdpa"
    measure: Callable = measure_choice_curve
    directory: Path | None = None
    measure_prompt: Callable | None = measure_prompt_reading
    cpu: Processor = field(default_factory=processor)
    loads: list = field(default_factory=list)  # the dtypes loaded, in order (what a load cost)
    # ``watch(run, threads) -> (run(), share of the cores other work took)``: a configuration measured
    # while others held the cores is measured again (None: measured once, unwatched; tests)
    watch: Callable | None = run_watched

    def __call__(self, dtype: torch.dtype):
        self.loads.append(dtype)
        return self.load(dtype)


def load_fastest(loader: Loader):
    """``(model, tokenizer)`` in the configuration ``dtype="auto"`` chooses for it here (measured at
    the first load, then read from the cache), marked with its :class:`AutoChoice` (which
    :func:`probe_mtp.describe` reports) and said in one log line (logger ``probe_mtp``, info)."""
    device = torch.device(loader.device)
    if device.type != "cpu":
        model, tokenizer = loader(torch.float32)
        choice = AutoChoice(STOCK_FP32, f"on {device}: exact bf16 there is for probe_mtp.optimize(model) on a model "
                                        "loaded in bf16, not yet measured by dtype auto")
        return _finish(model, tokenizer, choice)
    key = choice_key(loader.identity, loader.attn_implementation, device, loader.cpu)
    kept = read_choice(key, loader.directory)
    if kept is not None:
        return _finish(*_load_chosen(loader, kept))
    model, tokenizer, choice = _measure_and_choose(loader)
    return _finish(model, tokenizer, write_choice(key, choice, loader.directory))


def _finish(model, tokenizer, choice: AutoChoice):
    model.__dict__[AUTO_ATTRIBUTE] = choice
    log.info("%s", choice.line())
    return model, tokenizer


def _load_chosen(loader: Loader, choice: AutoChoice):
    """The kept configuration, loaded in its dtype and prepared (or packed) where it is a prepared
    (packed) one; stock float32 where ``optimize`` (``pack_wide``) now refuses it (saying so in the
    choice's reason)."""
    model, tokenizer = loader(choice.dtype)
    if choice.name in WIDE_PACKINGS:
        refused = why_not_pack_wide(model, WIDE_PACKINGS[choice.name])
        if refused is None:
            return pack_wide(model, WIDE_PACKINGS[choice.name]), tokenizer, choice
        return model, tokenizer, AutoChoice(STOCK_FP32, f"the kept choice, {choice.name}, was refused now: {refused}")
    if not choice.prepared:
        return model, tokenizer, choice
    refused = optimize_if_supported(model, choice.dtype)
    if refused is None:
        return model, tokenizer, choice
    if choice.dtype != torch.float32:
        del model
        model, tokenizer = loader(torch.float32)
    return model, tokenizer, AutoChoice(STOCK_FP32, f"the kept choice, {choice.name}, was refused now: {refused}")


def _measure_and_choose(loader: Loader):
    """Measure each candidate holding as little as it can: the float32 model as loaded (stock), the
    same packed for wide passes by MKL and by oneDNN (each unpacked again), a bf16 copy prepared,
    then the float32 model prepared in place; keep the winner.  Stock or packed float32 winning
    after the float32 model was prepared costs a second float32 load (a preparation cannot be undone
    in place)."""
    model, tokenizer = loader(torch.float32)
    start = time.perf_counter()  # what choosing costs beyond the float32 load: preparing and measuring
    candidates = [_measured(STOCK_FP32, model, loader),
                  *(_packed_wide_candidate(model, loader, name) for name in WIDE_PACKINGS)]
    bf16, found = _bf16_candidate(model, loader)
    candidates.append(found)
    refused = optimize_if_supported(model, torch.float32)
    candidates.append(Candidate(PREPARED_FP32, refused=refused) if refused else
                      _measured(PREPARED_FP32, model, loader))
    choice = choose(candidates, f"{loader.cpu.describe()}, {torch.get_num_threads()} threads")
    choice = AutoChoice(choice.name, choice.reason, choice.candidates, time.perf_counter() - start)
    if choice.name == PREPARED_BF16:
        model = bf16
    del bf16
    if (choice.name == STOCK_FP32 or choice.name in WIDE_PACKINGS) and refused is None:
        del model
        _return_freed_memory()
        model, tokenizer = loader(torch.float32)
    if choice.name in WIDE_PACKINGS:
        pack_wide(model, WIDE_PACKINGS[choice.name])
    _return_freed_memory()
    return model, tokenizer, choice


def _measured(name: str, model, loader: Loader) -> Candidate:
    """Configuration ``name`` as ``model`` is now, its curve and prompt reading measured; measured
    again, up to :data:`MEASURE_TRIES` times, while other work took more than
    :data:`~probe_mtp.contention.QUIET_SHARE` of its cores (each size keeps its fastest time over
    the tries: such work only ever adds time)."""
    def measure():
        prompt = None if loader.measure_prompt is None else float(loader.measure_prompt(model))
        return loader.measure(model), prompt

    watch = loader.watch or (lambda run, threads: (run(), None))  # unwatched: one try, taken as quiet
    curve, prompt, contended = None, None, None
    for _ in range(MEASURE_TRIES):
        (found, found_prompt), contended = watch(measure, torch.get_num_threads())
        curve = found if curve is None else fastest_of(curve, found)
        prompt = found_prompt if prompt is None or found_prompt is None else min(prompt, found_prompt)
        if contended is None or contended <= QUIET_SHARE:
            contended = None
            break
        log.debug("dtype auto: %s measured while other work took %.0f%% of its cores", name, 100 * contended)
    return Candidate(name, curve, prompt=prompt, contended=contended)


def fastest_of(a: CostCurve, b: CostCurve) -> CostCurve:
    """Per size, the faster of two measurements of one configuration's curve (same sizes)."""
    if a.sizes != b.sizes or a.context != b.context:
        raise ValueError("two curves of one configuration are measured at the same sizes and context")
    return dataclasses.replace(a, seconds=tuple(map(min, a.seconds, b.seconds)))


def _packed_wide_candidate(model, loader: Loader, name: str = PACKED_WIDE_FP32) -> Candidate:
    """The float32 ``model`` packed for wide passes (:func:`probe_mtp.pack_wide`) with the kernel of
    configuration ``name``, measured, then unpacked again; refused where this torch lacks that
    kernel."""
    kernel = WIDE_PACKINGS[name]
    refused = why_not_pack_wide(model, kernel)
    if refused is not None:
        return Candidate(name, refused=refused)
    try:
        return _measured(name, pack_wide(model, kernel), loader)
    finally:
        unpack_wide(model)
        _return_freed_memory()


def _return_freed_memory() -> None:
    """Collect the dropped configurations and hand their freed pages back to the system (glibc
    keeps them otherwise: 550 MB after SmolLM2's first load)."""
    gc.collect()
    trim = heap_trimmer(torch.device("cpu"), every=1)
    if trim is not None:
        trim()


def _bf16_candidate(model, loader: Loader):
    """``(the prepared bf16 copy or None, its Candidate)``: measured wherever ``optimize`` prepares
    the copy (on a processor without bf16 units, with the stock products: slow when wide, which its
    curve shows)."""
    copied = bf16_copy(model)
    refused = optimize_if_supported(copied, torch.bfloat16)
    if refused is not None:
        return None, Candidate(PREPARED_BF16, refused=refused)
    return copied, _measured(PREPARED_BF16, copied, loader)
