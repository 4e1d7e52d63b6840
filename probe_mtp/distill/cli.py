"""The ``probe-mtp tune-masks`` subcommand: self-distil the mask vectors of a frozen model."""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

DEFAULT_OUT = "tuned-masks"
MASKS_FILE = "masks.safetensors"
CURVE_CSV = "loss_curve.csv"
CURVE_PNG = "loss_curve.png"
TEACHER_FILE = "teacher.json"
CURVE_FIELDS = ("step", "task", "loss", "top1", "top14", "targets", "seconds")


def add_tune_parser(subparsers) -> argparse.ArgumentParser:
    from ..options import add_model_arguments
    from .train import TrainSettings

    d = TrainSettings()
    t = subparsers.add_parser(
        "tune-masks",
        help="learn the mask vectors by self-distillation on the frozen model (decoding stays lossless)",
        description="Runs the frozen model greedily over training prompts, then trains only the mask vectors "
        "(one shared vector plus one offset per mask slot) so that mask j after a prefix predicts the model's own "
        "greedy token j+1 positions ahead (cross-entropy against the teacher's tokens). Writes masks.safetensors "
        "(use it with generate(..., masks=PATH) or probe-mtp report --masks PATH), loss_curve.csv/.png and the "
        "teacher continuations (teacher.json, reused by a rerun with the same prompts and model).",
    )
    add_model_arguments(t, dtype="float32")
    t.add_argument("--prompts", default=None, metavar="FILE",
                   help="training prompts: a Spec-Bench-format .jsonl file (first turns) or a text file with one prompt "
                   "per line (default: the bundled Spec-Bench tasks translation, summarization, qa)")
    t.add_argument("--tasks", default=None, help="comma list of tasks of a JSONL prompt file (default for the bundled "
                   "file: translation,summarization,qa)")
    t.add_argument("--limit", type=int, default=16, help="prompts per task, or lines of a text file (default 16; 0 = all)")
    t.add_argument("--max-new-tokens", type=int, default=64, help="greedy teacher tokens per prompt (default 64)")
    t.add_argument("--max-context", type=int, default=1024,
                   help="longest prompt + continuation in tokens; longer prompts are skipped (default 1024)")
    t.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps, one teacher sequence each (default {d.steps})")
    t.add_argument("--lr", type=float, default=d.lr, help=f"Adam learning rate, in units of the embeddings' RMS (default {d.lr})")
    t.add_argument("--num-masks", type=int, default=d.num_masks,
                   help=f"mask slots to train, k (default {d.num_masks}); decoding may use any k up to this")
    t.add_argument("--mode", choices=("relative", "absolute"), default=d.mode,
                   help="relative (default): tuned offsets on top of the prompt-mean vector and its EMA update; "
                   "absolute: the vectors themselves, initialised at the training prompts' mean embedding")
    t.add_argument("--no-offsets", action="store_true", help="train only the shared vector, no per-slot offsets")
    t.add_argument("--ema", type=float, default=d.ema,
                   help=f"the EMA rate (mask_update) the relative anchor follows during training (default {d.ema})")
    t.add_argument("--seed", type=int, default=d.seed, help=f"order of the training sequences (default {d.seed})")
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    t.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT}/)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_tune)
    return t


def _settings(args):
    from .train import TrainSettings

    return TrainSettings(
        num_masks=args.num_masks, steps=args.steps, lr=args.lr, mode=args.mode, offsets=not args.no_offsets,
        ema=args.ema, seed=args.seed,
    )


