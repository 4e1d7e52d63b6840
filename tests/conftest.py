"""Shared fixtures: each embedded model is loaded once per test session, on the test device.

``PROBE_MTP_TEST_DEVICE`` (default ``cpu``; e.g. ``cuda``, ``cuda:1``) names the device the
session's models (``smollm2``, ``gemma3``), the ids of :func:`chat_ids` and the ``test_device``
fixture's tiny models are on.  Where this machine does not have it, the tests that need it skip,
saying why; tests marked ``cpu_only`` (CPU kernels, processor flags, resident memory) skip on any
other device."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import probe_mtp
from probe_mtp.loading import resolve_device
from probe_mtp.optimize import OptimizeError
from probe_mtp.prompts import balanced_subset, chat_input_ids, load_prompts

# at most 2 threads per test process; under pytest-xdist (make test) the cores are shared by the workers
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads() // WORKERS)))

TEST_DEVICE_ENV = "PROBE_MTP_TEST_DEVICE"

# tests/vllm run in .venv-vllm, vLLM's own virtualenv (make test-vllm sets PROBE_MTP_VLLM_TESTS=1);
# the main suite (make test, .venv without vLLM) leaves the folder out
VLLM_TESTS_ENV = "PROBE_MTP_VLLM_TESTS"
collect_ignore = [] if os.environ.get(VLLM_TESTS_ENV) == "1" else ["vllm"]


def device_under_test() -> str:
    """``$PROBE_MTP_TEST_DEVICE`` as given, ``cpu`` when unset or empty."""
    return os.environ.get(TEST_DEVICE_ENV, "").strip() or "cpu"


def on_cpu() -> bool:
    """Whether the session tests on the CPU (``cpu`` or ``cpu:N``)."""
    return device_under_test().partition(":")[0] == "cpu"


@pytest.fixture(scope="session")
def test_device() -> torch.device:
    """The session's test device (``PROBE_MTP_TEST_DEVICE``), checked to exist here; tests that
    take it skip, with the reason, where it does not."""
    try:
        return resolve_device(device_under_test())
    except ValueError as exc:
        pytest.skip(f"{TEST_DEVICE_ENV}={device_under_test()}: {exc}")


@pytest.fixture(scope="session")
def smollm2(test_device):
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32, sdpa, on the test device."""
    return probe_mtp.load_model("smollm2-135m", device=test_device)


@pytest.fixture(scope="session")
def gemma3(test_device):
    """(model, tokenizer) of the embedded Gemma 3 270M, fp32, sdpa, on the test device (about a
    minute to load)."""
    return probe_mtp.load_model("gemma3-270m", device=test_device)


def prepared_copy(loaded, dtype: torch.dtype = torch.bfloat16):
    """``(a copy of the model prepared by probe_mtp.optimize for dtype, tokenizer)``; the test skips
    with optimize's own reason where it refuses (a model off the CPU)."""
    model, tokenizer = loaded
    try:
        return probe_mtp.optimize(copy.deepcopy(model), dtype, require_matrix_units=False), tokenizer
    except OptimizeError as exc:
        pytest.skip(f"{TEST_DEVICE_ENV}={device_under_test()}: probe_mtp.optimize refused: {exc}")


@pytest.fixture(scope="session")
def smollm2_bf16(smollm2):
    """The session's SmolLM2 prepared by ``probe_mtp.optimize`` (bf16, packed, exact attention), a
    copy: the fp32 fixture stays as it is.  Prepared on any processor (bf16 computes everywhere;
    only the speed needs matrix units); skipped off the CPU."""
    return prepared_copy(smollm2)


@pytest.fixture(scope="session")
def gemma3_bf16(gemma3):
    """The session's Gemma 3 270M prepared by ``probe_mtp.optimize`` (a copy); skipped off the CPU."""
    return prepared_copy(gemma3)


@pytest.fixture(scope="session")
def smollm2_fp32_prepared(smollm2):
    """The session's SmolLM2 prepared by ``probe_mtp.optimize(model, torch.float32)`` (float32
    weights packed once for oneDNN, exact attention), a copy; skipped where optimize refuses."""
    return prepared_copy(smollm2, torch.float32)


@pytest.fixture(scope="session")
def gemma3_fp32_prepared(gemma3):
    """The session's Gemma 3 270M prepared for float32 (a copy); skipped where optimize refuses."""
    return prepared_copy(gemma3, torch.float32)


def packed_wide_copy(loaded, kernel: str | None = None):
    """``(a copy of the model packed for wide passes by probe_mtp.pack_wide with ``kernel``,
    tokenizer)``; the test skips with pack_wide's own reason where it refuses (the kernel absent
    from this torch, a model off the CPU)."""
    model, tokenizer = loaded
    reason = probe_mtp.wide.why_not_pack_wide(model, kernel)
    if reason is not None:
        pytest.skip(f"{TEST_DEVICE_ENV}={device_under_test()}: probe_mtp.pack_wide refused: {reason}")
    return probe_mtp.pack_wide(copy.deepcopy(model), kernel), tokenizer


