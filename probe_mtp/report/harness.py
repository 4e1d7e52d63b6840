"""Running methods over prompts: the timing loop and the per-prompt records.

Honest timing, for every method alike:

- one untimed warm-up generation per method before anything is timed;
- the same prompts (same token ids) and the same ``max_new_tokens`` for every method;
- the clock runs around the whole call (prefill, drafting, verification, Python overhead);
- prompt-major loop: for each prompt turn every method runs once, in an order rotated from one
  turn to the next, so that slow phases of a shared machine fall on every method alike.

A method's output is compared with ``model.generate(do_sample=False)`` on the same input
(``identical_to_greedy``); MT-bench's second turn is built from ``model.generate``'s first answer,
which every lossless method reproduces, so all methods see the same second-turn prompt.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..config import ProbeConfig
from ..decoder import ProbeDecoder
from ..drafters import drafter_class, drafter_names
from ..prompts import Prompt, balanced_subset, chat_input_ids, load_prompts
from ..tuned_masks import BUNDLED
from ..version import __version__
from .baselines import BASELINES, GREEDY, HF_PLD
from .summary import summarize

SCHEMA = "probe-mtp-report/1"
PROMPT_MEAN = "prompt_mean"
"""``--masks`` value (and record entry) for the untuned prompt-mean mask vectors."""


# --------------------------------------------------------------------------- settings
def available_methods() -> tuple[str, ...]:
    """The probe-mtp drafters (from the drafter registry)."""
    return drafter_names()


def resolve_methods(spec: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Drafter names from a comma list (None or ``"all"``: every available drafter)."""
    available = available_methods()
    if spec is None:
        return available
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    names = [n for n in names if n]
    if not names or names == ["all"]:
        return available
    out: list[str] = []
    for name in names:
        if name in BASELINES:
            raise ValueError(
                f"{name!r} is a baseline: {GREEDY} and {HF_PLD} are always measured; "
                f"--methods chooses among the probe-mtp drafters: {', '.join(available)}"
            )
        if name not in available:
            raise ValueError(f"unknown method {name!r}; available: {', '.join(available)}")
        if name not in out:
            out.append(name)
    return tuple(out)


def parse_budgets(spec: str | int | list | tuple) -> tuple:
    """``"10,30,60"`` -> ``(10, 30, 60)``; ``"auto"`` stays a name (the adaptive budget)."""
    if isinstance(spec, int):
        items = [spec]
    elif isinstance(spec, str):
        items = []
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            if part == "auto":
                items.append(part)
                continue
            try:
                items.append(int(part))
            except ValueError:
                raise ValueError(
                    f"--budget takes integers or 'auto' separated by commas (e.g. 10,30,60 or auto,30), got {spec!r}"
                ) from None
    else:
        items = [b if b == "auto" else int(b) for b in spec]
    if not items:
        raise ValueError("--budget needs at least one block complexity, e.g. 30")
    out: list[int] = []
    for b in items:
        if b not in out:
            out.append(b)
    return tuple(out)


