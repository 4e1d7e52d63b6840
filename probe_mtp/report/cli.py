"""The ``probe-mtp report`` subcommand."""

from __future__ import annotations

import argparse

from ..config import ProbeConfig
from ..loading import DEFAULT_MODEL
from ..options import add_config_arguments, add_model_arguments, config_from_args
from .streams import STREAMS

DEFAULT_OUT = "report-out"


# What `probe-mtp report` measures without options (sized to finish in about 4 minutes on a 2-core
# CPU, model load and cost curve included), and with --full (every task, every drafter, more prompts).
QUICK = {"limit": 1, "max_new_tokens": 48, "methods": ("hybrid", "esp", "pld", "lookahead", "stand")}
FULL = {"limit": 2, "max_new_tokens": 128, "methods": None}


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    quick_methods = ", ".join(QUICK["methods"])
    r = subparsers.add_parser(
        "report",
        help="the default decoder against model.generate and transformers' prompt lookup (verdict first), then "
        "tau, tokens/s, speedup and losslessness of every drafter at equal block complexity",
        description="Runs the Spec-Bench prompts, prompt by prompt, through the default configuration (exactly "
        "probe_mtp.generate(model, ids): drafter hybrid, budget auto, masks auto, drafting memory kept across "
        "requests), model.generate greedy and transformers' prompt lookup (prompt_lookup_num_tokens=10), and "
        "prints that comparison first, per task and overall, with a one-line verdict; then every drafter at an "
        "equal block complexity (the paper's tau comparison). Decoder options change the equal-budget drafters "
        "only; the default configuration is always measured as it comes. "
        f"Default run: {QUICK['limit']} prompt per task, {QUICK['max_new_tokens']} new tokens, drafters "
        f"{quick_methods} (about 4 minutes on 2 cores); --full: {FULL['limit']} prompts per task, "
        f"{FULL['max_new_tokens']} new tokens, every drafter.",
    )
    add_run_arguments(r, budget="30", limit=None, tokens=None, warmup=8,
                      drafters=f"{quick_methods}; --full: every drafter",
                      limit_note=f"{QUICK['limit']}, balanced over each task's categories; --full: {FULL['limit']}",
                      tokens_note=f"{QUICK['max_new_tokens']}; --full: {FULL['max_new_tokens']}")
    r.add_argument("--full", action="store_true",
                   help=f"the complete comparison: {FULL['limit']} prompts per task, {FULL['max_new_tokens']} new tokens, "
                   "every drafter (ar included) on every prompt (options given explicitly still win)")
    r.add_argument("--cold", action="store_true",
                   help="decode every prompt with an empty drafting memory, as a fresh decoder per prompt would "
                   "(default: warm, one decoder per method serves the whole prompt stream, as a long-running process)")
    r.add_argument("--fixed-limit", type=int, default=None, metavar="N",
                   help="prompts per task that the equal-budget drafters run on, the first of the selected ones "
                   "(default: all of them), so that more prompts can go to the default configuration's table")
    r.set_defaults(func=cmd_report)
    return r


DEVICE_HELP = ("where the model runs: cpu (default), cuda, cuda:1, xpu, mps; a device this machine does not have is an "
               "error naming the ones it has. --dtype auto means float32 off the CPU")


def add_device_argument(p: argparse.ArgumentParser) -> None:
    """``--device`` (``report``, ``bench``, ``generate``): passed to :func:`probe_mtp.load_model`."""
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)


