"""The cost curve of one model three ways, measured in one run: float32, bf16 with the stock kernels,
and bf16 prepared by ``probe_mtp.optimize``: milliseconds of one forward pass over N new inputs (a
causal chain with an explicit 4D mask, logits at every input, as in a verification pass) on top of
a cache of ``--context`` tokens; the fastest of ``--rounds`` rounds that visit the variants and
sizes in rotated order (noise on a shared machine only ever adds time).

    python scripts/cost_curves.py --model gemma3-270m --threads 2 --out curves.md
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import DynamicCache

import probe_mtp
from probe_mtp.kernels import processor

SIZES = (1, 2, 4, 8, 16, 32, 64)


def causal_mask(n: int, context: int) -> torch.Tensor:
    mask = torch.ones(1, 1, n, context + n, dtype=torch.bool)
    mask[0, 0, :, context:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
    return mask


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base, _ = probe_mtp.load_model(args.model)
    variants = {"float32": base, "bf16, stock kernels": copy.deepcopy(base).to(torch.bfloat16)}
    if processor().onednn_bf16:
        variants["bf16, prepared (optimize)"] = probe_mtp.optimize(copy.deepcopy(base), require_matrix_units=False)
    vocab = base.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, args.context + max(SIZES)), generator=gen)
    caches = {}
    for name, model in variants.items():
        caches[name] = DynamicCache(config=model.config)
        model(ids[:, : args.context], cache=caches[name], use_cache=True, logits_to_keep=1)
    best = {(name, n): float("inf") for name in variants for n in SIZES}
    order = [(name, n) for n in SIZES for name in variants]
    for r in range(args.rounds + 1):  # the first round warms up
        for name, n in order[r % len(order):] + order[: r % len(order)]:
            model, cache = variants[name], caches[name]
            inputs = dict(input_ids=ids[:, args.context : args.context + n], attention_mask=causal_mask(n, args.context),
                          position_ids=torch.arange(args.context, args.context + n)[None], cache=cache, use_cache=True)
            t0 = time.perf_counter()
            model(**inputs)
            seconds = time.perf_counter() - t0
            cache.crop(-n)
            if r:
                best[name, n] = min(best[name, n], seconds)
    one = best["float32", 1]
    lines = [f"{args.model}, {processor().describe()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"one pass over N new inputs after a {args.context}-token cache, ms (best of {args.rounds})", "",
             "| model / dtype | " + " | ".join(f"N={n}" for n in SIZES) + " | c(16)/c(1) | c(16) / fp32 c(1) |",
             "| --- |" + " --- |" * (len(SIZES) + 2)]
    for name in variants:
        row = [best[name, n] * 1e3 for n in SIZES]
        lines.append(f"| {name} | " + " | ".join(f"{x:.1f}" for x in row)
                     + f" | {best[name, 16] / best[name, 1]:.2f} | {best[name, 16] / one:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
