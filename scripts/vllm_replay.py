"""Replay vLLM's speculative proposers offline against recorded greedy outputs: tau, draft tokens
per step and the proposer's own time, for probe-mtp's proposer, vLLM's ``ngram`` and (where
arctic-inference is installed) ``suffix``, without starting an engine.

    .venv-vllm/bin/python scripts/vllm_replay.py --limit 2 --max-new-tokens 128 \
        --cost /tmp/step-cost.json --proposer '{"min_probability": 0.2}'

Greedy decoding is deterministic, so a request's output does not depend on the drafts: each step
commits the draft up to its first token that differs from the recorded output, then the model's own
token, as vLLM's verification does.  Requests run one at a time in the bench's order (the warm-up
request first), so cross-request memories see what they see in ``probe-mtp bench --engine vllm``.
The outputs come from ``model.generate`` (float32), identical to plain vLLM's on these prompts
(``scripts/vllm_identity.py``); they are kept in ``--streams`` to be reused.

With ``--cost`` (the JSON written by ``scripts/vllm_step_cost.py``: seconds per engine step by the
number of draft tokens it verifies) the replay also predicts each method's speed over plain vLLM:
``tokens * c(0) / (sum over steps of c(drafts) + the proposer's time)``."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def greedy_streams(model_name: str, limit: int, max_new_tokens: int, path: Path | None) -> dict:
    """The bench's prompts (warm-up first) as token ids, with their greedy outputs."""
    key = {"model": model_name, "limit": limit, "max_new_tokens": max_new_tokens}
    if path is not None and path.exists():
        found = json.loads(path.read_text())
        if found.get("key") == key:
            return found
    import torch

    import probe_mtp
    from probe_mtp.prompts import balanced_subset, chat_input_ids, load_prompts
    from probe_mtp.vllm.bench import WARMUP_PROMPT

    model, tokenizer = probe_mtp.load_model(model_name, dtype=torch.float32)
    selected = balanced_subset(load_prompts(), limit)
    texts = [WARMUP_PROMPT] + [p.turns[0] for p in selected]
    news = [16] + [max_new_tokens] * len(selected)
    prompts, outputs = [], []
    for text, new in zip(texts, news):
        ids = chat_input_ids(tokenizer, [{"role": "user", "content": text}])
        out = model.generate(ids, do_sample=False, max_new_tokens=new)
        prompts.append(ids[0].tolist())
        outputs.append(out[0, ids.shape[1]:].tolist())
    found = {"key": key, "tasks": ["warmup"] + [p.task for p in selected], "prompts": prompts, "outputs": outputs}
    if path is not None:
        path.write_text(json.dumps(found))
    return found


class ProbeMtp:
    """probe-mtp's proposer, called as vLLM's runner calls it (one row: one request at a time).  With
    step costs its clock is simulated: each step advances it by the cost of the drafts it verified."""

    def __init__(self, k: int, options: dict, cost: dict[int, float] | None = None):
        from types import SimpleNamespace

        from probe_mtp.vllm.proposer import Proposer

        config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                                 model_config=SimpleNamespace(max_model_len=8192),
                                 additional_config={"probe_mtp": options} if options else {})
        self.proposer = Proposer(config)
        self.buffer = np.zeros((1, 8192), dtype=np.int32)
        self.cost, self.now, self.last = cost, 0.0, []
        if cost:
            self.proposer.clock = lambda: self.now

    def start(self, prompt):
        self.last = []

    def propose(self, tokens: list[int], committed: list[int]) -> list[int]:
        if self.cost:
            self.now += self.cost[min(len(self.last), max(self.cost))]
        self.buffer[0, : len(tokens)] = tokens
        self.last = self.proposer.propose([committed], np.asarray([len(tokens)]), self.buffer)[0]
        return self.last

    def stop(self):
        pass


class Ngram:
    """vLLM's ``ngram`` method (its own matching function), n 1-4 as the bench runs it."""

    def __init__(self, k: int, options: dict, cost=None):
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

        self.find = _find_longest_matched_ngram_and_propose_tokens
        self.k = k

    def start(self, prompt):
        pass

    def propose(self, tokens, committed):
        return [int(t) for t in self.find(np.asarray(tokens, dtype=np.int32), 1, 4, 8192, self.k)]

    def stop(self):
        pass