def add_run_arguments(r, budget: str, limit: int | None, tokens: int | None, drafters: str = "every drafter",
                      limit_note: str | None = None, tokens_note: str | None = None, warmup: int = 16) -> None:
    """The options ``report`` and ``bench`` share: the model, the prompts, and every decoder knob of
    :class:`~probe_mtp.config.ProbeConfig` (``--drafter``, ``--budget``, ``--masks`` and
    ``--acceptance`` take comma lists: every value is measured).  ``limit`` / ``tokens`` None: the
    command resolves them (``limit_note`` / ``tokens_note`` say how)."""
    add_model_arguments(r)
    add_device_argument(r)
    add_config_arguments(r, sweep=True, defaults={"budget": budget}, aliases={"drafter": ("--methods",)},
                         notes={"drafter": drafters})
    r.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="prompt file in Spec-Bench format (default: the bundled Spec-Bench questions)")
    r.add_argument("--tasks", default=None,
                   help="comma list of tasks (default: all; Spec-Bench: mt_bench, translation, summarization, qa, "
                   "math_reasoning, rag)")
    r.add_argument("--limit", type=int, default=limit,
                   help=f"prompts per task (default {limit_note or limit}; 0 = all)")
    r.add_argument("--max-new-tokens", type=int, default=tokens,
                   help=f"new tokens per turn (default {tokens_note or tokens})")
    r.add_argument("--seed", type=int, default=0, help="torch seed and the masks' sampling seed (default 0)")
    r.add_argument("--warmup-tokens", type=int, default=warmup,
                   help=f"tokens of the untimed warm-up generation of each method (default {warmup})")
    r.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    r.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for report.json, records.csv, summary.md and the PNG plots (default {DEFAULT_OUT}/; "
                   "'-' writes nothing)")
    r.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--batch", default=None, metavar="SIZES",
                   help="also decode the prompts' first turns as left-padded batches of these sizes (comma list, "
                   "e.g. 1,2,4,8), the default decoder against model.generate on the same batches: tokens/s, "
                   "speedup with a 95%% interval over batches, tau, identical batches")


SWEPT = ("drafter", "budget", "masks", "acceptance")


def memory_from_args(args) -> tuple[str, ...]:
    """``--cold`` (report, bench) and ``--memory warm,cold`` (bench): the memory modes to measure."""
    from .harness import parse_memory

    cold = bool(getattr(args, "cold", False))
    given = getattr(args, "memory", None)
    if given is None:
        return ("cold",) if cold else ("warm",)
    modes = parse_memory(given)
    if cold and modes != ("cold",):
        raise ValueError(f"--cold and --memory {given} disagree; use one of them")
    return modes


def settings_from_args(args, default: bool = True):
    """Validated :class:`ReportSettings` (raises ValueError before any model is loaded);
    ``default``: measure the default configuration (the report: yes; the bench: no)."""
    from .harness import ReportSettings, parse_budgets, resolve_methods

    mode = FULL if getattr(args, "full", False) else QUICK
    tasks = None
    if args.tasks:
        tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip()) or None
    dtype = str(args.dtype).removeprefix("torch.")
    masks = tuple(dict.fromkeys(str(m) for m in (args.masks or ("auto",))))
    knobs = {k: v for k, v in config_from_args(args).items() if k not in SWEPT + ("num_masks", "threshold")}
    limit = args.limit if args.limit is not None else mode["limit"]
    tokens = args.max_new_tokens if args.max_new_tokens is not None else mode["max_new_tokens"]
    drafters = args.drafter if args.drafter is not None else mode["methods"]
    method_limit = getattr(args, "fixed_limit", None)  # the report's option
    if method_limit is not None and method_limit < 1:
        raise ValueError(f"--fixed-limit must be >= 1, got {method_limit}")
    if method_limit is not None and limit and method_limit >= limit:
        method_limit = None  # every selected prompt
    return ReportSettings(
        model=args.model or DEFAULT_MODEL,
        dtype=dtype,
        prompts=args.prompts,
        tasks=tasks,
        limit=limit,
        max_new_tokens=tokens,
        methods=resolve_methods(drafters),
        budgets=parse_budgets(args.budget),
        num_masks=args.num_masks if args.num_masks is not None else ProbeConfig.default("num_masks"),
        seed=args.seed,
        warmup_tokens=args.warmup_tokens,
        masks=masks,
        acceptance=tuple(args.acceptance or ("verify",)),
        threshold=args.threshold if args.threshold is not None else ProbeConfig.default("threshold"),
        knobs=knobs,
        default=default,
        memory=memory_from_args(args),
        stream=getattr(args, "stream", None) or "specbench",
        method_limit=method_limit,
        full=bool(getattr(args, "full", False)),
    )


