"""The ``probe-mtp`` command line tool."""

from __future__ import annotations

import argparse
import sys

import torch

from .distill.cli import add_tune_parser
from .options import add_config_arguments, add_model_arguments, config_from_args
from .report.cli import add_bench_parser, add_device_argument, add_report_parser, cmd_bench

def cmd_generate(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .decoder import ProbeDecoder
    from .loading import load_model, resolve_device
    from .prompts import chat_input_ids

    console = Console()
    if not args.prompt.strip():
        console.print("[red]error:[/red] the prompt is empty")
        return 2
    from .optimize import describe
    from .report.timing import wall_seconds

    device = resolve_device(args.device)  # a device this machine lacks: an error before anything is loaded
    with console.status(f"loading model on {device}..."):
        model, tokenizer = load_model(args.model, dtype=args.dtype, device=device)
    console.print(f"[dim]{describe(model)}[/dim]", highlight=False)
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": args.prompt}]).to(model.device)
    decoder = ProbeDecoder(model, tokenizer, **config_from_args(args))
    decoder.generate(ids, max_new_tokens=4)  # warm-up, untimed
    out = decoder.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
    text = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    console.print(text, markup=False, highlight=False)
    ref, ref_seconds = wall_seconds(model.device, model.generate, ids, do_sample=False,
                                    max_new_tokens=args.max_new_tokens)
    stats = out.stats
    table = Table(title="probe-mtp vs model.generate (greedy, same prompt, same run)")
    for col in ("method", "new tokens", "forward passes", "tau", "tokens/s", "identical"):
        table.add_column(col, justify="right")
    ref_new = ref.shape[1] - ids.shape[1]
    table.add_row("model.generate", str(ref_new), str(ref_new), "1.00", f"{ref_new / ref_seconds:.1f}", "-")
    config = decoder.config
    table.add_row(
        f"probe-mtp {config.drafter} (k={config.num_masks}, BC={config.budget})",
        str(stats.new_tokens),
        str(stats.forward_passes),
        f"{stats.mean_accepted_length:.2f}",
        f"{stats.tokens_per_second:.1f}",
        "yes" if torch.equal(ref, out.sequences) else "NO",
    )
    console.print(table)
    return 0


def cmd_bench_on_engine(args) -> int:
    if args.engine == "vllm":
        from .vllm.bench import cmd_vllm_bench

        return cmd_vllm_bench(args)
    return cmd_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="probe-mtp", description="Training-free, lossless multi-token decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="answer one prompt and compare with model.generate")
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=128)
    add_model_arguments(g)
    add_device_argument(g)
    add_config_arguments(g)
    g.set_defaults(func=cmd_generate)
    add_report_parser(sub)
    bench = add_bench_parser(sub)
    bench.add_argument("--engine", choices=("probe-mtp", "vllm"), default="probe-mtp",
                       help="vllm: plain vLLM, its ngram and suffix methods and probe-mtp's proposer inside vLLM, "
                       "one request at a time and --concurrency at once (run in .venv-vllm: make vllm)")
    bench.add_argument("--vllm-methods", default=None, help="--engine vllm: comma list of vllm, vllm-ngram, "
                       "vllm-suffix, probe-mtp (default: all)")
    bench.add_argument("--concurrency", type=int, default=8, help="--engine vllm: requests at once (default 8)")
    bench.add_argument("--speculative-tokens", type=int, default=8,
                       help="--engine vllm: draft tokens per step at most, every method (default 8)")
    bench.add_argument("--vllm-proposer", default=None, metavar="JSON",
                       help='--engine vllm: the probe-mtp proposer\'s options, e.g. \'{"min_probability": 0.2}\'')
    bench.set_defaults(func=cmd_bench_on_engine)
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
