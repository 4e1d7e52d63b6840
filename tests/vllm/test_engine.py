"""vLLM's CPU build on the embedded SmolLM2 (float32): the converted copy decodes as transformers
does, and probe-mtp's proposer changes how many tokens a step commits, never which."""

from __future__ import annotations

from engine_helpers import NEW_TOKENS, accepted_tokens, greedy


def test_the_converted_copy_decodes_as_model_generate(plain_llm, prompt_ids):
    """The copy's tied embedding is stored under the name vLLM reads (before: token 0 at every step).
    vLLM's kernels (oneDNN-packed linear layers, paged attention) are not transformers', so a near
    tie may go either way on some prompt: most prompts must agree, and all must be far from token 0."""
    import probe_mtp
    import torch

    model, _ = probe_mtp.load_model("smollm2-135m", dtype=torch.float32)
    ours = greedy(plain_llm, prompt_ids[:3])
    same = 0
    for ids, got in zip(prompt_ids[:3], ours):
        ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS)[0, len(ids):].tolist()
        same += ref == got
        assert got[:8] == ref[:8] and len(set(got)) > 4, (got, ref)
    assert same >= 2


def test_the_proposer_gives_plain_vllms_tokens(plain_llm, probe_llm, prompt_ids):
    before = accepted_tokens(probe_llm)
    assert greedy(probe_llm, prompt_ids) == greedy(plain_llm, prompt_ids)  # one batch of the six
    assert greedy(probe_llm, prompt_ids[:1]) == greedy(plain_llm, prompt_ids[:1])  # alone
    assert accepted_tokens(probe_llm) > before  # it drafted, and vLLM accepted some


def test_a_repeated_request_drafts_from_the_corpus(plain_llm, probe_llm, prompt_ids):
    """The second time a request comes, its first answer is in the corpus: most of it is drafted."""
    prompt = prompt_ids[2]
    first = greedy(probe_llm, [prompt])
    before = accepted_tokens(probe_llm)
    again = greedy(probe_llm, [prompt])
    assert first == again == greedy(plain_llm, [prompt])
    assert accepted_tokens(probe_llm) - before >= 0.6 * len(again[0])