def prepare_run(args, loaded=None, default: bool = True):
    """Shared by ``report`` and ``bench``: consoles, torch threads, validated settings, prompts, the
    output folder checked, and the model: ``--model`` in ``--dtype``, and when that model came out
    prepared (:func:`probe_mtp.optimize`) or packed (:func:`probe_mtp.pack_wide`), as ``--dtype auto``
    may give it, a second, unprepared float32 copy of it (the reference, measured as the baseline
    ``generate fp32``; else None).  ``loaded``: an already loaded ``(model, tokenizer)`` or
    ``(model, tokenizer, reference)`` instead (nothing is loaded then: a prepared model without a
    reference is measured without the float32 baseline).  Every check runs before a model is
    loaded.  Returns ``(console, progress_console, settings, prompts, model, tokenizer, reference)``."""
    import os

    import torch
    from rich.console import Console

    from .harness import select_prompts
    from .outputs import check_output_folder

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=160)  # piped: rich would assume 80 columns and squeeze the tables
    progress_console = Console(stderr=True)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    from ..loading import resolve_device

    device = resolve_device(args.device)
    settings = settings_from_args(args, default=default)
    prompts = select_prompts(settings)
    sizes = batch_sizes(args)
    if sizes and max(sizes) > len(prompts):
        raise ValueError(f"--batch {max(sizes)} needs at least {max(sizes)} prompts; {len(prompts)} are selected "
                         "(raise --limit)")
    if args.out and args.out != "-":
        check_output_folder(args.out)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    busy = busy_machine_note(torch.get_num_threads())
    if busy:
        progress_console.print(f"[yellow]{busy}[/yellow]", highlight=False)
    if loaded is None:
        from ..loading import load_model
        from ..optimize import describe, is_optimized
        from ..wide import is_packed_wide

        with progress_console.status(f"loading {settings.model} on {device}..."):
            model, tokenizer = load_model(args.model, dtype=args.dtype, device=device)
        progress_console.print(f"{settings.model}: {describe(model)}", highlight=False)
        reference = None
        if is_optimized(model) or is_packed_wide(model):
            with progress_console.status(f"loading {settings.model} in float32 (the generate fp32 baseline)..."):
                reference, _ = load_model(args.model, dtype=torch.float32, device=device)
    else:
        model, tokenizer, reference = (*loaded, None)[:3]
    return console, progress_console, settings, prompts, model, tokenizer, reference


def batch_sizes(args) -> tuple[int, ...]:
    """``--batch`` parsed (empty when not given)."""
    from .batches import parse_batch_sizes

    given = getattr(args, "batch", None)
    return parse_batch_sizes(given) if given is not None else ()


def run_batches(args, model, tokenizer, settings, prompts, console, progress_console, reference=None):
    """``--batch``: the default decoder against model.generate on the same left-padded batches (and
    against ``reference.generate``, the float32 model, when given); prints the table and its
    sentence and returns the rows."""
    import torch

    from ..decoder import ProbeDecoder
    from .batches import batch_sentence, first_turn_ids, measure_batches, rich_batch_table

    sizes = batch_sizes(args)
    decoder = ProbeDecoder(model, tokenizer)
    ids = first_turn_ids(tokenizer, prompts)

    def progress(size, done, total):
        if not args.no_progress:
            progress_console.print(f"batch size {size}: {done}/{total} batches", highlight=False)

    with torch.no_grad():
        rows = measure_batches(model, decoder, ids, list(sizes), settings.max_new_tokens, progress=progress,
                               reference_model=reference)
    title = (f"batches: {settings.model}, {len(ids)} prompts (first turns), {settings.max_new_tokens} new tokens, "
             f"greedy, {torch.get_num_threads()} threads")
    console.print(rich_batch_table(rows, title))
    console.print(batch_sentence(rows), highlight=False)
    return rows


def busy_machine_note(threads: int, load: float | None = None, cores: int | None = None) -> str | None:
    """A warning when other work already keeps the machine's cores busy (the load average over the
    last minute, ``load``, is at least one core's worth and this process would use every core):
    torch's threads then wait on each other at every operation and a run can take several times
    longer (the speedups, ratios within one run, stay comparable).  None on a quiet machine."""
    import os

    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # not on every platform
            return None
    cores = cores or os.cpu_count() or 1
    if threads < 2 or load < 1.0 or threads < cores:
        return None
    return (f"the machine is busy (load average {load:.1f} over the last minute on {cores} cores): with torch's "
            f"{threads} threads competing with that work, every operation waits for a descheduled thread and this "
            "run can take several times longer than on a quiet machine; --threads 1 avoids it (the speedups are "
            "then measured at 1 thread)")


