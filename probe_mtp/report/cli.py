"""The ``probe-mtp report`` subcommand."""

from __future__ import annotations

import argparse

from ..config import ProbeConfig
from ..loading import DEFAULT_MODEL
from ..options import add_config_arguments, add_model_arguments, config_from_args

DEFAULT_OUT = "report-out"


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    r = subparsers.add_parser(
        "report",
        help="tau, tokens/s, speedup and losslessness of every method on Spec-Bench, against model.generate "
        "and transformers' prompt lookup measured in the same run",
        description="Runs a prompt set through the chosen probe-mtp methods and the two transformers baselines "
        "(model.generate greedy, and prompt lookup with prompt_lookup_num_tokens=10), prompt by prompt, and "
        "reports per Spec-Bench task and overall: mean accepted length tau, tokens/s, speedups, and whether "
        "each output is identical to model.generate's.",
    )
    add_run_arguments(r, budget="30", limit=2, tokens=64)
    r.set_defaults(func=cmd_report)
    return r


def add_run_arguments(r, budget: str, limit: int, tokens: int, drafters: str = "every drafter") -> None:
    """The options ``report`` and ``bench`` share: the model, the prompts, and every decoder knob of
    :class:`~probe_mtp.config.ProbeConfig` (``--drafter``, ``--budget``, ``--masks`` and
    ``--acceptance`` take comma lists: every value is measured)."""
    add_model_arguments(r)
    add_config_arguments(r, sweep=True, defaults={"budget": budget}, aliases={"drafter": ("--methods",)},
                         notes={"drafter": drafters})
    r.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="prompt file in Spec-Bench format (default: the bundled Spec-Bench questions)")
    r.add_argument("--tasks", default=None,
                   help="comma list of tasks (default: all; Spec-Bench: mt_bench, translation, summarization, qa, "
                   "math_reasoning, rag)")
    r.add_argument("--limit", type=int, default=limit, help=f"prompts per task (default {limit}; 0 = all)")
    r.add_argument("--max-new-tokens", type=int, default=tokens, help=f"new tokens per turn (default {tokens})")
    r.add_argument("--seed", type=int, default=0, help="torch seed and the masks' sampling seed (default 0)")
    r.add_argument("--warmup-tokens", type=int, default=16,
                   help="tokens of the untimed warm-up generation of each method (default 16)")
    r.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    r.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for report.json, records.csv, summary.md and the PNG plots (default {DEFAULT_OUT}/; "
                   "'-' writes nothing)")
    r.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")


SWEPT = ("drafter", "budget", "masks", "acceptance")


def settings_from_args(args):
    """Validated :class:`ReportSettings` (raises ValueError before any model is loaded)."""
    from .harness import PROMPT_MEAN, ReportSettings, parse_budgets, resolve_methods

    tasks = None
    if args.tasks:
        tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip()) or None
    dtype = str(args.dtype).removeprefix("torch.")
    masks = tuple(None if m in (PROMPT_MEAN, "none") else m for m in (args.masks or (PROMPT_MEAN,)))
    knobs = {k: v for k, v in config_from_args(args).items() if k not in SWEPT + ("num_masks", "threshold")}
    return ReportSettings(
        model=args.model or DEFAULT_MODEL,
        dtype=dtype,
        prompts=args.prompts,
        tasks=tasks,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        methods=resolve_methods(args.drafter),
        budgets=parse_budgets(args.budget),
        num_masks=args.num_masks if args.num_masks is not None else ProbeConfig.default("num_masks"),
        seed=args.seed,
        warmup_tokens=args.warmup_tokens,
        masks=tuple(dict.fromkeys(masks)),
        acceptance=tuple(args.acceptance or ("verify",)),
        threshold=args.threshold if args.threshold is not None else ProbeConfig.default("threshold"),
        knobs=knobs,
    )


def prepare_run(args, loaded=None):
    """Shared by ``report`` and ``bench``: consoles, torch threads, validated settings, prompts and
    the model (``loaded``: an already loaded ``(model, tokenizer)``, else ``--model`` is loaded)."""
    import os

    import torch
    from rich.console import Console

    from .harness import select_prompts

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=140)  # piped: rich would assume 80 columns and squeeze the table
    progress_console = Console(stderr=True)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    settings = settings_from_args(args)
    prompts = select_prompts(settings)
    if loaded is None:
        from ..loading import load_model

        with progress_console.status(f"loading {settings.model}..."):
            model, tokenizer = load_model(args.model, dtype=args.dtype)
    else:
        model, tokenizer = loaded
    return console, progress_console, settings, prompts, model, tokenizer


