"""Helpers of the engine tests: greedy generation on token ids, vLLM's accepted-draft counter."""

from __future__ import annotations

NEW_TOKENS = 48


def greedy(llm, prompts, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in done]


def accepted_tokens(llm) -> float:
    """vLLM's accepted-draft counter.  vLLM keeps its metrics in one registry per process and each new
    engine takes it over: read it only while ``llm`` is the latest engine started (test_engine.py runs
    before test_plugin.py starts the third one)."""
    return sum(float(m.value) for m in llm.get_metrics()
               if m.name == "vllm:spec_decode_num_accepted_tokens" and hasattr(m, "value"))