def describe_run(settings, prompts, fp32: bool = False) -> str:
    """One line: what the run measures (``fp32``: with the float32 baseline)."""
    from .baselines import GREEDY, GREEDY_FP32, HF_PLD
    from .harness import method_prompts
    from .streams import build_stream, stream_turns

    turns = stream_turns(build_stream(prompts, settings.stream))
    methods = [GREEDY, HF_PLD] + ([GREEDY_FP32] if fp32 else []) + (["default (hybrid, budget auto)"] if settings.default else [])
    text = (f"{len(prompts)} prompts ({turns} turns), {settings.max_new_tokens} new tokens, memory "
            f"{'/'.join(settings.memory)}, methods: {', '.join(methods)}")
    if settings.methods:
        covered = method_prompts(prompts, settings)
        text += (f"; at BC {', '.join(map(str, settings.budgets))}: {', '.join(settings.methods)}"
                 + (f" on {len(covered)} of the prompts" if len(covered) < len(prompts) else ""))
    return text


def cmd_report(args, loaded=None) -> int:
    """Run the report.  ``loaded``: an already loaded ``(model, tokenizer)``, or ``(model, tokenizer,
    reference)`` with the float32 reference of a prepared model (tests, notebooks; see
    :func:`prepare_run`); otherwise ``--model`` is loaded."""
    import sys

    import torch

    from ..optimize import is_optimized
    from .baselines import GREEDY_FP32
    from .harness import run_report
    from .outputs import print_report, write_outputs

    console, progress_console, settings, prompts, model, tokenizer, reference = prepare_run(args, loaded)
    progress_console.print(describe_run(settings, prompts, fp32=reference is not None), highlight=False)
    report = run_report(
        model, tokenizer, settings, prompts, progress=not args.no_progress, console=progress_console,
        reference_model=reference,
    )
    print_report(report, console)
    if batch_sizes(args):
        report.batches = [r.as_dict() for r in run_batches(args, model, tokenizer, settings, prompts, console,
                                                           progress_console, reference)]
    # the float32 baseline's differences are rounding between two models (print_report gave its agreement)
    measured = [r for r in report.records if r["label"] != GREEDY_FP32]
    bad = sum(1 for r in measured if not r["identical_to_greedy"])
    if bad:
        stock_reduced = not is_optimized(model) and model.dtype != torch.float32  # a prepared model is exact
        console.print(f"[red]{bad} of {len(measured)} outputs differ from model.generate greedy[/red]"
                      + (" (expected to happen now and then in reduced precision)" if stock_reduced else ""))
    if args.out and args.out != "-":
        written = write_outputs(report, args.out, plots=not args.no_plots)
        console.print(f"wrote {', '.join(str(p) for p in written)}", highlight=False)
    console.print(f"measured in {report.total_seconds:.0f} s (model load excluded)", highlight=False)
    sys.stdout.flush()
    return 0


# ---------------------------------------------------------------------------- bench
def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    b = subparsers.add_parser(
        "bench",
        help="wall-clock speedup with its spread over repetitions, the cost-curve bound, the overhead "
        "outside the forward pass and (optionally) peak memory",
        description="Runs the report's prompt-major loop --repeats times and reports per task and overall the "
        "median, min and max speedup over model.generate greedy (ratios within one repetition), the share of "
        "each probe step spent outside the model's forward pass, and the speedup bound of the method's passes "
        "on this machine's measured cost curve. Each probe method has one decoder for the whole prompt stream "
        "(warm drafting memory, as a long-running process) unless --cold; --memory warm,cold measures both in "
        "the same run; --stream chooses the prompt stream.",
    )
    add_run_arguments(b, budget="auto,30", limit=4, tokens=128, drafters="esp")
    b.add_argument("--stream", default="specbench", choices=STREAMS,
                   help="the prompt stream: specbench (the Spec-Bench prompts in order, default), repeat (every "
                   "prompt asked twice in a row), conversation (one conversation per task: the task's prompts as "
                   "successive user turns, the model's greedy answers as assistant turns)")
    b.add_argument("--memory", default=None, metavar="warm,cold",
                   help="drafting memory of the probe methods: warm (one decoder per method for the whole stream, "
                   "default), cold (an empty memory for every prompt) or warm,cold (each method both ways, same run)")
    b.add_argument("--cold", action="store_true", help="the same as --memory cold")
    b.add_argument("--repeats", type=int, default=3, help="repetitions of the whole run (default 3)")
    b.add_argument("--memory-tokens", type=int, default=0,
                   help="also measure peak memory of one generation of this many tokens, model.generate against "
                   "each method with budget auto, each in a fresh process (default 0: skip)")
    b.add_argument("--mkl-cache", action="store_true",
                   help="measure memory with MKL's buffer cache on, its default (by default the measured processes "
                   "run with MKL_DISABLE_FAST_MM=1 unless it is set: the cache keeps up to ~200 MB after one large "
                   "output-layer product)")
    b.set_defaults(func=cmd_bench)
    return b


