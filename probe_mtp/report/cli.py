"""The ``probe-mtp report`` subcommand."""

from __future__ import annotations

import argparse

from ..loading import DEFAULT_MODEL

DEFAULT_OUT = "report-out"


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    from ..cli import add_model_arguments

    r = subparsers.add_parser(
        "report",
        help="tau, tokens/s, speedup and losslessness of every method on Spec-Bench, against model.generate "
        "and transformers' prompt lookup measured in the same run",
        description="Runs a prompt set through the chosen probe-mtp methods and the two transformers baselines "
        "(model.generate greedy, and prompt lookup with prompt_lookup_num_tokens=10), prompt by prompt, and "
        "reports per Spec-Bench task and overall: mean accepted length tau, tokens/s, speedups, and whether "
        "each output is identical to model.generate's.",
    )
    add_model_arguments(r)
    r.add_argument("--num-masks", type=int, default=1, help="masks per tree node, k (default 1)")
    r.add_argument("--budget", default="30",
                   help="block complexity BC (inputs per forward pass), or a comma list for a sweep such as "
                   "10,30,60: every method at every budget (default 30)")
    r.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="prompt file in Spec-Bench format (default: the bundled Spec-Bench questions)")
    r.add_argument("--tasks", default=None,
                   help="comma list of tasks (default: all; Spec-Bench: mt_bench, translation, summarization, qa, "
                   "math_reasoning, rag)")
    r.add_argument("--limit", type=int, default=2, help="prompts per task (default 2; 0 = all)")
    r.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per turn (default 64)")
    r.add_argument("--methods", default=None,
                   help="comma list of probe-mtp drafters (default: every available one); model.generate and "
                   "transformers' prompt lookup are always measured")
    r.add_argument("--masks", action="append", default=None, metavar="PATH",
                   help="mask vectors tuned by `probe-mtp tune-masks` for the mask drafters (esp); repeat to compare "
                   "several, 'prompt_mean' for the untuned default (default: prompt_mean only)")
    r.add_argument("--acceptance", default="verify",
                   help="comma list of acceptance rules for the mask drafters: verify (lossless, default) and/or "
                   "confadapt (LOSSY: also emits unverified confident mask predictions); e.g. verify,confadapt "
                   "measures both side by side")
    r.add_argument("--threshold", type=float, default=0.9, help="ConfAdapt's top-1 probability threshold (default 0.9)")
    r.add_argument("--seed", type=int, default=0, help="torch seed and the masks' sampling seed (default 0)")
    r.add_argument("--warmup-tokens", type=int, default=16,
                   help="tokens of the untimed warm-up generation of each method (default 16)")
    r.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    r.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for report.json, records.csv, summary.md and the PNG plots (default {DEFAULT_OUT}/; "
                   "'-' writes nothing)")
    r.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_report)
    return r


def settings_from_args(args):
    """Validated :class:`ReportSettings` (raises ValueError before any model is loaded)."""
    from .harness import PROMPT_MEAN, ReportSettings, parse_budgets, resolve_methods

    tasks = None
    if args.tasks:
        tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip()) or None
    dtype = str(args.dtype).removeprefix("torch.")
    masks = tuple(None if m in (PROMPT_MEAN, "none") else m for m in (args.masks or [PROMPT_MEAN]))
    acceptance = tuple(dict.fromkeys(a.strip() for a in args.acceptance.split(",") if a.strip()))
    return ReportSettings(
        model=args.model or DEFAULT_MODEL,
        dtype=dtype,
        prompts=args.prompts,
        tasks=tasks,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        methods=resolve_methods(args.methods),
        budgets=parse_budgets(args.budget),
        num_masks=args.num_masks,
        seed=args.seed,
        warmup_tokens=args.warmup_tokens,
        masks=tuple(dict.fromkeys(masks)),
        acceptance=acceptance,
        threshold=args.threshold,
    )


def cmd_report(args, loaded=None) -> int:
    """Run the report.  ``loaded``: an already loaded ``(model, tokenizer)`` (tests, notebooks);
    otherwise ``--model`` is loaded."""
    import os
    import sys

    import torch
    from rich.console import Console

    from .harness import run_report, select_prompts
    from .outputs import rich_table, write_outputs

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=120)  # piped: rich would assume 80 columns and squeeze the table
    progress_console = Console(stderr=True)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    settings = settings_from_args(args)
    prompts = select_prompts(settings)
    if loaded is None:
        from .. import load_model

        with progress_console.status(f"loading {settings.model}..."):
            model, tokenizer = load_model(args.model, dtype=args.dtype)
    else:
        model, tokenizer = loaded
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
