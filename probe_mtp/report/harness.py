"""Running methods over prompts: the timing loop and the per-prompt records.

Honest timing, for every method alike:

- one untimed warm-up generation per method before anything is timed (a decoder that keeps a
  drafting memory forgets the warm-up afterwards, so the measured stream starts from an empty one);
- the same prompts (same token ids) and the same ``max_new_tokens`` for every method;
- the clock runs around the whole call (prefill, drafting, verification, Python overhead);
- prompt-major loop: for each prompt turn every method runs once, in an order rotated from one
  turn to the next, so that slow phases of a shared machine fall on every method alike.

A method's output is compared with ``model.generate(do_sample=False)`` on the same input
(``identical_to_greedy``); MT-bench's second turn (and every later turn of a conversation stream,
:mod:`.streams`) is built from ``model.generate``'s earlier answers, which every lossless method
reproduces, so all methods see the same prompts.

Drafting memory: a :class:`~probe_mtp.decoder.ProbeDecoder` learns across requests by default.
``memory="warm"`` gives every probe method its own decoder for the whole prompt stream, as a
user's long-running process would have (methods never share one, so no method drafts from another
method's outputs); ``memory="cold"`` decodes every prompt with an empty drafting memory
(``ProbeDecoder(memory=False)``, as a fresh decoder per prompt would).

The first section of a report is the default configuration (:data:`DEFAULT`), exactly what
``probe_mtp.generate(model, ids)`` runs: ``ProbeDecoder(model, tokenizer)`` with no knob changed;
the decoder options of the command line never reach it.
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

from ..config import UNTUNED_MASKS, ProbeConfig
from ..decoder import ProbeDecoder
from ..drafters import drafter_class, drafter_names
from ..prompts import Prompt, balanced_subset, chat_input_ids, load_prompts
from ..tuned_masks import AUTO_MASKS, BUNDLED, masks_label
from ..version import __version__
from .baselines import BASELINES, DEFAULT, GREEDY, GREEDY_FP32, HF_PLD
from .streams import DEFAULT_STREAM, StreamTurn, build_stream, check_stream
from .summary import summarize
from .timing import wall_seconds

SCHEMA = "probe-mtp-report/2"
READABLE_SCHEMAS = ("probe-mtp-report/1", SCHEMA)
PROMPT_MEAN = "prompt_mean"
"""``--masks`` value for the untuned prompt-mean mask vectors (the same as ``untuned``)."""
MASK_CHOICES = (AUTO_MASKS, *UNTUNED_MASKS, BUNDLED)
"""``--masks`` values that are not a file: ``auto`` (the default), ``untuned`` / ``prompt_mean``,
``bundled``."""
MEMORY_MODES = ("warm", "cold")
MAX_REPORT_BUDGET = 1024
"""The widest fixed pass a report accepts (a pass of more inputs is never useful and only slow)."""


# --------------------------------------------------------------------------- settings
def available_methods() -> tuple[str, ...]:
    """The probe-mtp drafters (from the drafter registry)."""
    return drafter_names()


def resolve_methods(spec: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Drafter names from a comma list (None or ``"all"``: every available drafter; ``"none"``: no
    drafter at a fixed budget, only the default configuration and the baselines)."""
    available = available_methods()
    if spec is None:
        return available
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    names = [n for n in names if n]
    if not names or names == ["all"]:
        return available
    if names == ["none"]:
        return ()
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


def parse_memory(spec: str | list | tuple) -> tuple[str, ...]:
    """``"warm,cold"`` -> ``("warm", "cold")``."""
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    items = list(dict.fromkeys(i for i in items if i))
    if not items:
        raise ValueError("--memory needs warm, cold or warm,cold")
    for item in items:
        if item not in MEMORY_MODES:
            raise ValueError(f"--memory takes warm, cold or both (warm,cold), got {item!r}")
    return tuple(items)


