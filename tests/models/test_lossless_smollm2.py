"""Greedy probe-mtp output is token-identical to ``model.generate(do_sample=False)`` in fp32 on the
embedded SmolLM2-135M-Instruct, over prompts from every Spec-Bench task and several configurations."""

from __future__ import annotations

import pytest
import torch

from probe_mtp import ProbeDecoder
from probe_mtp.prompts import TASKS, balanced_subset

from conftest import SMOL_NEW_TOKENS, chat_ids
from oracle import OracleDrafter

MAX_NEW = SMOL_NEW_TOKENS  # 48
PER_TASK = 2  # 12 prompts, every task


@pytest.fixture(scope="module")
def cases(smollm2, specbench, greedy):
    """(task, input_ids, reference continuation of MAX_NEW tokens) per prompt, in task order (two
    per task); each reference is computed once per session and sliced for shorter runs (greedy
    prefixes are greedy)."""
    model, tok = smollm2
    out = []
    for prompt in balanced_subset(specbench, PER_TASK):
        ids = chat_ids(tok, prompt.turns[0])
        ref = greedy(model, ids, MAX_NEW)
        out.append((prompt.task, ids, ref))
    assert {task for task, _, _ in out} == set(TASKS)
    return out


@pytest.fixture(scope="module")
def decoder(smollm2):
    model, tok = smollm2
    return ProbeDecoder(model, tok, drafter="esp")


def _expected(ref, ids, max_new):
    return ref[:, : ids.shape[1] + max_new]


# (num_masks, budget, new tokens, which prompts): 12 + 6 + 6 + 6 = 30 prompt/configuration pairs;
# the default run checks the paper's two settings on all 12 prompts (the first prompt of each task
# with one, the second with the other), `make test-all` all four
CONFIGS = [
    pytest.param(1, 10, MAX_NEW, slice(None), id="k1-bc10", marks=pytest.mark.slow),
    pytest.param(1, 30, MAX_NEW, slice(0, None, 2), id="k1-bc30"),
    pytest.param(2, 60, MAX_NEW, slice(1, None, 2), id="k2-bc60"),
    pytest.param(2, 30, 32, slice(0, None, 2), id="k2-bc30", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("num_masks,budget,max_new,which", CONFIGS)
def test_identical_to_generate(decoder, cases, num_masks, budget, max_new, which):
    mismatches = []
    for task, ids, ref in cases[which]:
        out = decoder.generate(ids, max_new_tokens=max_new, num_masks=num_masks, budget=budget,
                               return_dict_in_generate=True)
        if not torch.equal(out.sequences, _expected(ref, ids, max_new)):
            mismatches.append(task)
        stats = out.stats
        assert stats.new_tokens == out.sequences.shape[1] - ids.shape[1]
        assert sum(stats.accepted_lengths) + 1 == stats.new_tokens  # + the prefill's token
        assert stats.forward_passes == len(stats.accepted_lengths) + 1
        assert max(stats.accepted_lengths, default=1) <= budget // (num_masks + 1)  # path length bound
    assert not mismatches, f"output differs from model.generate on tasks {mismatches}"


@pytest.mark.parametrize(
    "knobs,case",  # one prompt per strategy: the first of mt_bench, translation, summarization, qa, math
    [
        (dict(mask_init="last_k", num_masks=2, budget=30), 0),
        (dict(mask_init="sample", mask_seed=3), 2),
        (dict(mask_init="token", mask_token=13), 4),
        (dict(mask_update=0.0), 6),
        (dict(mask_update=0.5, prune_repeats=False), 8),
    ],
    ids=["last_k", "sample", "token", "frozen", "ema0.5-noprune"],
)
def test_mask_strategies_stay_lossless(decoder, cases, knobs, case):
    task, ids, ref = cases[case]
    out = decoder.generate(ids, max_new_tokens=40, **knobs)
    assert torch.equal(out, _expected(ref, ids, 40)), task


def test_length_limit_inside_a_block(decoder, cases):
    """max_new_tokens that fall inside accepted blocks: the output stops exactly there."""
    hit_inside = False
    for _, ids, ref in cases:  # until one prompt has a multi-token step
        if hit_inside:
            break
        full = decoder.generate(ids, max_new_tokens=40, num_masks=2, budget=60, return_dict_in_generate=True)
        # cumulative token counts after each step; a limit strictly inside a multi-token step
        counts = [1]
        for n in full.stats.accepted_lengths:
            counts.append(counts[-1] + n)
        inside = [c - 1 for c, n in zip(counts[1:], full.stats.accepted_lengths) if n > 1]
        for limit in inside[:1]:
            hit_inside = True
            out = decoder.generate(ids, max_new_tokens=limit, num_masks=2, budget=60)
            assert torch.equal(out, _expected(ref, ids, limit))
    assert hit_inside, "no multi-token step found to test a limit inside a block"


def test_stops_exactly_at_eos(smollm2, decoder):
    """Short answers end with EOS; nothing is emitted after it, also with a list of EOS ids."""
    model, tok = smollm2
    ended = 0
    for text in ("Reply with the single word: yes", "What is 2 + 2? Answer with a number only.", "Say hello."):
        ids = chat_ids(tok, text)
        ref = model.generate(ids, do_sample=False, max_new_tokens=96)
        if ref[0, -1].item() != tok.eos_token_id:
            continue
        ended += 1
        assert torch.equal(decoder.generate(ids, max_new_tokens=96), ref)
        assert torch.equal(decoder.generate(ids, max_new_tokens=96, eos_token_id=[tok.eos_token_id, 7]), ref)
    assert ended, "no short prompt ended with EOS within 96 tokens"


def test_max_new_tokens_zero_and_one(decoder, cases):
    _, ids, ref = cases[0]
    assert torch.equal(decoder.generate(ids, max_new_tokens=0), ids)
    assert torch.equal(decoder.generate(ids, max_new_tokens=1), _expected(ref, ids, 1))


def test_eos_and_limit_inside_accepted_blocks(smollm2, decoder, cases):
    """With a drafter that proposes the true continuation, whole blocks are accepted; EOS and the
    length limit then fall inside a block, and the output still ends exactly where generate's does."""
    model, _ = smollm2
    for _, ids, ref in cases[:4]:
        continuation = ref[0, ids.shape[1] :].tolist()
        for limit in (2, 9, 30):
            out = decoder.generate(ids, max_new_tokens=limit, drafter=OracleDrafter(continuation, ids.shape[1]))
            assert torch.equal(out, _expected(ref, ids, limit))
        eos = continuation[7]  # pretend this token ends the text: generate stops at its first use
        # pad_token_id=eos as well: otherwise transformers reads the prompt's <|im_end|> (the model's
        # pad token) as padding once pad != eos, and builds an attention mask with holes
        ref_eos = model.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=eos, pad_token_id=eos)
        out = decoder.generate(ids, max_new_tokens=40, eos_token_id=eos, pad_token_id=eos,
                               drafter=OracleDrafter(continuation, ids.shape[1]), return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref_eos)
        assert max(out.stats.accepted_lengths) > 1