@dataclass(frozen=True)
class ReportSettings:
    """What one report measures.  ``methods``: probe-mtp drafters (the baselines are always added);
    ``budgets``: each drafter is run at each block complexity; ``limit``: prompts per task
    (0: all of them)."""

    model: str = "smollm2-135m"
    dtype: str = "float32"
    prompts: str | None = None
    tasks: tuple[str, ...] | None = None
    limit: int = 2
    max_new_tokens: int = 64
    methods: tuple[str, ...] = ()
    budgets: tuple = (30,)
    num_masks: int = 1
    seed: int = 0
    warmup_tokens: int = 16
    hf_pld_tokens: int = 10
    masks: tuple[str | None, ...] = (None,)
    acceptance: tuple[str, ...] = ("verify",)
    threshold: float = 0.9
    knobs: dict = field(default_factory=dict)  # other ProbeConfig fields, the same for every probe method

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"--limit (prompts per task) must be >= 0 (0 = all), got {self.limit}")
        if self.warmup_tokens < 1:
            raise ValueError(f"--warmup-tokens must be >= 1 (every method is warmed up), got {self.warmup_tokens}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.masks or not self.acceptance:
            raise ValueError("--masks and --acceptance need at least one value each")
        for path in self.masks:
            if path is not None and path != BUNDLED and not Path(path).is_file():
                raise FileNotFoundError(f"tuned mask file not found: {path}")
        for rule in self.acceptance:
            ProbeConfig(acceptance=rule, threshold=self.threshold, **self.knobs)
        for m in self.methods:
            for b in self.budgets:
                # the decoder's own validation, before any model is loaded
                ProbeConfig(num_masks=self.num_masks, budget=b, drafter=m, **self.knobs)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tasks"] = list(self.tasks) if self.tasks is not None else None
        d["methods"] = list(self.methods)
        d["budgets"] = list(self.budgets)
        d["masks"] = [m if m is not None else PROMPT_MEAN for m in self.masks]
        d["acceptance"] = list(self.acceptance)
        d["prompts"] = self.prompts if self.prompts is not None else "bundled Spec-Bench (probe_mtp/data/specbench/question.jsonl)"
        return d


def select_prompts(settings: ReportSettings) -> list[Prompt]:
    """The prompt set: ``limit`` prompts per task (balanced over categories), of ``tasks``."""
    prompts = load_prompts(settings.prompts)
    present: list[str] = []
    for p in prompts:
        if p.task not in present:
            present.append(p.task)
    if settings.tasks:
        unknown = [t for t in settings.tasks if t not in present]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; the prompt file has: {', '.join(present)}")
    per_task = settings.limit if settings.limit > 0 else len(prompts)
    chosen = balanced_subset(prompts, per_task, tuple(settings.tasks) if settings.tasks else None)
    if not chosen:
        raise ValueError("no prompts selected")
    return chosen


# --------------------------------------------------------------------------- methods
@dataclass
class Run:
    """One timed generation."""

    tokens: list[int]
    seconds: float
    forward_passes: int | None
    accepted_lengths: list[int] | None
    prefill_seconds: float | None = None
    first_pass_tokens: int | None = None
    forward_seconds: float | None = None
    inputs_per_pass: list[int] | None = None


class _PassCounter:
    """A forward pre-hook that notes the KV-cache length at every call of the model, from which
    the forward passes and the tokens committed by each pass of ``model.generate`` follow."""

    def __init__(self) -> None:
        self.cache_lengths: list[int | None] = []

    def __call__(self, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        length = None
        if cache is not None and hasattr(cache, "get_seq_length"):
            try:
                length = int(cache.get_seq_length())
            except Exception:  # a cache type without a usable length: tau becomes n/a
                length = None
        self.cache_lengths.append(length)

    def accepted_lengths(self, prompt_len: int, new_tokens: int) -> tuple[list[int] | None, int | None]:
        """``(tokens committed by each pass after the first, tokens committed by the first)``.

        After each pass transformers keeps every committed token but the last in the cache, so the
        pass i commits ``L[i+1] - L[i]`` tokens (``L``: cache length at the call) and the last pass
        ``prompt + new - 1 - L[-1]``.  None where the lengths are not readable or inconsistent."""
        lengths = self.cache_lengths
        if not lengths or any(x is None for x in lengths) or lengths[0] != 0:
            return None, None
        ends = list(lengths[1:]) + [prompt_len + new_tokens - 1]
        committed = [ends[0] + 1 - prompt_len] + [b - a for a, b in zip(lengths[1:], ends[1:])]
        if any(c < 1 for c in committed) or sum(committed) != new_tokens:
            return None, None
        return committed[1:], committed[0]


@dataclass
class Method:
    """A method of the report: a name (``generate``, ``hf-pld`` or a drafter), its budget and
    masks (None for the baselines), and a display label."""

    name: str
    label: str
    kind: str  # "baseline" or "probe"
    budget: int | None = None
    num_masks: int | None = None
    run: Callable[[torch.Tensor, int], Run] = field(default=None, repr=False)
    masks: str | None = None  # tuned mask file, None: prompt-mean (or no masks)
    acceptance: str = "verify"


def _hf_method(model, name: str, label: str, **generate_kwargs) -> Method:
    def run(ids: torch.Tensor, max_new_tokens: int) -> Run:
        counter = _PassCounter()
        attention_mask = torch.ones_like(ids)
        t0 = time.perf_counter()
        handle = model.register_forward_pre_hook(counter, with_kwargs=True)
        try:
            out = model.generate(
                ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens, **generate_kwargs
            )
        finally:
            handle.remove()
        seconds = time.perf_counter() - t0
        tokens = out[0, ids.shape[1]:].tolist()
        accepted, first = counter.accepted_lengths(ids.shape[1], len(tokens))
        if accepted is None and name == GREEDY:
            accepted, first = [1] * max(0, len(tokens) - 1), 1
        return Run(tokens, seconds, len(counter.cache_lengths), accepted, None, first)

    return Method(name, label, "baseline", run=run)


def _probe_method(
    decoder, drafter: str, budget, num_masks: int, seed: int, label: str, recorded_budget, recorded_masks,
    variant: dict | None = None,
) -> Method:
    variant = variant or {}

    def run(ids: torch.Tensor, max_new_tokens: int) -> Run:
        t0 = time.perf_counter()
        out = decoder.generate(
            ids,
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=True,
            drafter=drafter,
            budget=budget,
            num_masks=num_masks,
            mask_seed=seed,
            **variant,
        )
        seconds = time.perf_counter() - t0
        s = out.stats
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        first = len(tokens) - sum(s.accepted_lengths)  # 1, or more when confadapt emits at prefill
        return Run(tokens, seconds, s.forward_passes, list(s.accepted_lengths), s.prefill_seconds, first,
                   s.forward_seconds, list(s.inputs_per_pass))

    return Method(drafter, label, "probe", recorded_budget, recorded_masks, run,
                  masks=variant.get("masks"), acceptance=variant.get("acceptance", "verify"))


def masks_label(path: str) -> str:
    """A short name for a tuned mask file: its stem, or its folder's name for ``masks.safetensors``."""
    p = Path(path)
    return p.parent.name if p.stem == "masks" and p.parent.name else p.stem


def mask_variants(settings: ReportSettings) -> list[tuple[str, dict]]:
    """``(label suffix, generate kwargs)`` for every tuned-mask source x acceptance rule."""
    out = []
    for source in settings.masks:
        for rule in settings.acceptance:
            suffix, kwargs = "", {}
            if source is not None:
                suffix += f" tuned:{masks_label(source)}"
                kwargs["masks"] = source
            if rule != "verify":
                suffix += f" {rule}@{settings.threshold:g}"
                kwargs.update(acceptance=rule, threshold=settings.threshold)
            out.append((suffix, kwargs))
    return out


def build_methods(model, tokenizer, settings: ReportSettings) -> list[Method]:
    """The two baselines, then each drafter at each budget (a budget-free drafter such as ``ar`` once)."""
    methods = [
        _hf_method(model, GREEDY, GREEDY),
        _hf_method(model, HF_PLD, HF_PLD, prompt_lookup_num_tokens=settings.hf_pld_tokens),
    ]
    if settings.methods:
        decoder = ProbeDecoder(model, tokenizer, **settings.knobs)
        for drafter in settings.methods:
            cls = drafter_class(drafter)
            k = 0 if cls.mask_use == "none" else settings.num_masks
            k_label = f" k={k}" if k not in (0, 1) else ""
            if cls.budget_free:  # the same at every budget: measured once
                methods.append(_probe_method(decoder, drafter, settings.budgets[0], settings.num_masks,
                                             settings.seed, drafter, recorded_budget=None, recorded_masks=k))
                continue
            variants = mask_variants(settings) if k else [("", {})]
            for budget in settings.budgets:
                for suffix, variant in variants:
                    label = f"{drafter} BC={budget}{k_label}{suffix}"
                    methods.append(_probe_method(decoder, drafter, budget, settings.num_masks, settings.seed, label,
                                                 recorded_budget=budget, recorded_masks=k, variant=variant))
    return methods


# --------------------------------------------------------------------------- the loop
@dataclass
class Report:
    """Everything one run measured: settings, environment, per-prompt records."""

    settings: dict
    environment: dict
    records: list[dict]
    started_at: str
    total_seconds: float
    methods: list[str] = field(default_factory=list)

    @property
    def summary(self) -> list[dict]:
        return summarize(self.records, labels=self.methods)

    @classmethod
    def from_dict(cls, d: dict) -> "Report":
        """A report read back from report.json (to re-render tables, summaries and plots)."""
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} report (schema: {d.get('schema')!r})")
        return cls(d["settings"], d["environment"], d["records"], d["started_at"], d["total_seconds"], d["methods"])

    def as_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "settings": self.settings,
            "environment": self.environment,
            "started_at": self.started_at,
            "total_seconds": self.total_seconds,
            "methods": list(self.methods),
            "records": self.records,
            "summary": self.summary,
        }