def check_masks_choice(choice) -> str:
    """A ``--masks`` value: one of :data:`MASK_CHOICES` or a readable tuned mask file."""
    choice = str(choice)
    if choice in MASK_CHOICES:
        return choice
    if not Path(choice).is_file():
        raise FileNotFoundError(
            f"tuned mask file not found: {choice} (--masks takes {', '.join(MASK_CHOICES)} or a file written by "
            "probe-mtp tune-masks)"
        )
    return choice


@dataclass(frozen=True)
class ReportSettings:
    """What one report measures.

    - ``default``: measure the default configuration (:data:`DEFAULT`) beside the baselines;
    - ``methods``: probe-mtp drafters of the equal-budget comparison (the baselines are always
      added), each run at each of ``budgets``, with each ``masks`` choice and ``acceptance`` rule;
    - ``limit``: prompts per task (0: all of them); ``method_limit``: prompts per task that the
      equal-budget methods run on (the first of the selected ones; None: all selected);
    - ``memory``: ``warm`` (one decoder per method for the whole stream), ``cold`` (an empty
      drafting memory for every prompt), or both (each probe method measured both ways);
    - ``stream``: the order and shape of the prompts (:mod:`.streams`)."""

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
    masks: tuple[str, ...] = (AUTO_MASKS,)
    acceptance: tuple[str, ...] = ("verify",)
    threshold: float = 0.9
    knobs: dict = field(default_factory=dict)  # other ProbeConfig fields, the same for every probe method
    default: bool = True
    memory: tuple[str, ...] = ("warm",)
    stream: str = DEFAULT_STREAM
    method_limit: int | None = None
    full: bool = False

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"--limit (prompts per task) must be >= 0 (0 = all), got {self.limit}")
        if self.method_limit is not None and self.method_limit < 1:
            raise ValueError(f"the equal-budget methods need at least one prompt per task, got {self.method_limit}")
        if self.warmup_tokens < 1:
            raise ValueError(f"--warmup-tokens must be >= 1 (every method is warmed up), got {self.warmup_tokens}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.masks or not self.acceptance:
            raise ValueError("--masks and --acceptance need at least one value each")
        for choice in self.masks:
            check_masks_choice(choice)
        parse_memory(self.memory)
        check_stream(self.stream)
        for rule in self.acceptance:
            ProbeConfig(acceptance=rule, threshold=self.threshold, **self.knobs)
        for b in self.budgets:
            if b != "auto" and isinstance(b, int) and b > MAX_REPORT_BUDGET:
                raise ValueError(f"--budget {b} is out of range: a report measures passes of at most "
                                 f"{MAX_REPORT_BUDGET} inputs (BC 10-60 is the useful range)")
        for m in self.methods:
            for b in self.budgets:
                # the decoder's own validation, before any model is loaded
                ProbeConfig(num_masks=self.num_masks, budget=b, drafter=m, **self.knobs)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tasks"] = list(self.tasks) if self.tasks is not None else None
        d["methods"] = list(self.methods)
        d["budgets"] = list(self.budgets)
        d["masks"] = list(self.masks)
        d["acceptance"] = list(self.acceptance)
        d["memory"] = list(self.memory)
        d["prompts"] = self.prompts if self.prompts is not None else "bundled Spec-Bench (probe_mtp/data/specbench/question.jsonl)"
        return d


def select_prompts(settings: ReportSettings) -> list[Prompt]:
    """The prompt set: ``limit`` prompts per task (balanced over categories), of ``tasks``.  A
    prompt file that cannot be read is a ``ValueError`` naming it (before any model is loaded)."""
    try:
        prompts = load_prompts(settings.prompts)
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the prompt file {settings.prompts}: {exc}") from None
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
    masks: str | None = None  # which mask vectors the decoder used (its statistics' label)
    memory: str | None = None  # "warm" or "cold" (the decoder's statistics)
    budget: int | str | None = None  # the budget the decoder ran with ("auto" or a number)


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
    """A method of the report: a name (``generate``, ``hf-pld``, ``default`` or a drafter), its
    budget and masks (None for the baselines), and a display label.  ``kind``: ``baseline``,
    ``default`` (the default configuration) or ``probe`` (the equal-budget comparison)."""

    name: str
    label: str
    kind: str
    budget: int | str | None = None
    num_masks: int | None = None
    run: Callable[[torch.Tensor, int], Run] = field(default=None, repr=False)
    masks: str | None = None  # the --masks choice (auto, untuned, bundled or a file); None: no masks
    acceptance: str = "verify"
    memory: str | None = None  # warm or cold (None for the baselines)
    decoder: ProbeDecoder | None = field(default=None, repr=False)

    def forget(self) -> None:
        """Empty the decoder's drafting memory (after the warm-up)."""
        if self.decoder is not None:
            self.decoder.reset_memory()


def _hf_method(model, name: str, label: str, **generate_kwargs) -> Method:
    def run(ids: torch.Tensor, max_new_tokens: int) -> Run:
        counter = _PassCounter()
        attention_mask = torch.ones_like(ids)
        handle = model.register_forward_pre_hook(counter, with_kwargs=True)
        try:
            out, seconds = wall_seconds(model.device, model.generate, ids, attention_mask=attention_mask,
                                        do_sample=False, max_new_tokens=max_new_tokens, **generate_kwargs)
        finally:
            handle.remove()
        tokens = out[0, ids.shape[1]:].tolist()
        accepted, first = counter.accepted_lengths(ids.shape[1], len(tokens))
        if accepted is None and name in (GREEDY, GREEDY_FP32):
            accepted, first = [1] * max(0, len(tokens) - 1), 1
        return Run(tokens, seconds, len(counter.cache_lengths), accepted, None, first)

    return Method(name, label, "baseline", run=run)


def _decoder_run(decoder: ProbeDecoder, knobs: dict) -> Callable[[torch.Tensor, int], Run]:
    """A timed ``decoder.generate`` with ``knobs`` (none: the decoder's own configuration)."""

    def run(ids: torch.Tensor, max_new_tokens: int) -> Run:
        out, seconds = wall_seconds(decoder.model.device, decoder.generate, ids, max_new_tokens=max_new_tokens,
                                    return_dict_in_generate=True, **knobs)
        s = out.stats
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        first = len(tokens) - sum(s.accepted_lengths)  # 1, or more when confadapt emits at prefill
        return Run(tokens, seconds, s.forward_passes, list(s.accepted_lengths), s.prefill_seconds, first,
                   s.forward_seconds, list(s.inputs_per_pass), s.masks or None, s.memory or None, s.budget)

    return run


def _decoder(model, tokenizer, memory: str, **knobs) -> ProbeDecoder:
    return ProbeDecoder(model, tokenizer, memory=memory == "warm", **knobs)


def default_method(model, tokenizer, memory: str = "warm", label: str = DEFAULT) -> Method:
    """The default configuration: ``ProbeDecoder(model, tokenizer)`` exactly as
    ``probe_mtp.generate(model, ids)`` builds it (``memory="cold"``: with ``memory=False``), every
    request through its ``generate`` with no knob."""
    decoder = _decoder(model, tokenizer, memory)
    config = decoder.config
    k = 0 if drafter_class(config.drafter).mask_use == "none" else config.num_masks
    return Method(DEFAULT, label, "default", config.budget, k, _decoder_run(decoder, {}),
                  masks=str(config.masks), memory=memory, decoder=decoder)


def _probe_method(
    decoder: ProbeDecoder, drafter: str, budget, num_masks: int, seed: int, label: str, recorded_budget, recorded_masks,
    memory: str, variant: dict | None = None,
) -> Method:
    variant = variant or {}
    knobs = dict(drafter=drafter, budget=budget, num_masks=num_masks, mask_seed=seed, **variant)
    return Method(drafter, label, "probe", recorded_budget, recorded_masks, _decoder_run(decoder, knobs),
                  masks=variant.get("masks") if recorded_masks else None, acceptance=variant.get("acceptance", "verify"),
                  memory=memory, decoder=decoder)


def file_masks_label(path: str) -> str:
    """A short name for a tuned mask file: its stem, or its folder's name for ``masks.safetensors``."""
    p = Path(path)
    return p.parent.name if p.stem == "masks" and p.parent.name else p.stem


def mask_variants(settings: ReportSettings) -> list[tuple[str, str, dict]]:
    """``(masks choice, acceptance suffix, generate kwargs)`` for every ``--masks`` choice x
    acceptance rule.  The label names the vectors a choice resolves to on the loaded model
    (:func:`resolved_masks_label`)."""
    out = []
    for source in settings.masks:
        for rule in settings.acceptance:
            suffix, kwargs = "", {"masks": source}
            if rule != "verify":
                suffix = f" {rule}@{settings.threshold:g}"
                kwargs.update(acceptance=rule, threshold=settings.threshold)
            out.append((source, suffix, kwargs))
    return out


def resolved_masks_label(decoder: ProbeDecoder, choice: str, num_masks: int) -> str:
    """What ``masks=choice`` means on the decoder's model, as its statistics name it
    (``bundled:smollm2-135m``, ``untuned:prompt_mean``, ``tuned:NAME``); raises a clear error when
    the choice does not fit the model (``bundled`` without vectors for it, a file of another model)."""
    config = ProbeConfig.from_kwargs(decoder.config, masks=choice, num_masks=num_masks)
    label = masks_label(config, decoder.tuned_masks(config, num_masks))
    if label.startswith("tuned:") and choice not in MASK_CHOICES:
        label = f"tuned:{file_masks_label(choice)}"
    return label


def build_methods(model, tokenizer, settings: ReportSettings, reference_model=None) -> list[Method]:
    """The two baselines, ``model.generate`` on ``reference_model`` (:data:`GREEDY_FP32`: the
    unprepared float32 model beside a prepared one; only when given), the default configuration
    (``settings.default``), then each drafter at each budget (a budget-free drafter such as ``ar``
    once), each with its own decoder; with both memory modes every probe method twice (labels end
    in ``warm`` / ``cold``)."""
    methods = [
        _hf_method(model, GREEDY, GREEDY),
        _hf_method(model, HF_PLD, HF_PLD, prompt_lookup_num_tokens=settings.hf_pld_tokens),
    ]
    if reference_model is not None:
        methods.append(_hf_method(reference_model, GREEDY_FP32, GREEDY_FP32))
    both = len(settings.memory) > 1
    for memory in settings.memory:
        mem_suffix = f" {memory}" if both else ""
        if settings.default:
            methods.append(default_method(model, tokenizer, memory, DEFAULT + mem_suffix))
        for drafter in settings.methods:
            cls = drafter_class(drafter)
            k = 0 if cls.mask_use == "none" else settings.num_masks
            k_label = f" k={k}" if k not in (0, 1) else ""
            if cls.budget_free:  # the same at every budget: measured once
                decoder = _decoder(model, tokenizer, memory, **settings.knobs)
                methods.append(_probe_method(decoder, drafter, settings.budgets[0], settings.num_masks, settings.seed,
                                             drafter + mem_suffix, None, k, memory))
                continue
            variants = mask_variants(settings) if k else [(None, "", {})]
            for budget in settings.budgets:
                for choice, suffix, variant in variants:
                    decoder = _decoder(model, tokenizer, memory, **settings.knobs)
                    masks = f" {resolved_masks_label(decoder, choice, k)}" if k else ""
                    label = f"{drafter} BC={budget}{k_label}{masks}{suffix}{mem_suffix}"
                    methods.append(_probe_method(decoder, drafter, budget, settings.num_masks, settings.seed, label,
                                                 budget, k, memory, variant))
    return methods


# --------------------------------------------------------------------------- the loop
@dataclass
class Report:
    """Everything one run measured: settings, environment, per-prompt records.  ``pass_costs``:
    ``{inputs: c(inputs) / c(1)}`` on this machine's cost curve, for the fixed budgets measured
    (what one pass of a fixed block complexity costs against a one-token pass)."""

    settings: dict
    environment: dict
    records: list[dict]
    started_at: str
    total_seconds: float
    methods: list[str] = field(default_factory=list)
    pass_costs: dict = field(default_factory=dict)
    batches: list[dict] = field(default_factory=list)  # --batch: one row per batch size (report.batches)
    memories: dict = field(default_factory=dict)  # {label: a warm decoder's memory after the stream}

    @property
    def summary(self) -> list[dict]:
        return summarize(self.records, labels=self.methods)

    @property
    def dtype_label(self) -> str:
        """What the run computed in (the environment's resolved dtype, e.g. ``bfloat16 prepared``),
        with the requested ``--dtype`` where it says something else (``auto``)."""
        requested = self.settings["dtype"]
        resolved = self.environment.get("dtype") or requested
        return resolved if resolved == requested else f"{resolved}; requested {requested}"

    @property
    def device_label(self) -> str:
        """Where the run computed (:func:`device_label`): ``cpu``, ``cuda:0 (NVIDIA ...)``."""
        return device_label(self.environment)

    @property
    def default_labels(self) -> list[str]:
        """The rows of the default configuration (one, or one per memory mode)."""
        seen = []
        for r in self.records:
            if r.get("kind") == "default" and r["label"] not in seen:
                seen.append(r["label"])
        return [m for m in self.methods if m in seen] or seen

    @property
    def fixed_labels(self) -> list[str]:
        """The methods of the equal-budget comparison (kind ``probe``)."""
        seen = {r["label"] for r in self.records if r.get("kind") == "probe"}
        return [m for m in self.methods if m in seen]

    @classmethod
    def from_dict(cls, d: dict) -> "Report":
        """A report read back from report.json (to re-render tables, summaries and plots)."""
        if d.get("schema") not in READABLE_SCHEMAS:
            raise ValueError(f"not a {SCHEMA} report (schema: {d.get('schema')!r})")
        costs = (d.get("equal_budget") or {}).get("pass_cost_relative_to_one_token") or {}
        return cls(d["settings"], d["environment"], d["records"], d["started_at"], d["total_seconds"], d["methods"],
                   {int(k): v for k, v in costs.items()}, list(d.get("batches") or []), dict(d.get("memories") or {}))

    def as_dict(self) -> dict:
        from .summary import default_section, equal_budget_section

        summary = self.summary
        return {
            "schema": SCHEMA,
            "settings": self.settings,
            "environment": self.environment,
            "started_at": self.started_at,
            "total_seconds": self.total_seconds,
            "methods": list(self.methods),
            "default": default_section(self.records, summary, self.default_labels),
            "equal_budget": equal_budget_section(summary, self.fixed_labels, self.settings, self.pass_costs),
            "batches": list(self.batches),
            "memories": dict(self.memories),
            "records": self.records,
            "summary": summary,
        }


def resolved_dtype(model) -> str:
    """What ``model`` computes in: ``bfloat16 prepared`` (:func:`probe_mtp.optimize`), ``float32
    packed`` (:func:`probe_mtp.pack_wide` by MKL; ``float32 packed by oneDNN``), else its dtype
    (``float32``, or ``bfloat16`` / ``float16`` with stock kernels)."""
    from ..optimize import is_optimized
    from ..wide import ONEDNN, wide_kernel

    name = str(model.dtype).removeprefix("torch.")
    if is_optimized(model):
        return f"{name} prepared"
    kernel = wide_kernel(model)
    if kernel is None:
        return name
    return f"{name} packed by oneDNN" if kernel == ONEDNN else f"{name} packed"


def device_fields(model=None) -> dict:
    """``{"device": "cuda:0", "accelerator": "cuda: NVIDIA H100 ..., capability 9.0, CUDA 12.8"}``:
    where ``model`` computed and, off the CPU, which accelerator that is
    (:func:`probe_mtp.cost.accelerator_name`; None on the CPU, and both None without a model)."""
    from ..cost import accelerator_name

    if model is None:
        return {"device": None, "accelerator": None}
    return {"device": str(model.device), "accelerator": accelerator_name(model.device)}


def device_label(environment: dict) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H100 80GB HBM3, capability 9.0, CUDA 12.8)``: the device of a
    report's environment (``cpu`` for a report written before devices were recorded: every
    earlier run was on the CPU)."""
    device = environment.get("device") or "cpu"
    accelerator = environment.get("accelerator") or ""
    _, _, named = accelerator.partition(": ")
    return f"{device} ({named})" if named else device


def environment(model=None, reference_model=None) -> dict:
    """The machine and library versions; with ``model``: the dtype it resolved to
    (:func:`resolved_dtype`; the settings keep the requested one, e.g. ``auto``), its kernels
    (:func:`probe_mtp.optimize.describe`) and its device (:func:`device_fields`);
    ``fp32_reference``: the kernels of the float32 model measured beside a prepared one (None
    without one)."""
    import numpy
    import transformers

    from ..kernels import processor
    from ..optimize import describe

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # not on every platform
        load = None
    return {
        "dtype": resolved_dtype(model) if model is not None else None,
        "kernels": describe(model) if model is not None else None,
        **device_fields(model),
        "matrix_units": processor().matrix_units,
        "fp32_reference": describe(reference_model) if reference_model is not None else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "processor": processor_name(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "probe_mtp": __version__,
        "load_average": load,
    }


def processor_name() -> str | None:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def matching_tokens(tokens: list[int], reference: list[int]) -> int:
    """Positions where ``tokens`` and ``reference`` hold the same token."""
    return sum(1 for a, b in zip(tokens, reference) if a == b)


def _record(method: Method, item: StreamTurn, prompt_tokens: int, run: Run, reference: list[int], order: int) -> dict:
    tau = None
    if run.accepted_lengths:
        tau = sum(run.accepted_lengths) / len(run.accepted_lengths)
    mismatch = _first_mismatch(run.tokens, reference)
    compared = max(len(run.tokens), len(reference))
    matching = matching_tokens(run.tokens, reference)
    prompt = item.prompt
    return {
        "method": method.name,
        "label": method.label,
        "kind": method.kind,
        "budget": run.budget if method.kind == "default" else method.budget,
        "num_masks": method.num_masks,
        "task": prompt.task,
        "category": prompt.category,
        "question_id": prompt.question_id,
        "turn": item.turn,
        "ask": item.ask,
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
        "masks": run.masks,
        "memory": run.memory,
        "acceptance": method.acceptance,
        "matching_tokens": matching,
        "compared_tokens": compared,
        "agreement": matching / compared if compared else 1.0,
    }


def method_prompts(prompts: list[Prompt], settings: ReportSettings) -> set[Prompt]:
    """The prompts the equal-budget methods run on: the first ``method_limit`` of each task."""
    if settings.method_limit is None:
        return set(prompts)
    tasks = tuple(dict.fromkeys(p.task for p in prompts))
    return set(balanced_subset(prompts, settings.method_limit, tasks))


def position_limit(model) -> int | None:
    """The most positions the model takes (None: not stated)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def pass_costs(methods: list[Method], budgets) -> dict[int, float]:
    """``{BC: c(BC) / c(1)}`` on the cost curve of the first probe decoder (read from the cache
    the warm-up filled, or measured); empty when no decoder runs."""
    decoder = next((m.decoder for m in methods if m.decoder is not None), None)
    fixed = [b for b in budgets if isinstance(b, int)]
    if decoder is None or not fixed:
        return {}
    curve = decoder.cost_curve(decoder.config)
    return {int(b): float(curve.relative(int(b))) for b in fixed}


