"""What one vLLM engine step costs by the number of draft tokens it verifies: a proposer that drafts
n junk tokens (n cycling 0..K, so every width sees the same contexts) times the gap between vLLM's
calls, one request at a time.  Writes the median seconds per width as JSON for
``scripts/vllm_replay.py --cost``.

    .venv-vllm/bin/python scripts/vllm_step_cost.py --out /tmp/step-cost.json

The junk drafts are all rejected, so every step commits one token: the requests decode as plainly as
without drafts (``ignore_eos``, a fixed number of tokens each)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

JUNK = 7  # the draft token (any id: vLLM rejects it where the model's own token differs)


class JunkDrafts:
    """``custom_class`` proposer: n junk tokens per step, n cycling 0..K; records (n, seconds)."""

    def __init__(self, vllm_config):
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.out = os.environ["PROBE_MTP_STEP_COST_OUT"]
        self.calls, self.last, self.records = 0, None, []

    def load_model(self, *args, **kwargs):
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_):
        now = time.perf_counter()
        one_decoding_row = len(sampled_token_ids) == 1 and bool(sampled_token_ids[0])
        if self.last is not None and one_decoding_row:
            self.records.append((self.last[1], now - self.last[0]))
        n = self.calls % (self.k + 1)
        self.calls += 1
        self.last = (now, n) if one_decoding_row else None
        if self.calls % 25 == 0:
            Path(self.out).write_text(json.dumps(self.records))
        return [[JUNK] * n if sampled else [] for sampled in sampled_token_ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per request")
    parser.add_argument("--out", default="vllm-step-cost.json")
    args = parser.parse_args()

    raw = Path(args.out).with_suffix(".steps.json")
    os.environ["PROBE_MTP_STEP_COST_OUT"] = str(raw.resolve())
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, here)

    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    from probe_mtp.prompts import balanced_subset, chat_input_ids, load_prompts
    from probe_mtp.vllm.bench import processor
    from probe_mtp.vllm.engine import engine, model_folder

    tokenizer = AutoTokenizer.from_pretrained(model_folder(args.model))
    prompts = balanced_subset(load_prompts(), max(1, -(-args.prompts // 6)))[: args.prompts]
    ids = [chat_input_ids(tokenizer, [{"role": "user", "content": p.turns[0]}])[0].tolist() for p in prompts]
    llm = engine(args.model, max_num_seqs=1, speculative={"method": "custom_class", "model": "vllm_step_cost.JunkDrafts",
                                                          "num_speculative_tokens": args.k})
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for x in ids:
        llm.generate([TokensPrompt(prompt_token_ids=x)], params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    time.sleep(1)
    by_width: dict[int, list[float]] = {}
    for n, seconds in json.loads(raw.read_text()):
        by_width.setdefault(n, []).append(seconds)
    medians = {n: statistics.median(v) for n, v in sorted(by_width.items())}
    Path(args.out).write_text(json.dumps({"seconds": medians, "samples": {n: len(v) for n, v in by_width.items()},
                                          "model": args.model, "processor": processor()}, indent=1))
    for n, seconds in medians.items():
        print(f"{n} draft tokens: {1e3 * seconds:.2f} ms ({seconds / medians[0]:.3f} of a plain step)")


if __name__ == "__main__":
    main()