def environment() -> dict:
    import numpy
    import transformers

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # not on every platform
        load = None
    return {
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "probe_mtp": __version__,
        "load_average": load,
    }


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def matching_tokens(tokens: list[int], reference: list[int]) -> int:
    """Positions where ``tokens`` and ``reference`` hold the same token."""
    return sum(1 for a, b in zip(tokens, reference) if a == b)


def _record(method: Method, prompt: Prompt, turn: int, prompt_tokens: int, run: Run, reference: list[int], order: int) -> dict:
    tau = None
    if run.accepted_lengths:
        tau = sum(run.accepted_lengths) / len(run.accepted_lengths)
    mismatch = _first_mismatch(run.tokens, reference)
    compared = max(len(run.tokens), len(reference))
    matching = matching_tokens(run.tokens, reference)
    return {
        "method": method.name,
        "label": method.label,
        "kind": method.kind,
        "budget": method.budget,
        "num_masks": method.num_masks,
        "task": prompt.task,
        "category": prompt.category,
        "question_id": prompt.question_id,
        "turn": turn,
        "order": order,
        "prompt_tokens": prompt_tokens,
        "new_tokens": len(run.tokens),
        "forward_passes": run.forward_passes,
        "first_pass_tokens": run.first_pass_tokens,
        "accepted_lengths": run.accepted_lengths,
        "mean_accepted_length": tau,
        "seconds": run.seconds,
        "prefill_seconds": run.prefill_seconds,
        "forward_seconds": run.forward_seconds,
        "inputs_per_pass": run.inputs_per_pass,
        "tokens_per_second": len(run.tokens) / run.seconds if run.seconds > 0 else None,
        "identical_to_greedy": mismatch is None,
        "first_mismatch": mismatch,
        "masks": method.masks if method.masks is None else str(method.masks),
        "acceptance": method.acceptance,
        "matching_tokens": matching,
        "compared_tokens": compared,
        "agreement": matching / compared if compared else 1.0,
    }


