"""Lossless sampling on SmolLM2: the acceptance rules on real distributions (a real tree pass):
thousands of simulated verifications, chi-square against the target, and a deliberately wrong rule
that must fail; seeded sampling is reproducible; and the first tokens drawn through probe-mtp agree
with plain sampling (the tiny-model end-to-end test is in tests/unit/test_sampling_rules.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from probe_mtp import ProbeDecoder
from probe_mtp.verify import accept_recursive_rejection, accept_sample_and_match
from probe_mtp.tree import best_first

from conftest import chat_ids

ALPHA = 1e-3  # a correct rule fails one of these tests with probability about 0.1%


def _pooled_chisquare(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Goodness of fit with rare outcomes pooled into one cell; returns the p-value."""
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


@pytest.fixture(scope="module")
def real_step(smollm2):
    """A real prompt, the top-p-processed target distribution at the root and at its children,
    and an ESP-style tree of the 8 most likely root continuations (from the model's own masks)."""
    model, tok = smollm2
    ids = chat_ids(tok, "Name a color.")
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float()
    probs_root = _top_p(torch.softmax(logits, -1), 0.9)
    cand = torch.topk(probs_root, 8)
    tree = best_first(int(ids[0, -1]), [cand.indices.numpy()], [cand.values.double().numpy()], 6)
    child_probs = []
    with torch.no_grad():
        for tok_id in tree.tokens[1:]:
            ext = torch.cat([ids, torch.tensor([[int(tok_id)]])], dim=1)
            child_probs.append(_top_p(torch.softmax(model(ext).logits[0, -1].float(), -1), 0.9))
    node_probs = torch.stack([probs_root] + child_probs)
    return tree, node_probs


