"""The baseline drafters (pld, lookahead, stand, ar): unit tests on toy contexts (losslessness
through the shared tree verifier on the embedded models is in tests/models/test_drafters_lossless.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probe_mtp.config import ProbeConfig
from probe_mtp.drafters import DRAFTERS
from probe_mtp.drafters import (
    AutoregressiveDrafter,
    LookaheadDrafter,
    PromptLookupDrafter,
    StandDrafter,
    StepFeedback,
    lookahead_shape,
    make_drafter,
)
from probe_mtp.drafters.pld import lookup_continuation
from probe_mtp.tree import TokenTree
from probe_mtp.vocab import RowTops

BASELINES = ("pld", "lookahead", "stand", "ar")
VOCAB = 50


def _feedback(tree: TokenTree, accepted, context, node_logits, prefill=False) -> StepFeedback:
    accepted = np.asarray(accepted, dtype=np.int64)
    return StepFeedback(
        tree=tree,
        accepted=accepted,
        new_tokens=np.asarray(context[len(context) - len(accepted) :], dtype=np.int64),
        node_logits=node_logits,
        mask_logits=None,
        context=np.asarray(context, dtype=np.int64),
        is_prefill=prefill,
    )


def _peaked(rows: list[dict[int, float]], vocab: int = VOCAB) -> torch.Tensor:
    """Logits whose softmax puts (to ~1e-11) the given probabilities on the given tokens; the rest
    of the mass goes to the last vocabulary entry."""
    out = torch.full((len(rows), vocab), -40.0, dtype=torch.float64)
    for r, probs in enumerate(rows):
        for tok, p in probs.items():
            out[r, tok] = float(np.log(p))
        out[r, vocab - 1] = float(np.log(max(1.0 - sum(probs.values()), 1e-12)))
    return out.float()


# ---------------------------------------------------------------------- registry and config
def test_registered_in_config_and_factory():
    for name in BASELINES:
        assert name in DRAFTERS
        drafter = make_drafter(ProbeConfig(drafter=name, budget=30, num_masks=2))
        assert drafter.name == name
        assert drafter.num_masks == 0  # num_masks does not apply to the baselines


def test_config_budget_and_num_masks_validation_for_mask_free_drafters():
    assert ProbeConfig(drafter="pld", budget=2).budget == 2  # root + one node, no masks
    with pytest.raises(ValueError, match="too small"):
        ProbeConfig(drafter="pld", budget=1)
    with pytest.raises(ValueError, match="num_masks"):
        ProbeConfig(drafter="stand", num_masks=0)  # still validated
    with pytest.raises(ValueError, match="too small"):
        ProbeConfig(drafter="esp", budget=3)  # esp keeps its mask-aware minimum


# ---------------------------------------------------------------------- ar
def test_ar_is_root_only():
    d = AutoregressiveDrafter(30)
    d.start(np.arange(10))
    for ctx in (np.array([3]), np.array([1, 2, 3, 1, 2, 3])):
        tree = d.propose(int(ctx[-1]), ctx)
        assert tree.size == 1 and tree.tokens[0] == ctx[-1]
    assert d.max_nodes == 0


# ---------------------------------------------------------------------- pld
def test_pld_prefers_longest_ngram_then_most_recent():
    #            0  1  2  3  4  5  6  7  8  9 10 11 12 13 14
    ctx = np.array([5, 1, 2, 3, 9, 9, 7, 2, 3, 4, 4, 1, 2, 3])
    # the trigram (1, 2, 3) occurs at 1..3 only (7..8 is just the bigram 2, 3): copy what followed it
    assert lookup_continuation(ctx, 3, 4).tolist() == [9, 9, 7, 2]
    # with bigrams only, (2, 3) occurs at 2..3 and 7..8: the most recent wins
    assert lookup_continuation(ctx, 2, 4).tolist() == [4, 4, 1, 2]
    assert lookup_continuation(ctx, 2, 4, match="first").tolist() == [9, 9, 7, 2]
    d = PromptLookupDrafter(budget=5)
    tree = d.propose(3, ctx)
    assert tree.tokens.tolist() == [3, 9, 9, 7, 2]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]  # a chain of budget - 1 tokens


def test_pld_unigram_fallback_truncation_and_no_match():
    ctx = np.array([4, 8, 6, 1, 4])
    assert lookup_continuation(ctx, 3, 10).tolist() == [8, 6, 1, 4]  # only the unigram 4 matches; ends at the context end
    d = PromptLookupDrafter(budget=30)
    assert d.propose(7, np.array([1, 2, 3, 7])).size == 1  # 7 never occurred before: root only
    assert d.propose(1, np.array([1])).size == 1


@settings(max_examples=60, deadline=None)
@given(
    ctx=st.lists(st.integers(0, 4), min_size=2, max_size=40),
    ngram=st.integers(1, 3),
    num=st.integers(1, 12),
)
def test_pld_first_mode_matches_transformers_prompt_lookup(ctx, ngram, num):
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    ids = torch.tensor([ctx])
    gen = PromptLookupCandidateGenerator(num_output_tokens=num, max_matching_ngram_size=ngram, max_length=10_000)
    cand, _ = gen.get_candidates(ids)
    expected = cand[0, len(ctx) :].tolist()
    assert lookup_continuation(np.array(ctx), ngram, num, match="first").tolist() == expected


# ---------------------------------------------------------------------- lookahead
@pytest.mark.parametrize("budget,shape", [(10, (3, 4, 1)), (30, (4, 5, 5)), (60, (5, 8, 7))])
def test_lookahead_paper_shapes_and_bc_bound(budget, shape):
    assert lookahead_shape(budget) == shape
    n, w, g = shape
    assert (n - 1) * (w + g) == budget
    # a prompt in which every token starts many distinct n-grams fills the pool to capacity
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 6, size=400)
    d = LookaheadDrafter(budget)
    d.start(prompt)
    context = prompt.copy()
    sizes = []
    for step in range(12):
        root = int(context[-1])
        tree = d.propose(root, context)
        sizes.append(tree.size)
        assert tree.size <= budget
        # each column's tail is where its path ends
        for path, tail in zip(d.lookahead_paths(), d._tails):
            assert tree.path_tokens(int(tail))[1:].tolist() == path
        # every verification candidate is a root path in the tree
        for cand in d.candidates(root):
            assert len(cand) == n - 1
        logits = torch.randn(tree.size, 6)
        nxt = int(logits[0].argmax())
        context = np.append(context, nxt)
        d.observe(_feedback(tree, [0], context, logits))
    assert len(d.candidates(int(context[-1]))) <= g
    assert max(sizes) <= budget


@pytest.mark.parametrize("budget", list(range(2, 131)))
def test_lookahead_shape_fits_every_budget(budget):
    n, w, g = lookahead_shape(budget)
    assert n >= 2 and w >= 1 and g >= 1
    assert (n - 1) * (w + g) <= budget
    assert LookaheadDrafter(budget).block_complexity <= budget


def test_lookahead_window_update_and_ngram_harvest():
    d = LookaheadDrafter(budget=10, pool_from_context=False)  # N=3, W=4, G=1
    d.start(np.array([40, 41, 42, 43]))
    d._levels[:] = [[0, 11, 12, 13], [20, 21, 22, 23]]
    tree = d.propose(7, np.array([40, 41, 42, 43, 7]))
    # column i = spine L0[1..i] + L1[i]
    assert d.lookahead_paths() == [[20], [11, 21], [11, 12, 22], [11, 12, 13, 23]]
    assert tree.size == 8  # root + 3 spine + 4 column tails: (N-1) W
    new = [30, 31, 32, 33]
    logits = torch.full((tree.size, VOCAB), -10.0)
    for tail, tok in zip(d._tails, new):
        logits[tail, tok] = 10.0
    ctx = np.array([40, 41, 42, 43, 7, int(logits[0].argmax())])
    d.observe(_feedback(tree, [0], ctx, logits))
    # N - 1 = 2 updates are needed before harvesting; the window shifted by one level
    assert d._levels.tolist() == [[20, 21, 22, 23], new]
    assert d.candidates(7) == []
    tree2 = d.propose(9, np.append(ctx, 9))
    logits2 = torch.full((tree2.size, VOCAB), -10.0)
    for tail, tok in zip(d._tails, [1, 2, 3, 4]):
        logits2[tail, tok] = 10.0
    d.observe(_feedback(tree2, [0], np.append(ctx, [9, int(logits2[0].argmax())]), logits2))
    # column 0's n-gram starts with the root, column i's with L0[i]; G = 1 keeps the latest
    assert d.candidates(9) == [(30, 1)]
    assert d.candidates(21) == [(31, 2)]
    assert d._levels.tolist() == [new, [1, 2, 3, 4]]


def test_lookahead_pool_from_prompt_proposes_prompt_ngrams():
    prompt = np.array([5, 6, 7, 8, 1, 5, 6, 9, 2])
    d = LookaheadDrafter(budget=30)  # N=4: 3-token continuations
    d.start(prompt)
    assert set(d.candidates(5)) == {(6, 7, 8), (6, 9, 2)}
    tree = d.propose(5, np.append(prompt, 5))
    leaves = {tuple(tree.path_tokens(i)[1:].tolist()) for i in range(tree.size)}
    assert (6, 7, 8) in leaves and (6, 9, 2) in leaves


def test_lookahead_start_resets_state():
    d = LookaheadDrafter(budget=30)
    d.start(np.array([1, 2, 3, 4, 1, 2, 3, 4]))
    assert d.candidates(1)
    d.start(np.array([9, 8]))
    assert d.candidates(1) == []


# ---------------------------------------------------------------------- stand
def test_stand_memory_proposes_stored_continuations():
    d = StandDrafter(budget=6, seed_from_prompt=False)
    prompt = np.array([1, 2, 3])
    d.start(prompt)
    assert d.propose(3, prompt).size == 1  # empty memory: root only
    # prefill: the model's distribution after (2, 3) is {4: 0.7, 5: 0.2}
    ctx = np.array([1, 2, 3, 4])
    d.observe(_feedback(TokenTree.root_only(3), [0], ctx, _peaked([{4: 0.7, 5: 0.2}]), prefill=True))
    # a step whose root 4 was followed by 6 (prob 0.9)
    root_only = d.propose(4, ctx)  # memory has nothing after (3, 4) or 4 yet
    assert root_only.size == 1
    ctx = np.append(ctx, 6)
    d.observe(_feedback(root_only, [0], ctx, _peaked([{6: 0.9, 7: 0.05}])))
    tree = d.propose(3, np.array([8, 2, 3]))
    paths = {tuple(tree.path_tokens(i)[1:].tolist()) for i in range(1, tree.size)}
    # (2, 3) -> 4 (0.7), 5 (0.2); (3, 4) -> 6 (0.9): best first by product of probabilities
    assert (4,) in paths and (5,) in paths and (4, 6) in paths
    children = tree.tokens[tree.children(0)].tolist()
    assert children[:2] == [4, 5]
    assert tree.size <= 6
    np.testing.assert_allclose(tree.scores[tree.tokens.tolist().index(6)], 0.7 * 0.9, rtol=1e-3)


def test_stand_backs_off_to_one_token_key_and_respects_budget():
    d = StandDrafter(budget=4, seed_from_prompt=False, top_k=3)
    d.start(np.array([1]))
    d.store((3,), np.array([4, 5, 6]), np.array([0.5, 0.3, 0.2]))
    d.store((3, 4), np.array([9]), np.array([0.9]))
    tree = d.propose(3, np.array([7, 3]))  # (7, 3) unknown: fall back to (3,)
    assert tree.size == 4
    scores = dict(zip(tree.tokens.tolist()[1:], tree.scores.tolist()[1:]))
    assert set(scores) == {4, 9, 5}  # 0.5, 0.45, 0.3 beat 6 (0.2)


def test_stand_seeds_from_prompt_and_merges_running_mean():
    d = StandDrafter(budget=10, merge="mean")
    d.start(np.array([1, 2, 3, 1, 2, 4]))
    toks, probs, count = d.lookup(1, 2)
    assert sorted(zip(toks.tolist(), probs.tolist())) == [(3, 0.5), (4, 0.5)] and count == 2
    d.store((1, 2), np.array([3]), np.array([1.0]))
    toks, probs, count = d.lookup(1, 2)
    assert toks[0] == 3 and probs[0] == pytest.approx(2 / 3) and count == 3
    d.start(np.array([7, 8]))
    assert d.lookup(1, 2) is None  # start() resets the memory


def test_stand_latest_merge_replaces_and_learns_from_rejected_nodes():
    d = StandDrafter(budget=10, seed_from_prompt=False)  # defaults: merge="latest", learn_from="all"
    d.start(np.array([1, 2]))
    # tree 2 -> {3 (accepted), 5 (rejected)}; 3 -> 4 (rejected)
    tree = TokenTree(np.array([2, 3, 5, 4]), np.array([-1, 0, 0, 1]), np.ones(4))
    logits = _peaked([{3: 0.8}, {4: 0.6}, {8: 0.9}, {7: 0.7}])
    ctx = np.array([1, 2, 3, 9])  # accepted root, node 1 (token 3); bonus 9 (the model's token after 3)
    d.observe(_feedback(tree, [0, 1], ctx, logits))
    assert d.lookup(2, 5)[0][0] == 8  # a rejected node's distribution is stored under its own path
    assert d.lookup(3, 4)[0][0] == 7  # ... also for deeper rejected nodes
    assert d.lookup(2, 3)[0][0] == 4 and d.lookup(1, 2)[0][0] == 3
    d.store((2, 3), np.array([6]), np.array([0.4]))
    toks, probs, count = d.lookup(2, 3)
    assert toks.tolist() == [6] and probs.tolist() == [0.4] and count == 1
    only_accepted = StandDrafter(budget=10, seed_from_prompt=False, learn_from="accepted")
    only_accepted.start(np.array([1, 2]))
    only_accepted.observe(_feedback(tree, [0, 1], ctx, logits))
    assert only_accepted.lookup(2, 5) is None  # nothing stored for rejected nodes
    assert only_accepted.lookup(2, 3)[0][0] == 4


@pytest.mark.parametrize("learn_from", ["all", "accepted"])
def test_stand_learns_the_same_from_the_decoders_row_tops_as_from_the_logits(learn_from):
    tree = TokenTree(np.array([2, 3, 5, 4]), np.array([-1, 0, 0, 1]), np.ones(4))
    logits = _peaked([{3: 0.8, 6: 0.1}, {4: 0.6, 1: 0.3}, {8: 0.9}, {7: 0.7, 2: 0.2}])
    ctx = np.array([1, 2, 3, 9])
    drafters = [StandDrafter(budget=10, seed_from_prompt=False, top_k=4, learn_from=learn_from) for _ in range(2)]
    assert drafters[0].node_top_k == (4 if learn_from == "all" else 0)
    for given_tops, d in zip((False, True), drafters):
        d.start(np.array([1, 2]))
        fb = _feedback(tree, [0, 1], ctx, logits)
        if given_tops:  # wider than the drafter reads, as when the walk asks for more
            fb.node_tops = RowTops.of(logits, 6)
        d.observe(fb)
    assert drafters[0]._memory.keys() == drafters[1]._memory.keys() and drafters[0]._memory
    for key, (toks, probs, n) in drafters[0]._memory.items():
        other = drafters[1]._memory[key]
        assert np.array_equal(toks, other[0]) and np.allclose(probs, other[1], rtol=1e-6) and n == other[2]
        assert toks.size == 4
