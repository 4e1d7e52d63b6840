"""ConfAdapt (acceptance="confadapt") on SmolLM2: the opt-in lossy rule emits exactly what it says,
and nothing changes when it never fires."""

from __future__ import annotations

import pytest
import torch

from probe_mtp import ProbeDecoder

from conftest import chat_ids

PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
)
MAX_NEW = 32
NEAR_TIE = 1e-3  # top-2 logit gap below which a cached and an uncached pass may disagree


# --------------------------------------------------------------------------- on the model


@pytest.fixture(scope="module")
def decoder(smollm2):
    model, tok = smollm2
    return ProbeDecoder(model, tok, drafter="esp")


@pytest.fixture(scope="module")
def references(smollm2):
    model, tok = smollm2
    out = []
    for text in PROMPTS:
        ids = chat_ids(tok, text)
        out.append((ids, model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)))
    return out


def test_never_firing_is_greedy(decoder, references):
    for (ids, ref), (k, budget) in zip(references, ((1, 30), (2, 30))):
        out = decoder.generate(ids, max_new_tokens=MAX_NEW, num_masks=k, budget=budget, acceptance="confadapt",
                               threshold=1.5, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert out.stats.unverified_tokens == 0


def _teacher_forced_greedy(model, sequence: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The model's greedy token after every prefix of ``sequence`` that ends inside it (one pass)."""
    with torch.no_grad():
        logits = model(input_ids=sequence).logits[0]
    return logits[prompt_len - 1 : -1].argmax(-1)


@pytest.mark.parametrize("k,budget,threshold", [(2, 30, 0.3)])
def test_only_unverified_tokens_may_differ_from_greedy(smollm2, decoder, references, k, budget, threshold):
    """Every verified token is the model's greedy choice after the tokens emitted before it, so
    tokens that differ from it are at most the unverified ones - and some are unverified."""
    model, _ = smollm2
    fired = 0
    for ids, _ in references:
        out = decoder.generate(ids, max_new_tokens=MAX_NEW, num_masks=k, budget=budget, acceptance="confadapt",
                               threshold=threshold, return_dict_in_generate=True)
        new = out.sequences[0, ids.shape[1]:]
        greedy = _teacher_forced_greedy(model, out.sequences, ids.shape[1])
        differ = int((new != greedy).sum())
        assert differ <= out.stats.unverified_tokens
        assert 1 <= out.stats.new_tokens - sum(out.stats.accepted_lengths) <= 1 + k  # the prefill's tokens
        fired += out.stats.unverified_tokens
    assert fired > 0, "ConfAdapt never fired: the test proves nothing"


def _rule_reference(model, ids: torch.Tensor, k: int, new_tokens: int) -> tuple[list[int], int]:
    """threshold=0, frozen prompt-mean masks, without a cache or a tree: every pass emits the greedy
    token after the sequence and the top-1 of the k masks owned by the sequence's last token.
    Returns the tokens and how many of them are safe to compare (up to the first near-tie)."""
    embed = model.get_input_embeddings()
    seq = ids[0].tolist()
    with torch.no_grad():
        mask = embed(ids[0]).mean(0, keepdim=True).expand(k, -1)
        out: list[int] = []
        safe = None
        while len(out) < new_tokens:
            n = len(seq)
            e = torch.cat([embed(torch.tensor(seq)), mask])
            logits = model(inputs_embeds=e[None], position_ids=torch.arange(n + k)[None]).logits[0, n - 1 :]
            top2 = logits.topk(2, dim=-1).values
            if safe is None and bool(((top2[:, 0] - top2[:, 1]) < NEAR_TIE).any()):
                safe = len(out)
            step = logits.argmax(-1).tolist()
            seq += step
            out += step
    return out[:new_tokens], (new_tokens if safe is None else min(safe, new_tokens))


@pytest.mark.parametrize("k", [1, 2])
def test_threshold_zero_matches_the_rule(smollm2, decoder, references, k):
    """With threshold 0 every mask fires: each pass emits the verified next token plus all k mask
    predictions, which a plain (uncached, tree-free) implementation of the rule reproduces."""
    model, _ = smollm2
    compared = 0
    for ids, _ in references:
        out = decoder.generate(ids, max_new_tokens=18, masks="prompt_mean", num_masks=k, budget=2 * (k + 1), acceptance="confadapt",
                               threshold=0.0, mask_update=0.0, return_dict_in_generate=True)
        expected, safe = _rule_reference(model, ids, k, 18)
        got = out.sequences[0, ids.shape[1]:].tolist()
        n = min(safe, len(got))
        assert got[:n] == expected[:n]
        compared += n
        assert all(a == k + 1 for a in out.stats.accepted_lengths[:-1])  # root-only trees: bonus + k masks
    assert compared >= 12, "too few tokens compared (near-ties everywhere?)"


def test_confadapt_refuses_sampling(decoder, references):
    ids, _ = references[0]
    with pytest.raises(ValueError, match="greedy"):
        decoder.generate(ids, max_new_tokens=4, do_sample=True, acceptance="confadapt")