def _top_p(p: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, idx = torch.sort(p, descending=True)
    keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
    out = torch.zeros_like(p)
    out[idx[keep]] = sorted_p[keep]
    return out / out.sum()


def _simulate(rule, tree, node_probs, draws=4000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    first, second = [], {}
    for _ in range(draws):
        path, bonus = rule(tree, node_probs, gen)
        tokens = list(tree.tokens[path[1:]]) + [bonus]
        first.append(int(tokens[0]))
        if len(path) > 1:  # second token from the accepted child's distribution
            second.setdefault(int(path[1]), []).append(int(tokens[1]))
    return np.array(first), second


def _rejection_rule_with_draws(q_at_root: torch.Tensor, n_draws: int):
    """Children of the root drawn i.i.d. from q, then recursive rejection."""

    def rule(tree_unused, node_probs, gen):
        from probe_mtp.tree import TokenTree

        draws = torch.multinomial(q_at_root, n_draws, replacement=True, generator=gen).tolist()
        uniq = list(dict.fromkeys(draws))
        tree = TokenTree(np.array([0] + uniq), np.array([-1] + [0] * len(uniq)), np.ones(len(uniq) + 1))
        # target at each drawn child: reuse row 1 for all (only the first token is checked here)
        probs = torch.cat([node_probs[:1], node_probs[1:2].expand(len(uniq), -1)])
        path, bonus = accept_recursive_rejection(tree, probs, {0: q_at_root}, {0: draws}, gen)
        return path, bonus, tree

    return rule


def test_sample_and_match_is_exact(real_step):
    tree, node_probs = real_step
    first, second = _simulate(accept_sample_and_match, tree, node_probs)
    vocab = node_probs.shape[1]
    assert _pooled_chisquare(np.bincount(first, minlength=vocab), node_probs[0].numpy()) > ALPHA
    for child, toks in second.items():
        if len(toks) >= 200:
            assert _pooled_chisquare(np.bincount(toks, minlength=vocab), node_probs[child].numpy()) > ALPHA


def test_recursive_rejection_is_exact_and_a_wrong_rule_is_caught(real_step):
    tree, node_probs = real_step
    vocab = node_probs.shape[1]
    # a draft distribution unlike the target: flatter (temperature 2 over the root's top tokens)
    q = torch.softmax(torch.log(node_probs[0].clamp_min(1e-12)) / 2.0, -1)
    rule = _rejection_rule_with_draws(q, 4)
    gen = torch.Generator().manual_seed(1)
    first = []
    for _ in range(4000):
        path, bonus, drawn_tree = rule(None, node_probs, gen)
        first.append(int(drawn_tree.tokens[path[1]]) if len(path) > 1 else bonus)
    assert _pooled_chisquare(np.bincount(np.array(first), minlength=vocab), node_probs[0].numpy()) > ALPHA

    def wrong_rule(tree, probs, gen):
        """Accept the first child whenever the target gives it any mass: biased toward drafts."""
        kids = tree.children(0)
        for c in kids:
            if probs[0, tree.tokens[c]] > 0:
                return np.array([0, c]), int(torch.multinomial(probs[c], 1, generator=gen))
        return np.array([0]), int(torch.multinomial(probs[0], 1, generator=gen))

    bad_first, _ = _simulate(wrong_rule, tree, node_probs, draws=4000)
    assert _pooled_chisquare(np.bincount(bad_first, minlength=vocab), node_probs[0].numpy()) < ALPHA


def _first_tokens(fn, n_draws, n_tokens):
    rows = []
    for seed in range(n_draws):
        rows.append(tuple(fn(seed)[0, -n_tokens:].tolist()))
    return rows


def _two_sample_p(a: list, b: list, min_count: int = 5) -> float:
    keys = sorted(set(a) | set(b))
    ca = np.array([a.count(k) for k in keys])
    cb = np.array([b.count(k) for k in keys])
    big = (ca + cb) >= min_count
    table = np.array([np.append(ca[big], ca[~big].sum()), np.append(cb[big], cb[~big].sum())])
    table = table[:, table.sum(0) > 0]
    return float(chi2_contingency(table).pvalue)


def test_seeded_sampling_is_reproducible(smollm2):
    model, tok = smollm2
    ids = chat_ids(tok, "Tell me a one-line joke.")
    decoder = ProbeDecoder(model, tok)
    runs = [decoder.generate(ids, do_sample=True, temperature=0.8, max_new_tokens=24,
                             generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    torch.manual_seed(3)
    a = decoder.generate(ids, do_sample=True, max_new_tokens=16)
    torch.manual_seed(3)
    b = decoder.generate(ids, do_sample=True, max_new_tokens=16)
    assert torch.equal(a, b)


def test_real_model_first_token_distribution(smollm2):
    """Sixty seeded draws of the first two tokens on the real model agree with plain sampling
    (the tiny-model tests above take thousands of draws; this one checks the real model's path)."""
    model, tok = smollm2
    ids = chat_ids(tok, "Name a color.")
    decoder = ProbeDecoder(model, tok, drafter="esp", num_masks=1, budget=10)
    kw = dict(do_sample=True, temperature=1.0, top_p=0.9, max_new_tokens=2)
    a = _first_tokens(lambda s: decoder.generate(ids, generator=torch.Generator().manual_seed(s), **kw), 60, 2)

    def plain(seed):
        torch.manual_seed(50_000 + seed)
        return model.generate(ids, **kw)

    b = _first_tokens(plain, 60, 2)
    assert _two_sample_p(a, b) > ALPHA


def test_real_model_batch_rows_sample_as_plain_batched_sampling(smollm2):
    """A left-padded batch of two prompts sampled in one call: each row's first two tokens agree
    with the same row under plain batched sampling (sixty seeded draws each, as above)."""
    from probe_mtp.report.batches import left_padded

    model, tok = smollm2
    ids, mask = left_padded([chat_ids(tok, "Name a color."), chat_ids(tok, "Name an animal that lives in the sea.")],
                            tok.pad_token_id)
    decoder = ProbeDecoder(model, tok)
    kw = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_p=0.9, max_new_tokens=2)
    a = [decoder.generate(ids, generator=torch.Generator().manual_seed(s), **kw)[:, -2:] for s in range(60)]

    def plain(seed):
        torch.manual_seed(60_000 + seed)
        return model.generate(ids, **kw)[:, -2:]

    b = [plain(s) for s in range(60)]
    for r in range(2):
        assert _two_sample_p([tuple(x[r].tolist()) for x in a], [tuple(x[r].tolist()) for x in b]) > ALPHA
