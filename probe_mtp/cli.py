"""The ``probe-mtp`` command line tool."""

from __future__ import annotations

import argparse
import sys
import time

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def _dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}") from None


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="smollm2-135m (default), gemma3-270m, a local folder, a .gguf file or a hub id")
    p.add_argument("--dtype", type=_dtype, default=torch.float32, help="float32 (default, exact), bfloat16 or float16")


def add_probe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-masks", type=int, default=1, help="masks per tree node, k (default 1)")
    p.add_argument("--budget", type=_budget, default="auto",
                   help="'auto' (default: sized per step from this machine's cost curve) or a block complexity BC, "
                   "inputs per forward pass")
    p.add_argument("--drafter", default="hybrid", help="hybrid (default), esp, pld, lookahead, stand or ar")


def _budget(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget takes an integer or 'auto', got {text!r}") from None


def cmd_generate(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from . import ProbeDecoder, load_model
    from .prompts import chat_input_ids

    console = Console()
    if not args.prompt.strip():
        console.print("[red]error:[/red] the prompt is empty")
        return 2
    with console.status("loading model..."):
        model, tokenizer = load_model(args.model, dtype=args.dtype)
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    decoder = ProbeDecoder(model, tokenizer, num_masks=args.num_masks, budget=args.budget, drafter=args.drafter)
    decoder.generate(ids, max_new_tokens=4)  # warm-up, untimed
    out = decoder.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
    text = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    console.print(text, markup=False, highlight=False)
    t0 = time.perf_counter()
    ref = model.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens)
    ref_seconds = time.perf_counter() - t0
    stats = out.stats
    table = Table(title="probe-mtp vs model.generate (greedy, same prompt, same run)")
    for col in ("method", "new tokens", "forward passes", "tau", "tokens/s", "identical"):
        table.add_column(col, justify="right")
    ref_new = ref.shape[1] - ids.shape[1]
    table.add_row("model.generate", str(ref_new), str(ref_new), "1.00", f"{ref_new / ref_seconds:.1f}", "-")
    table.add_row(
        f"probe-mtp {args.drafter} (k={args.num_masks}, BC={args.budget})",
        str(stats.new_tokens),
        str(stats.forward_passes),
        f"{stats.mean_accepted_length:.2f}",
        f"{stats.tokens_per_second:.1f}",
        "yes" if torch.equal(ref, out.sequences) else "NO",
    )
    console.print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="probe-mtp", description="Training-free, lossless multi-token decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="answer one prompt and compare with model.generate")
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=128)
    add_model_arguments(g)
    add_probe_arguments(g)
    g.set_defaults(func=cmd_generate)
    from .distill.cli import add_tune_parser
    from .report.cli import add_bench_parser, add_report_parser

    add_report_parser(sub)
    add_bench_parser(sub)
    add_tune_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, RuntimeError, FileNotFoundError) as exc:
        print(f"probe-mtp: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
