"""Shared fixtures: each embedded model is loaded once per test session."""

from __future__ import annotations

import pytest
import torch

import probe_mtp
from probe_mtp.prompts import balanced_subset, chat_input_ids, load_prompts

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32, sdpa."""
    return probe_mtp.load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3():
    """(model, tokenizer) of the embedded Gemma 3 270M, fp32, sdpa (about a minute to load)."""
    return probe_mtp.load_model("gemma3-270m")


@pytest.fixture(scope="session")
def specbench():
    return load_prompts()


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    return chat_input_ids(tokenizer, [{"role": "user", "content": text}])


def task_prompts(prompts, per_task: int):
    """A balanced subset: ``per_task`` prompts from every Spec-Bench task."""
    return balanced_subset(prompts, per_task)


SMOL_NEW_TOKENS = 48
# plain-text prompts for Gemma 3 (a base model): a copying prompt, code, open prose
GEMMA_TEXTS = (
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "The history of the Roman Empire begins with",
)


class GreedyReferences:
    """``model.generate`` greedy outputs (``SMOL_NEW_TOKENS`` new tokens) of one Spec-Bench prompt
    per task, computed once per prompt and shared by every drafter's lossless test."""

    def __init__(self, model, tokenizer, prompts):
        self.model = model
        self.ids = [chat_ids(tokenizer, p.turns[0]) for p in prompts]
        self.tasks = [p.task for p in prompts]
        self._out: dict[int, torch.Tensor] = {}

    def __call__(self, i: int) -> torch.Tensor:
        if i not in self._out:
            self._out[i] = self.model.generate(self.ids[i], do_sample=False, max_new_tokens=SMOL_NEW_TOKENS)
        return self._out[i]


@pytest.fixture(scope="session")
def smol_refs(smollm2, specbench):
    """Greedy references of one prompt of each of the six Spec-Bench tasks on SmolLM2."""
    model, tokenizer = smollm2
    prompts = task_prompts(specbench, 1)
    assert len({p.task for p in prompts}) >= 6
    return GreedyReferences(model, tokenizer, prompts)
