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