def run_report(
    model,
    tokenizer,
    settings: ReportSettings,
    prompts: list[Prompt] | None = None,
    progress: bool = True,
    console=None,
) -> Report:
    """Run every method on every prompt turn (prompt-major, order rotated) and return the records."""
    torch.manual_seed(settings.seed)
    prompts = select_prompts(settings) if prompts is None else prompts
    methods = build_methods(model, tokenizer, settings)
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    env = environment()
    t_start = time.perf_counter()
    total = sum(len(p.turns) for p in prompts) * len(methods)
    records: list[dict] = []

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not progress,
        transient=False,
    )
    with torch.no_grad(), bar:
        warm = bar.add_task("warm-up", total=len(methods))
        warm_ids = chat_input_ids(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}])
        warm_tokens = max(1, min(settings.warmup_tokens, settings.max_new_tokens))
        for m in methods:
            bar.update(warm, description=f"warm-up {m.label}")
            m.run(warm_ids, warm_tokens)
            bar.advance(warm)
        job = bar.add_task("measuring", total=total)
        slot = 0
        for prompt in prompts:
            history: list[dict] = []
            for turn, text in enumerate(prompt.turns, 1):
                messages = history + [{"role": "user", "content": text}]
                ids = chat_input_ids(tokenizer, messages).to(model.device)
                shift = slot % len(methods)
                order = methods[shift:] + methods[:shift]
                slot += 1
                runs: dict[str, Run] = {}
                for m in order:
                    bar.update(job, description=f"{prompt.task} q{prompt.question_id}.{turn} {m.label}")
                    runs[m.label] = m.run(ids, settings.max_new_tokens)
                    bar.advance(job)
                reference = runs[GREEDY].tokens
                for m in methods:
                    records.append(_record(m, prompt, turn, ids.shape[1], runs[m.label], reference, order.index(m)))
                answer = tokenizer.decode(reference, skip_special_tokens=True)
                history = messages + [{"role": "assistant", "content": answer}]
        bar.update(job, description="done")
    return Report(
        settings=settings.as_dict(),
        environment={**env, "load_average_after": environment()["load_average"]},
        records=records,
        started_at=started,
        total_seconds=time.perf_counter() - t_start,
        methods=[m.label for m in methods],
    )
