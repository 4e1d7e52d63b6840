"""How often greedy outputs agree, per dtype: probe-mtp against ``model.generate`` on the same model
(float32; bf16 with the stock kernels; bf16 prepared by ``probe_mtp.optimize``), and the prepared
bf16 model's own ``model.generate`` against the float32 one (what bf16 itself changes).

Counts whole outputs that are identical and the share of tokens equal at the same position (the
longer output of each pair counted), over Spec-Bench prompts of every task.

    python scripts/agreement.py --model smollm2-135m --per-task 2 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import copy

import torch

import probe_mtp
from probe_mtp.prompts import balanced_subset, chat_input_ids, load_prompts


def agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(positions holding the same token, positions compared: the longer of the two)."""
    n = min(a.numel(), b.numel())
    return int((a[:n] == b[:n]).sum()), max(a.numel(), b.numel())


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-task", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    fp32, tok = probe_mtp.load_model(args.model)
    models = {
        "float32": fp32,
        "bf16, stock kernels": copy.deepcopy(fp32).to(torch.bfloat16),
        "bf16, prepared": probe_mtp.optimize(copy.deepcopy(fp32), require_matrix_units=False),
    }
    chat = tok.chat_template is not None
    prompts = balanced_subset(load_prompts(), args.per_task)
    counts = {name: [0, 0, 0] for name in models}  # identical outputs, equal tokens, compared tokens
    counts["bf16 prepared generate vs float32 generate"] = [0, 0, 0]
    for prompt in prompts:
        text = prompt.turns[0]
        ids = chat_input_ids(tok, [{"role": "user", "content": text}]) if chat else tok(text, return_tensors="pt").input_ids
        refs = {}
        for name, model in models.items():
            ref = model.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens)[0, ids.shape[1]:]
            out = probe_mtp.generate(model, ids, max_new_tokens=args.max_new_tokens)[0, ids.shape[1]:]
            refs[name] = ref
            same, compared = agreement(out, ref)
            counts[name][0] += int(torch.equal(out, ref))
            counts[name][1] += same
            counts[name][2] += compared
        same, compared = agreement(refs["bf16, prepared"], refs["float32"])
        row = counts["bf16 prepared generate vs float32 generate"]
        row[0] += int(torch.equal(refs["bf16, prepared"], refs["float32"]))
        row[1] += same
        row[2] += compared
        print(f"{prompt.task}: " + ", ".join(f"{name} {c[0]}" for name, c in counts.items()), flush=True)
    print(f"\n{args.model}, {len(prompts)} prompts ({args.per_task} per task), {args.max_new_tokens} new tokens, greedy\n")
    print("| comparison | identical outputs | equal tokens |\n| --- | --- | --- |")
    for name, (identical, same, compared) in counts.items():
        label = name if "vs" in name else f"probe-mtp vs model.generate, {name}"
        print(f"| {label} | {identical}/{len(prompts)} | {same / compared:.3f} |")


if __name__ == "__main__":
    main()
