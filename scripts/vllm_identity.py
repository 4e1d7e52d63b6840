"""How often plain vLLM (CPU build, float32) gives the same greedy tokens as ``model.generate`` on the
embedded models: the Spec-Bench prompts' first turns, in .venv-vllm (``make vllm``).

    .venv-vllm/bin/python scripts/vllm_identity.py --model smollm2-135m --prompts 8 --max-new-tokens 128

Prints per prompt whether the two agree and, where they do not, the first position that differs
with the two tokens there; then the count.  The two compute the same float32 model with different
kernels (vLLM: oneDNN-packed linear layers, its own paged attention), so a near-tie between two
tokens can go either way; a model that gave token 0 (as the converted copy did before it stored
its tied embedding under the name vLLM reads) would differ at position 0 of every prompt."""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    import probe_mtp
    from probe_mtp.prompts import balanced_subset, chat_input_ids, load_prompts
    from probe_mtp.vllm.engine import engine
    from vllm import SamplingParams, TokensPrompt

    torch.manual_seed(0)
    model, tokenizer = probe_mtp.load_model(args.model, dtype=torch.float32)
    prompts = balanced_subset(load_prompts(), max(1, -(-args.prompts // 6)))[: args.prompts]
    ids = [chat_input_ids(tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in prompts]
    reference = []
    for x in ids:
        out = model.generate(x, do_sample=False, max_new_tokens=args.max_new_tokens)
        reference.append(out[0, x.shape[1]:].tolist())
    del model
    llm = engine(args.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=x[0].tolist()) for x in ids], params, use_tqdm=False)
    rows = []
    for prompt, ref, out in zip(prompts, reference, outputs):
        got = list(out.outputs[0].token_ids)
        first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        if first is None and len(ref) != len(got):
            first = min(len(ref), len(got))
        rows.append({"question_id": prompt.question_id, "task": prompt.task, "identical": first is None,
                     "first_difference": first, "tokens": len(ref),
                     "there": None if first is None else [ref[first:first + 1], got[first:first + 1]]})
        print(json.dumps(rows[-1]))
    same = sum(r["identical"] for r in rows)
    print(f"{args.model}: vLLM greedy identical to model.generate (float32) on {same}/{len(rows)} prompts, "
          f"{args.max_new_tokens} new tokens")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "identical": same, "prompts": len(rows), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
