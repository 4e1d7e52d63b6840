"""Mean accepted length (tau) of drafters on bundled Spec-Bench prompts, per task and overall.

tau does not depend on timing, so this runs on one thread.  Greedy references from
``model.generate(do_sample=False)`` are cached in a JSON file (``--refs``) and every output is
checked against them.

    python scripts/measure_tau.py --methods hybrid,esp,pld --budgets 32,30 --per-task 6 --out tau.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import probe_mtp
from probe_mtp.decoder import ProbeDecoder
from probe_mtp.drafters import HybridDrafter
from probe_mtp.prompts import TASKS, balanced_subset, chat_input_ids, load_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", help="embedded model name")
    ap.add_argument("--methods", default="hybrid,esp,pld,lookahead,stand")
    ap.add_argument("--budgets", default="32")
    ap.add_argument("--per-task", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-masks", type=int, default=1)
    ap.add_argument("--refs", default="tau_refs.json")
    ap.add_argument("--out", default=None)
    ap.add_argument("--knobs", default="{}", help="JSON dict of extra generate() knobs for every method")
    ap.add_argument("--hybrid-kw", default=None, help="JSON dict of HybridDrafter arguments (method hybrid)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = probe_mtp.load_model(args.model)
    prompts = balanced_subset(load_prompts(), args.per_task)
    ids = [chat_input_ids(tok, [{"role": "user", "content": p.turns[0]}]) for p in prompts]
    refs_path = Path(args.refs)
    refs = json.loads(refs_path.read_text()) if refs_path.exists() else {}
    prefix = "" if args.model == "smollm2-135m" else f"{args.model}:"  # refs files from before --model stay valid
    key = lambda p: f"{prefix}{p.question_id}:{args.max_new_tokens}"  # noqa: E731
    for p, x in zip(prompts, ids):
        if key(p) not in refs:
            refs[key(p)] = model.generate(x, do_sample=False, max_new_tokens=args.max_new_tokens)[0].tolist()
            refs_path.write_text(json.dumps(refs))
    decoder = ProbeDecoder(model, tok)
    knobs = json.loads(args.knobs)
    results = {}
    for method in args.methods.split(","):
        for budget in [int(b) for b in args.budgets.split(",")]:
            label = f"{method}@{budget}"
            per_task: dict[str, list[int]] = {}
            per_prompt: dict[int, list[int]] = {}
            t0 = time.perf_counter()
            mismatches = 0
            for p, x in zip(prompts, ids):
                chosen = dict(drafter=method, budget=budget, num_masks=args.num_masks)
                if method == "hybrid" and args.hybrid_kw:  # a drafter instance carries its own budget and k
                    chosen = dict(drafter=HybridDrafter(budget, args.num_masks, **json.loads(args.hybrid_kw)))
                out = decoder.generate(x, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
                                       **chosen, **knobs)
                if out.sequences[0].tolist() != refs[key(p)]:
                    mismatches += 1
                per_task.setdefault(p.task, []).extend(out.stats.accepted_lengths)
                per_prompt[p.question_id] = list(out.stats.accepted_lengths)
            tau = {t: sum(v) / len(v) for t, v in per_task.items()}
            allv = [a for v in per_task.values() for a in v]
            tau["overall"] = sum(allv) / len(allv)
            results[label] = {"tau": tau, "mismatches": mismatches, "seconds": time.perf_counter() - t0,
                              "accepted_lengths": per_prompt}
            row = " ".join(f"{t[:6]}={tau[t]:.3f}" for t in list(TASKS) + ["overall"] if t in tau)
            print(f"{label:16s} {row} mismatches={mismatches} ({time.perf_counter() - t0:.0f}s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