def write_curve_csv(history: list[dict], path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=CURVE_FIELDS, extrasaction="ignore")
        w.writeheader()
        for h in history:
            w.writerow(h)
    return path


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_curve_png(history: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    window = max(1, len(history) // 20)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [h["loss"] for h in history], color="0.8", lw=0.8, label="loss per step (one sequence)")
    ax.plot(steps, smoothed([h["loss"] for h in history], window), color="C0", label=f"loss, mean of {window}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy vs the teacher's tokens")
    hits = ax.twinx()
    hits.plot(steps, smoothed([h["top14"] for h in history], window), color="C1", label=f"top-14 hit rate, mean of {window}")
    hits.set_ylabel("target in the mask's top 14")
    hits.set_ylim(0, 1)
    lines = ax.get_legend_handles_labels()
    more = hits.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def cmd_tune(args, loaded=None) -> int:
    """Run ``tune-masks``.  ``loaded``: an already loaded ``(model, tokenizer)`` (tests, notebooks);
    otherwise ``--model`` is loaded."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from ..loading import load_model
    from ..version import __version__
    from ..loading import DEFAULT_MODEL
    from ..tuned_masks import ModelIdentity
    from .teacher import context_limit, load_teachers, save_teachers, teacher_key, teacher_sequences, training_prompts
    from .train import train_masks

    console = Console(stderr=True)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.dtype == "auto":
        raise ValueError("tuning back-propagates through the frozen model, which a model prepared for bf16 (--dtype "
                         "auto) cannot do; tune in float32 (the default): the tuned vectors serve every dtype")
    for name in ("limit", "max_new_tokens", "max_context"):
        if getattr(args, name) < (0 if name == "limit" else 2):
            raise ValueError(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
    settings = _settings(args)
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip()) if args.tasks else None
    prompts = training_prompts(args.prompts, tasks, args.limit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    if loaded is None:
        with console.status(f"loading {args.model or DEFAULT_MODEL}..."):
            model, tokenizer = load_model(args.model, dtype=args.dtype)
    else:
        model, tokenizer = loaded
    identity = ModelIdentity.of(model)
    max_context = context_limit(model, settings.num_masks, args.max_context)
    key = teacher_key(identity.fingerprint, prompts, args.max_new_tokens, max_context)
    bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=args.no_progress)
    with bar:
        sequences = load_teachers(out / TEACHER_FILE, key)
        t_teacher = time.perf_counter()
        if sequences is None:
            job = bar.add_task("teacher: greedy continuations", total=len(prompts))
            sequences = teacher_sequences(model, tokenizer, prompts, args.max_new_tokens, max_context,
                                          on_sequence=lambda i, s: bar.advance(job))
            save_teachers(out / TEACHER_FILE, key, sequences)
        teacher_seconds = time.perf_counter() - t_teacher
        job = bar.add_task("training", total=settings.steps)
        window: list[float] = []

        def on_step(record: dict) -> None:
            window.append(record["loss"])
            del window[:-20]
            bar.update(job, advance=1, description=f"training (loss {sum(window) / len(window):.3f})")

        extra = {"model": args.model or DEFAULT_MODEL, "dtype": str(args.dtype).removeprefix("torch."),
                 "prompts": args.prompts or "bundled Spec-Bench", "tasks": sorted({p.task for p in prompts}),
                 "training_prompts": len(prompts), "teacher_tokens": args.max_new_tokens, "max_context": max_context,
                 "teacher_seconds": round(teacher_seconds, 1), "torch_threads": torch.get_num_threads(),
                 "probe_mtp_version": __version__}
        tuned, history = train_masks(model, sequences, settings, on_step=on_step, extra_settings=extra)
    path = tuned.save(out / MASKS_FILE)
    write_curve_csv(history, out / CURVE_CSV)
    first = sum(h["loss"] for h in history[:10]) / len(history[:10])
    last = sum(h["loss"] for h in history[-10:]) / len(history[-10:])
    write_curve_png(history, out / CURVE_PNG, f"tune-masks: {extra['model']}, k={settings.num_masks}, {settings.mode}, "
                    f"lr {settings.lr}, {len(sequences)} sequences")
    console.print(
        f"{len(sequences)} teacher sequences ({teacher_seconds:.0f} s), {settings.steps} steps; loss {first:.3f} -> {last:.3f} "
        f"(mean of the first / last 10 steps); {time.perf_counter() - t_start:.0f} s in all",
        highlight=False,
    )
    console.print(f"wrote {path}, {out / CURVE_CSV}, {out / CURVE_PNG}", highlight=False)
    return 0