@pytest.fixture(scope="session")
def smollm2_packed_wide(smollm2):
    """The session's SmolLM2 packed for wide passes by MKL (float32, stock one-row products), a copy
    (named: the default kernel follows the processor's vendor, and oneDNN has fixtures of its own)."""
    return packed_wide_copy(smollm2, "mkl")


@pytest.fixture(scope="session")
def gemma3_packed_wide(gemma3):
    """The session's Gemma 3 270M packed for wide passes by MKL, a copy."""
    return packed_wide_copy(gemma3, "mkl")


@pytest.fixture(scope="session")
def smollm2_packed_onednn(smollm2):
    """The session's SmolLM2 packed for wide passes by oneDNN, a copy."""
    return packed_wide_copy(smollm2, "onednn")


@pytest.fixture(scope="session")
def gemma3_packed_onednn(gemma3):
    """The session's Gemma 3 270M packed for wide passes by oneDNN, a copy."""
    return packed_wide_copy(gemma3, "onednn")


@pytest.fixture(scope="session")
def specbench():
    return load_prompts()


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    """``[1, L]`` chat-template ids of one user turn, on the test device (the session's models'
    device)."""
    return chat_input_ids(tokenizer, [{"role": "user", "content": text}]).to(device_under_test())


def greedy_cases(model, tokenizer, prompts, greedy, max_new_tokens: int) -> list:
    """``(task, input_ids, greedy reference on model)`` for each prompt's first turn, in order."""
    return [(p.task, ids, greedy(model, ids, max_new_tokens))
            for p in prompts for ids in [chat_ids(tokenizer, p.turns[0])]]


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


class Greedy:
    """``model.generate(ids, do_sample=False, max_new_tokens=n)`` with nothing else set, once per
    (model, prompt): a later request for at most as many tokens is a slice of the stored output (a
    greedy prefix is greedy; a stored output that ended early ended at EOS, where every longer or
    shorter run ends too).  ``exact=True`` reuses only a run of the same length: for models whose
    cache may depend on the generation length (Gemma 3's sliding-window layers)."""

    def __init__(self):
        self._out: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, int]] = {}

    def __call__(self, model, ids: torch.Tensor, max_new_tokens: int, exact: bool = False) -> torch.Tensor:
        key = (id(model), tuple(ids[0].tolist()))
        stored = self._out.get(key)
        if stored is not None:
            out, asked = stored
            ended_at_eos = out.shape[1] - ids.shape[1] < asked
            if max_new_tokens == asked or (not exact and (max_new_tokens < asked or ended_at_eos)):
                return out[:, : ids.shape[1] + max_new_tokens]
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        self._out[key] = (out, max_new_tokens)
        return out


@pytest.fixture(scope="session")
def greedy():
    """The session's shared :class:`Greedy` references."""
    return Greedy()


class GreedyReferences:
    """Greedy outputs (``SMOL_NEW_TOKENS`` new tokens) of one Spec-Bench prompt per task, from the
    session's shared references."""

    def __init__(self, model, tokenizer, prompts, greedy: Greedy):
        self.model = model
        self.greedy = greedy
        self.ids = [chat_ids(tokenizer, p.turns[0]) for p in prompts]
        self.tasks = [p.task for p in prompts]

    def __call__(self, i: int) -> torch.Tensor:
        return self.greedy(self.model, self.ids[i], SMOL_NEW_TOKENS)


@pytest.fixture(scope="session")
def smol_refs(smollm2, specbench, greedy):
    """Greedy references of one prompt of each of the six Spec-Bench tasks on SmolLM2."""
    model, tokenizer = smollm2
    prompts = task_prompts(specbench, 1)
    assert len({p.task for p in prompts}) >= 6
    return GreedyReferences(model, tokenizer, prompts, greedy)


REAL_MODEL_FIXTURES = {"smollm2": "model", "gemma3": "gemma"}


def pytest_collection_modifyitems(config, items):
    """A test that loads a real model (directly or through another fixture) is marked ``model``
    (``gemma`` too for Gemma 3), so the fast loop can leave it out whatever folder it is in.  Off
    the CPU (``PROBE_MTP_TEST_DEVICE``), tests marked ``cpu_only`` are skipped, with the reason."""
    cpu_skip = None if on_cpu() else pytest.mark.skip(
        reason=f"cpu_only: tests a CPU path (oneDNN packing, processor flags, heap, resident memory); "
        f"{TEST_DEVICE_ENV}={device_under_test()}")
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for fixture, marker in REAL_MODEL_FIXTURES.items():
            if fixture in used:
                item.add_marker("model")
                item.add_marker(marker)
        if cpu_skip is not None and item.get_closest_marker("cpu_only") is not None:
            item.add_marker(cpu_skip)