def cmd_report(args, loaded=None) -> int:
    """Run the report.  ``loaded``: an already loaded ``(model, tokenizer)`` (tests, notebooks);
    otherwise ``--model`` is loaded."""
    import sys

    from .harness import run_report
    from .outputs import rich_table, write_outputs

    console, progress_console, settings, prompts, model, tokenizer = prepare_run(args, loaded)
    turns = sum(len(p.turns) for p in prompts)
    progress_console.print(
        f"{len(prompts)} prompts ({turns} turns), {settings.max_new_tokens} new tokens, methods: generate, hf-pld"
        + "".join(f", {m}" for m in settings.methods)
        + (f" at BC {', '.join(map(str, settings.budgets))}" if settings.methods else ""),
        highlight=False,
    )
    report = run_report(
        model, tokenizer, settings, prompts, progress=not args.no_progress, console=progress_console
    )
    console.print(rich_table(report))
    bad = sum(1 for r in report.records if not r["identical_to_greedy"])
    if bad:
        console.print(f"[red]{bad} of {len(report.records)} outputs differ from model.generate greedy[/red]"
                      + (" (expected to happen now and then in reduced precision)" if settings.dtype != "float32" else ""))
    if args.out and args.out != "-":
        written = write_outputs(report, args.out, plots=not args.no_plots)
        console.print(f"wrote {', '.join(str(p) for p in written)}", highlight=False)
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
        "on this machine's measured cost curve.",
    )
    add_run_arguments(b, budget="auto,30", limit=4, tokens=128, drafters="esp")
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
    if args.drafter is None:
        args.drafter = ("esp",)
    console, progress_console, settings, prompts, model, tokenizer = prepare_run(args, loaded)
    probe = ProbeDecoder(model, tokenizer)
    curve = probe.cost_curve(probe.config)
    progress_console.print(f"cost curve: {curve}", highlight=False)
    reports = []
    for rep in range(args.repeats):
        progress_console.print(f"repetition {rep + 1} of {args.repeats}", highlight=False)
        reports.append(run_report(model, tokenizer, settings, prompts, progress=not args.no_progress,
                                  console=progress_console))
    rows = speed_rows(reports, curve)
    title = (f"probe-mtp bench: {settings.model}, {len(prompts)} prompts, {settings.max_new_tokens} tokens, "
             f"{args.repeats} repetitions, {torch.get_num_threads()} threads")
    console.print(rich_speed_table(rows, title))
    memory = []
    if args.memory_tokens:
        from .memory import MKL_CACHE_SWITCH, compare_memory

        with progress_console.status(f"peak memory of {args.memory_tokens}-token generations..."):
            memory = compare_memory(settings.model, list(settings.methods), args.memory_tokens, args.threads,
                                    mkl_cache=args.mkl_cache)
        for m in memory:
            console.print(
                f"memory {m['method']:>10}: before {m['rss_before_mb']:.0f} MB, peak {m['peak_mb']:.0f} MB "
                f"(+{m['peak_growth_mb']:.0f} MB), growth over the second half {m['second_half_growth_mb']:.1f} MB, "
                f"steady growth {m['steady_growth_mb']:.1f} MB (floor {m['floor_growth_mb']:.1f} MB), {MKL_CACHE_SWITCH}={m.get(MKL_CACHE_SWITCH)}",
                highlight=False,
            )
    if args.out and args.out != "-":
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {
            "settings": settings.as_dict(),
            "repeats": args.repeats,
            "cost_curve": curve.as_dict(),
            "rows": [r.as_dict() for r in rows],
            "memory": memory,
            "reports": [r.as_dict() for r in reports],
        }
        (out / "bench.json").write_text(json.dumps(payload, indent=1))
        (out / "bench.md").write_text(f"# {title}\n\n{curve}\n\n" + markdown_speed_table(rows))
        console.print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}", highlight=False)
    sys.stdout.flush()
    return 0