def cmd_bench(args, loaded=None) -> int:
    import json
    import sys
    from pathlib import Path

    import torch

    from ..decoder import ProbeDecoder
    from .bench import markdown_speed_table, rich_speed_table, speed_rows
    from .harness import run_report

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.memory_tokens < 0:
        raise ValueError(f"--memory-tokens must be >= 0, got {args.memory_tokens}")
    if args.memory_tokens and str(args.device).partition(":")[0] != "cpu":
        raise ValueError(f"--memory-tokens measures the resident memory of CPU processes; it cannot measure a model on "
                         f"--device {args.device} (leave it out, or use --device cpu)")
    if args.drafter is None:
        args.drafter = ("esp",)
    console, progress_console, settings, prompts, model, tokenizer, reference = prepare_run(args, loaded, default=False)
    if batch_sizes(args):
        return bench_batches(args, model, tokenizer, settings, prompts, console, progress_console, reference)
    probe = ProbeDecoder(model, tokenizer)
    curve = probe.cost_curve(probe.config)
    models = {"model": model, "fp32": reference} if reference is not None else {"model": model}
    curves = {"model": curve}
    if reference is not None:
        fp32_probe = ProbeDecoder(reference, tokenizer)
        curves["fp32"] = fp32_probe.cost_curve(fp32_probe.config)
    figures = model_figures(models, curves)
    for line in figures_lines(figures):
        console.print(line, highlight=False)
    reports = []
    for rep in range(args.repeats):
        progress_console.print(f"repetition {rep + 1} of {args.repeats}", highlight=False)
        reports.append(run_report(model, tokenizer, settings, prompts, progress=not args.no_progress,
                                  console=progress_console, reference_model=reference))
    rows = speed_rows(reports, curve)
    title = (f"probe-mtp bench: {settings.model} ({reports[0].dtype_label}) on {reports[0].device_label}, "
             f"{len(prompts)} prompts, stream "
             f"{settings.stream}, {settings.max_new_tokens} tokens, {args.repeats} repetitions, "
             f"{torch.get_num_threads()} threads, memory {'/'.join(settings.memory)}")
    console.print(rich_speed_table(rows, title))
    from .outputs import memory_lines

    for line in memory_lines(reports[-1].memories):
        console.print(line, highlight=False)
    peak = peak_memory()
    console.print(peak_memory_line(peak, models), highlight=False)
    memory = []
    if args.memory_tokens:
        from .memory import MKL_CACHE_SWITCH, compare_memory

        with progress_console.status(f"peak memory of {args.memory_tokens}-token generations..."):
            memory = compare_memory(settings.model, list(settings.methods), args.memory_tokens, args.threads,
                                    mkl_cache=args.mkl_cache, dtype=settings.dtype)
        for m in memory:
            console.print(
                f"memory {m['method']:>10} ({m.get('kernels')}): before {m['rss_before_mb']:.0f} MB, peak {m['peak_mb']:.0f} MB "
                f"(+{m['peak_growth_mb']:.0f} MB), growth over the second half {m['second_half_growth_mb']:.1f} MB, "
                f"steady growth {m['steady_growth_mb']:.1f} MB (floor {m['floor_growth_mb']:.1f} MB), {MKL_CACHE_SWITCH}={m.get(MKL_CACHE_SWITCH)}",
                highlight=False,
            )
    if args.out and args.out != "-":
        from .outputs import memory_sentence

        out = Path(args.out)
        payload = {
            "settings": settings.as_dict(),
            "environment": reports[0].environment,
            "repeats": args.repeats,
            "cost_curve": curve.as_dict(),
            "models": figures,
            "peak_rss_mb": peak,
            "rows": [r.as_dict() for r in rows],
            "memory": memory,
            "reports": [r.as_dict() for r in reports],
        }
        write_files(out, {
            "bench.json": json.dumps(payload, indent=1),
            "bench.md": f"# {title}\n\n" + "".join(f"{line}\n\n" for line in figures_lines(figures))
            + f"Memory: {memory_sentence(settings.memory)}.\n\n"
            + markdown_speed_table(rows)
            + "".join(f"\n{line}\n" for line in memory_lines(reports[-1].memories))
            + f"\n{peak_memory_line(peak, models)}\n",
        })
        console.print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}", highlight=False)
    sys.stdout.flush()
    return 0


