"""The cost curve of one model five ways, measured in one run: float32 with the stock kernels, float32
packed for wide passes by ``probe_mtp.pack_wide``, float32 prepared by ``probe_mtp.optimize(model,
torch.float32)``, bf16 with the stock kernels and bf16 prepared by ``probe_mtp.optimize``: milliseconds of one forward pass over N new inputs (a causal
chain with an explicit 4D mask, logits at every input, as in a verification pass) on top of a cache
of ``--context`` tokens; the fastest of ``--rounds`` rounds that visit the variants and sizes in
rotated order (noise on a shared machine only ever adds time).  With ``--generate T`` it also times
``model.generate`` (greedy, T new tokens, fastest of 3) on each variant.

    python scripts/cost_curves.py --model gemma3-270m --threads 2 --generate 64 --out curves.md
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import DynamicCache

import probe_mtp
from probe_mtp import kernels
from probe_mtp.kernels import PackedLinear, processor

SIZES = (1, 2, 4, 8, 16, 32, 64)
STOCK_FP32 = "float32, stock kernels"


def causal_mask(n: int, context: int) -> torch.Tensor:
    """``[1, 1, n, context + n]``: every new input sees the cache and the inputs before it."""
    mask = torch.ones(1, 1, n, context + n, dtype=torch.bool)
    mask[0, 0, :, context:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
    return mask


def bf16_copy(model):
    """A copy of the float32 ``model`` with every parameter cast to bf16, made without a second
    float32 copy (the same weights as a bf16 load)."""
    memo = {id(p): torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False) for p in model.parameters()}
    return copy.deepcopy(model, memo)


def repacked(model, kind: str):
    """A copy of the prepared float32 ``model`` whose linear layers compute as ``kind`` (oneDNN's
    packed float32, to compare with the MKL packing optimize takes where this torch has MKL)."""
    out = copy.deepcopy(model)
    for parent in list(out.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, PackedLinear.from_module(child, child.plans, kind, dtype=torch.float32))
    return out


def variants(base) -> dict:
    """``{name: model}``: the five ways (packed float32 by MKL and by oneDNN, each left out where this
    torch lacks it;
    prepared bf16 with oneDNN's packed products where it runs bf16, else with the stock products
    under checked row plans; left out where optimize refuses), and prepared float32 with oneDNN's
    packing too where optimize packs float32 by MKL."""
    prepared = probe_mtp.optimize(copy.deepcopy(base), torch.float32)
    kind = next(m.kind for m in prepared.modules() if isinstance(m, PackedLinear))
    out = {STOCK_FP32: base}
    for kernel, by in (("mkl", "MKL"), ("onednn", "oneDNN")):
        if probe_mtp.wide.why_not_pack_wide(base, kernel) is None:
            out[f"float32, packed for wide passes (pack_wide, {by})"] = probe_mtp.pack_wide(copy.deepcopy(base), kernel)
    out[f"float32, prepared (optimize: {kind})"] = prepared
    if kind == kernels.MKL and processor().packs(torch.float32):
        out["float32, prepared, oneDNN packing"] = repacked(prepared, kernels.ONEDNN)
    out["bf16, stock kernels"] = bf16_copy(base)
    try:
        out["bf16, prepared (optimize)"] = probe_mtp.optimize(bf16_copy(base), require_matrix_units=False)
    except probe_mtp.OptimizeError as exc:
        print(f"bf16, prepared: refused ({exc})")
    return out


@torch.no_grad()
def pass_times(models: dict, context: int, rounds: int) -> dict:
    """``{(name, n): fastest seconds}`` of one pass over n new inputs after a ``context`` cache."""
    vocab = next(iter(models.values())).get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context + max(SIZES)), generator=gen)
    caches = {}
    for name, model in models.items():
        caches[name] = DynamicCache(config=model.config)
        model(ids[:, :context], cache=caches[name], use_cache=True, logits_to_keep=1)
    best = {(name, n): float("inf") for name in models for n in SIZES}
    order = [(name, n) for n in SIZES for name in models]
    for r in range(rounds + 1):  # the first round warms up
        for name, n in order[r % len(order):] + order[: r % len(order)]:
            model, cache = models[name], caches[name]
            inputs = dict(input_ids=ids[:, context : context + n], attention_mask=causal_mask(n, context),
                          position_ids=torch.arange(context, context + n)[None], cache=cache, use_cache=True)
            t0 = time.perf_counter()
            model(**inputs)
            seconds = time.perf_counter() - t0
            cache.crop(-n)
            if r:
                best[name, n] = min(best[name, n], seconds)
    return best


@torch.no_grad()
def generate_times(models: dict, tokens: int, rounds: int = 3) -> dict:
    """``{name: fastest seconds}`` of ``model.generate`` (greedy, ``tokens`` new tokens, EOS ignored)
    from the same 32-token prompt, rounds in rotated order after a warm-up."""
    vocab = next(iter(models.values())).get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(1))
    names = list(models)
    best = {name: float("inf") for name in names}
    for r in range(rounds + 1):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            models[name].generate(ids, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens)
            if r:
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def table(args, best: dict, names, generated: dict | None) -> str:
    """The markdown table: ms per size, c(16)/c(1), c(16) over stock float32's c(1), and
    ``model.generate`` tokens/s where measured."""
    one = best[STOCK_FP32, 1]
    head = f"{args.model}, {processor().describe()}, torch {torch.__version__}, {torch.get_num_threads()} threads, " \
           f"one pass over N new inputs after a {args.context}-token cache, ms (best of {args.rounds})"
    extra = f" generate tok/s ({args.generate} tokens) |" if generated else ""
    lines = [head, "", "| model / dtype | " + " | ".join(f"N={n}" for n in SIZES) + " | c(16)/c(1) | c(16) / fp32 c(1) |" + extra,
             "| --- |" + " --- |" * (len(SIZES) + 2 + bool(generated))]
    for name in names:
        row = [best[name, n] * 1e3 for n in SIZES]
        cells = " | ".join(f"{x:.1f}" for x in row)
        tail = f" {args.generate / generated[name]:.1f} |" if generated else ""
        lines.append(f"| {name} | {cells} | {best[name, 16] / best[name, 1]:.2f} | {best[name, 16] / one:.2f} |" + tail)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--generate", type=int, default=0, metavar="TOKENS",
                    help="also time model.generate over this many new tokens on each variant")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base, _ = probe_mtp.load_model(args.model)
    models = variants(base)
    best = pass_times(models, args.context, args.rounds)
    generated = generate_times(models, args.generate) if args.generate else None
    text = table(args, best, list(models), generated)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