class Suffix:
    """vLLM's ``suffix`` method (arctic-inference's cache, vLLM's defaults)."""

    def __init__(self, k: int, options: dict, cost=None):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=10000)
        self.k = k
        self.request = 0

    def start(self, prompt):
        self.request += 1
        self.cache.start_request(self.request, np.asarray(prompt, dtype=np.int32))

    def propose(self, tokens, committed):
        self.cache.add_active_response(self.request, committed)
        pattern = np.asarray(tokens[-24:], dtype=np.int32)
        draft = self.cache.speculate(self.request, pattern, max_spec_tokens=self.k, max_spec_factor=1.0,
                                     min_token_prob=0.1)
        return list(draft.token_ids)

    def stop(self):
        self.cache.stop_request(self.request)


def replay(method, streams: dict, skip_warmup_stats: bool = True) -> dict:
    """Run every request through ``method``; figures over the non-warm-up requests."""
    tokens_total = accepted_total = 0
    drafts_per_step: list[int] = []
    propose_seconds = 0.0
    per_task: dict[str, list[int]] = {}
    for index, (prompt, output) in enumerate(zip(streams["prompts"], streams["outputs"])):
        counted = index > 0 or not skip_warmup_stats
        context = list(prompt) + output[:1]  # the prefill step commits the first token
        committed = output[:1]
        method.start(prompt)
        done = 1
        while True:
            start = time.perf_counter()
            draft = method.propose(context, committed)
            if counted:
                propose_seconds += time.perf_counter() - start
            if done >= len(output):
                break
            committed = []
            for token in draft + [None]:
                nxt = output[done]
                committed.append(nxt)
                done += 1
                if nxt != token or done >= len(output):
                    break
            accepted = len(committed) - 1
            context += committed
            if counted:
                drafts_per_step.append(len(draft))
                accepted_total += accepted
                tokens_total += len(committed)
                task = per_task.setdefault(streams["tasks"][index], [0, 0])
                task[0] += len(committed)
                task[1] += accepted
        method.stop()
    steps = tokens_total - accepted_total
    return {"tokens": tokens_total, "steps": steps, "tau": tokens_total / steps, "drafts": drafts_per_step,
            "propose_seconds": propose_seconds,
            "tau_per_task": {t: round(n / (n - a), 3) for t, (n, a) in per_task.items()}}


def predicted_speedup(figures: dict, cost: dict[int, float]) -> float:
    """Plain decoding's time for the tokens over the replayed steps' (each step costs c(its drafts))."""
    most = max(cost)
    steps = sum(cost[min(n, most)] for n in figures["drafts"])
    return figures["tokens"] * cost[0] / (steps + figures["propose_seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--streams", default="/tmp/vllm-replay-streams.json")
    parser.add_argument("--cost", default=None, help="step costs by draft count (scripts/vllm_step_cost.py)")
    parser.add_argument("--methods", default="vllm-ngram,vllm-suffix,probe-mtp")
    parser.add_argument("--proposer", default=None, help="probe-mtp proposer options (JSON); several: a JSON list")
    args = parser.parse_args()

    streams = greedy_streams(args.model, args.limit, args.max_new_tokens, Path(args.streams))
    cost = None
    if args.cost:
        cost = {int(n): float(s) for n, s in json.loads(Path(args.cost).read_text())["seconds"].items()}
    options = json.loads(args.proposer) if args.proposer else {}
    variants = options if isinstance(options, list) else [options]
    kinds = {"vllm-ngram": Ngram, "vllm-suffix": Suffix, "probe-mtp": ProbeMtp}
    for name in args.methods.split(","):
        for option in (variants if name == "probe-mtp" else [{}]):
            try:
                method = kinds[name](args.k, option, cost)
            except ImportError as exc:
                print(f"{name}: not available ({exc})")
                continue
            figures = replay(method, streams)
            drafts = np.asarray(figures["drafts"])
            line = (f"{name:12s} {json.dumps(option) if option else '':40s} tau {figures['tau']:.3f}  "
                    f"drafts/step {drafts.mean():.2f}  steps {figures['steps']}  "
                    f"propose {1e3 * figures['propose_seconds'] / len(drafts):.2f} ms/step")
            if cost:
                line += f"  predicted {predicted_speedup(figures, cost):.3f}x"
            print(line)
            print(" " * 14 + "tau per task: " + ", ".join(f"{t} {v}" for t, v in figures["tau_per_task"].items()))


if __name__ == "__main__":
    main()