def bench_batches(args, model, tokenizer, settings, prompts, console, progress_console, reference=None) -> int:
    """``probe-mtp bench --batch SIZES``: the batch table alone (bench.json, bench.md); with the
    float32 ``reference`` of a prepared model, the speedup over its ``generate`` too."""
    import json
    import sys
    from pathlib import Path

    from .batches import batch_sentence, markdown_batch_table
    from .harness import device_label, environment

    rows = run_batches(args, model, tokenizer, settings, prompts, console, progress_console, reference)
    models = {"model": model, "fp32": reference} if reference is not None else {"model": model}
    peak = peak_memory()
    console.print(peak_memory_line(peak, models), highlight=False)
    if args.out and args.out != "-":
        out = Path(args.out)
        env = environment(model, reference)
        payload = {"settings": settings.as_dict(), "environment": env, "models": model_figures(models),
                   "peak_rss_mb": peak, "batches": [r.as_dict() for r in rows]}
        write_files(out, {
            "bench.json": json.dumps(payload, indent=1),
            "bench.md": f"# probe-mtp bench --batch: {settings.model} ({env['dtype']}) on {device_label(env)}, "
            f"{len(prompts)} prompts, "
            f"{settings.max_new_tokens} new tokens, {env['processor']}, {env['torch_threads']} threads\n\n"
            f"kernels: {env['kernels']}\n\n"
            + markdown_batch_table(rows) + "\n" + batch_sentence(rows) + "\n\n" + peak_memory_line(peak, models) + "\n",
        })
        console.print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}", highlight=False)
    sys.stdout.flush()
    return 0


RELATIVE_AT = 16
"""The bench reports each model's c(16) / c(1): what a 16-input pass costs against a one-token pass."""


def model_figures(models: dict, curves: dict | None = None) -> dict:
    """``{"model": ..., "fp32": ...}`` (the run's model and the float32 reference of a prepared one)
    -> per model: its dtype and kernels, its weight bytes and, with ``curves``, its cost curve and
    c(16) / c(1)."""
    from ..optimize import describe, weight_bytes
    from .harness import resolved_dtype

    out = {}
    for key, m in models.items():
        out[key] = {"dtype": resolved_dtype(m), "kernels": describe(m), "weight_bytes": weight_bytes(m)}
        curve = (curves or {}).get(key)
        if curve is not None:
            out[key].update(cost_curve=curve.as_dict(), cost_curve_text=str(curve),
                            relative_cost_16=float(curve.relative(RELATIVE_AT)))
    return out


def figures_lines(figures: dict) -> list[str]:
    """One line per model of :func:`model_figures`: dtype, weights, c(16)/c(1), its cost curve."""
    lines = []
    for f in figures.values():
        line = f"{f['dtype']} ({f['kernels']}): weights {f['weight_bytes'] / 2**20:.1f} MB"
        if "cost_curve_text" in f:
            line += f", c({RELATIVE_AT})/c(1) = {f['relative_cost_16']:.2f}; cost curve: {f['cost_curve_text']}"
        lines.append(line)
    return lines


def peak_memory() -> float:
    """The process's peak resident memory so far, in MB (``ru_maxrss``: kB on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def peak_memory_line(peak_mb: float, models: dict) -> str:
    """The bench's "peak memory" line: the process's peak RSS and which models it held."""
    held = " and ".join("the float32 reference" if key == "fp32" else "the run's model" for key in models)
    return f"peak memory: {peak_mb:.0f} MB (this process's peak resident memory, {held} loaded)"


def write_files(out, texts: dict[str, str]) -> None:
    """Write ``{name: text}`` into ``out`` through a temporary folder beside it (nothing is written
    to ``out`` unless every file was)."""
    import shutil
    import tempfile
    from pathlib import Path

    out = Path(out)
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        for name, text in texts.items():
            (staging / name).write_text(text, encoding="utf-8")
        out.mkdir(parents=True, exist_ok=True)
        for name in texts:
            (staging / name).replace(out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