def run_report(
    model,
    tokenizer,
    settings: ReportSettings,
    prompts: list[Prompt] | None = None,
    progress: bool = True,
    console=None,
    reference_model=None,
) -> Report:
    """Run every method on every prompt turn of the stream (prompt-major, order rotated) and
    return the records.  ``reference_model``: the unprepared float32 model beside a prepared
    ``model``, measured as the baseline :data:`GREEDY_FP32` (identity is still judged against
    ``model.generate`` on ``model``)."""
    torch.manual_seed(settings.seed)
    prompts = select_prompts(settings) if prompts is None else prompts
    stream = build_stream(prompts, settings.stream)
    methods = build_methods(model, tokenizer, settings, reference_model)
    covered = method_prompts(prompts, settings)
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    env = environment(model, reference_model)
    t_start = time.perf_counter()
    fixed = [m for m in methods if m.kind == "probe"]
    others = [m for m in methods if m.kind != "probe"]
    total = sum(len(others) + (len(fixed) if item.prompt in covered else 0) for c in stream for item in c.turns)
    most = position_limit(model)
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
        warm_ids = chat_input_ids(tokenizer, [{"role": "user", "content": stream[0].turns[0].text}]).to(model.device)
        warm_tokens = max(1, min(settings.warmup_tokens, settings.max_new_tokens))
        for m in methods:
            bar.update(warm, description=f"warm-up {m.label}")
            m.run(warm_ids, warm_tokens)
            m.forget()  # the measured stream starts from an empty drafting memory
            bar.advance(warm)
        job = bar.add_task("measuring", total=total)
        slot = 0
        for conversation in stream:
            history: list[dict] = []
            messages: list[dict] = []
            for item in conversation.turns:
                if item.ask == 1:
                    messages = history + [{"role": "user", "content": item.text}]
                ids = chat_input_ids(tokenizer, messages).to(model.device)
                if most is not None and ids.shape[1] + settings.max_new_tokens > most:
                    if console is not None:
                        console.print(f"{conversation.task}: the conversation reached {ids.shape[1]} tokens; its last "
                                      f"{len(conversation.turns) - conversation.turns.index(item)} turn(s) would not "
                                      f"fit the model's {most} positions and are left out", highlight=False)
                    bar.advance(job, sum(len(others) + (len(fixed) if later.prompt in covered else 0)
                                         for later in conversation.turns[conversation.turns.index(item):]))
                    break
                active = others + (fixed if item.prompt in covered else [])
                shift = slot % len(active)
                order = active[shift:] + active[:shift]
                slot += 1
                runs: dict[str, Run] = {}
                for m in order:
                    ask = f" (ask {item.ask})" if item.ask > 1 else ""
                    bar.update(job, description=f"{item.task} q{item.prompt.question_id}.{item.turn}{ask} {m.label}")
                    runs[m.label] = m.run(ids, settings.max_new_tokens)
                    bar.advance(job)
                reference = runs[GREEDY].tokens
                for m in active:
                    records.append(_record(m, item, ids.shape[1], runs[m.label], reference, order.index(m)))
                answer = tokenizer.decode(reference, skip_special_tokens=True)
                history = messages + [{"role": "assistant", "content": answer}]
        bar.update(job, description="done")
    costs = pass_costs(methods, settings.budgets) if fixed else {}
    total = time.perf_counter() - t_start
    return Report(
        settings=settings.as_dict(),
        environment={**env, "load_average_after": environment()["load_average"]},
        records=records,
        started_at=started,
        total_seconds=total,
        methods=[m.label for m in methods],
        pass_costs=costs,
        memories={m.label: memory_figures(m.decoder.memory) for m in methods
                  if m.decoder is not None and m.decoder.memory is not None and m.decoder.memory.requests},
    )


def memory_figures(memory) -> dict:
    """A warm decoder's drafting memory after the stream: its size, and how long a save to a file and
    a load back take (the round trip of ``save_memory`` / ``ProbeDecoder(memory=path)``)."""
    import tempfile

    from ..memory import DraftingMemory

    figures = memory.summary()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory.safetensors"
        t0 = time.perf_counter()
        memory.save(path)
        t1 = time.perf_counter()
        DraftingMemory.load(path, memory.identity, memory.tokenizer, max_bytes=memory.max_bytes)
        t2 = time.perf_counter()
        figures.update(file_bytes=path.stat().st_size, save_seconds=t1 - t0, load_seconds=t2 - t1)
    return figures
