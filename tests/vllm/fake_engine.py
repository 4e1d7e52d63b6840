"""A stand-in for vLLM's model runner around a proposer: it keeps requests in batch rows, verifies
the drafts greedily against a deterministic "model" (a function of the context) and calls
``propose`` the way vLLM 0.32's runner does (committed tokens per row, token counts, the token
buffer).  Used by the proposer's tests, which need no engine."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np


def vllm_config(k: int = 8, max_model_len: int = 512, max_num_seqs: int = 8, **options):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        additional_config={"probe_mtp": options} if options else {},
    )


STEP_COST = 0.03  # a verified draft token's share of a step's time (vLLM's CPU backend, SmolLM2)


class FakeRunner:
    """``proposer.clock`` is set to the runner's simulated time (each step costs one unit plus
    ``STEP_COST`` per verified token), so the proposer's step-cost cut, and every count a test
    asserts, is the same on every run."""

    def __init__(self, proposer, model, max_model_len: int = 512, rows: int = 8, adversary: bool = False):
        self.proposer = proposer
        proposer.clock = lambda: self.passes + STEP_COST * self.positions
        self.model = model  # context (list of ints) -> next token
        self.adversary = adversary  # the model never takes the first draft token (another one of the model's)
        self.buffer = np.zeros((rows, max_model_len), dtype=np.int32)
        self.requests: list[dict] = []  # per row: tokens, draft, remaining
        self.passes = 0
        self.positions = 0  # verified positions (1 + drafts) summed over rows and steps

    def add(self, prompt, new_tokens: int) -> dict:
        request = {"tokens": list(prompt), "draft": [], "left": new_tokens, "prompt": len(prompt)}
        self.requests.append(request)
        return request

    def step(self, order=None) -> None:
        """One engine step: every request commits its verified tokens, then the proposer drafts."""
        if order is not None:
            self.requests = [self.requests[i] for i in order]
        self.requests = [r for r in self.requests if r["left"] > 0]
        sampled = []
        for r in self.requests:
            draft = r["draft"]
            self.positions += 1 + len(draft)
            if self.adversary and draft:
                nxt = self.model(r["tokens"])
                committed = [nxt if nxt != draft[0] else self.model(r["tokens"] + [nxt])]
                assert committed[0] != draft[0]
            else:
                committed = []
                for token in draft + [None]:
                    nxt = self.model(r["tokens"] + committed)
                    committed.append(nxt)
                    if nxt != token or len(committed) >= r["left"]:
                        break
            r["tokens"] += committed
            r["left"] -= len(committed)
            sampled.append(committed)
        self.passes += 1
        counts = np.zeros(len(self.buffer), dtype=np.int32)
        for i, r in enumerate(self.requests):
            self.buffer[i, : len(r["tokens"])] = r["tokens"]
            counts[i] = len(r["tokens"])
        drafts = self.proposer.propose(sampled, counts, self.buffer, slot_mappings=None)
        assert len(drafts) == len(self.requests)
        for r, d in zip(self.requests, drafts):
            assert isinstance(d, list) and all(isinstance(t, int) for t in d)
            r["draft"] = d

    def run(self) -> None:
        while any(r["left"] > 0 for r in self.requests):
            self.step()
        self.step()  # the batch without them: the proposer sees them finish
