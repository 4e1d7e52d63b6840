"""The hybrid drafter: its parts on toy inputs (context index, successor table, calibration,
best-first growth, merging of sources); losslessness on the embedded models is in
tests/models/test_hybrid_lossless.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probe_mtp.config import ProbeConfig
from probe_mtp.drafters import DRAFTERS
from probe_mtp.drafters import HybridDrafter, StepFeedback, make_drafter
from probe_mtp.drafters.calibration import AcceptanceCalibrator
from probe_mtp.drafters.context_match import ContextIndex
from probe_mtp.drafters.hybrid import MASK, SUCC
from probe_mtp.drafters.successors import SuccessorTable
from probe_mtp.tree import TokenTree, grow_best_first
from probe_mtp.vocab import RowTops

VOCAB = 40


def _logits(rows: list[dict[int, float]], vocab: int = VOCAB) -> torch.Tensor:
    """Logits whose softmax puts the given probabilities on the given tokens (the rest of the
    mass spread evenly over the other tokens)."""
    out = torch.empty(len(rows), vocab, dtype=torch.float64)
    for r, probs in enumerate(rows):
        rest = (1.0 - sum(probs.values())) / (vocab - len(probs))
        out[r] = float(np.log(rest))
        for tok, p in probs.items():
            out[r, tok] = float(np.log(p))
    return out.float()


# ---------------------------------------------------------------------- context index
def _scan_votes(context: list[int], suffix: list[int], max_ngram: int):
    """Reference: scan every earlier occurrence of suffix[-1] and measure its match length."""
    per_token: dict[int, list[tuple[int, int]]] = {}  # token -> [(match length, position)]
    lengths = []
    for i in range(len(context) - 1):
        if context[i] != suffix[-1]:
            continue
        n = 1
        while n < min(max_ngram, len(suffix)) and i - n >= 0 and context[i - n] == suffix[-n - 1]:
            n += 1
        lengths.append(n)
        per_token.setdefault(context[i + 1], []).append((n, i))
    rows = []
    for tok, occ in per_token.items():
        best = max(n for n, _ in occ)
        share = sum(1 for n, _ in occ if n >= best) / sum(1 for n in lengths if n >= best)
        last = max(i for n, i in occ if n >= best)
        rows.append((-best, -share, -last, tok))
    rows.sort()
    return [r[3] for r in rows], [-r[0] for r in rows], [pytest.approx(-r[1]) for r in rows]


@settings(max_examples=80, deadline=None)
@given(
    context=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    path=st.lists(st.integers(0, 3), max_size=3),
    max_ngram=st.integers(1, 4),
    split=st.integers(0, 40),
)
def test_context_index_matches_a_scan_of_the_context(context, path, max_ngram, split):
    index = ContextIndex(max_ngram)
    index.extend(np.array(context[:split]))  # indexed in two pieces, as a generation grows
    index.extend(np.array(context))
    assert len(index) == len(context)
    suffix = context + path
    tokens, length, share = index.votes(suffix[-max_ngram:])
    assert (tokens, length, share) == _scan_votes(context, suffix, max_ngram)


def test_context_index_example_and_reset():
    #               0  1  2  3  4  5  6  7  8
    ctx = np.array([1, 2, 3, 9, 2, 3, 7, 2, 3])
    index = ContextIndex(3)
    index.extend(ctx)
    # (7, 2, 3): the 3s at 2 and 5 match two tokens each; they were followed by 9 and 7, the
    # more recent first
    assert index.votes([7, 2, 3]) == ([7, 9], [2, 2], [0.5, 0.5])
    # (1, 2, 3): the 3 at 2 matches all three tokens, so its 9 comes first, unanimous
    assert index.votes([1, 2, 3]) == ([9, 7], [3, 2], [1.0, 0.5])
    assert index.votes([5]) == ([], [], [])
    index.reset()
    assert len(index) == 0 and index.votes([2]) == ([], [], [])


# ---------------------------------------------------------------------- successor table
def test_successor_table_keys_latest_entry_and_lookup_order():
    table = SuccessorTable(top_k=2, order=2)
    table.update([(5, 6), (7, 6)], _logits([{1: 0.6, 2: 0.3}, {3: 0.9}]))
    single, pair = table.lookup((5, 6))
    assert single[0][0] == 3  # the later row wins under the one-token key (6,)
    assert pair[0] == [1, 2] and pair[1] == pytest.approx([0.6, 0.3], abs=1e-5)
    assert table.lookup((4, 6))[0] == single and table.lookup((4, 6))[1] is None
    assert table.lookup((8,)) == [None, None]
    assert len(table) == 1
    table.reset()
    assert table.lookup((5, 6)) == [None, None]
    with pytest.raises(ValueError, match="order"):
        SuccessorTable(order=0)


def test_successor_table_memory_is_fixed_and_colliding_keys_replace_each_other():
    table = SuccessorTable(top_k=2, order=2, slots=1)  # every pair key hashes to the one row
    table.update([(5, 6)], _logits([{1: 0.6}]))
    sizes = [a.nbytes for rows in table._tables for a in (rows.tokens, rows.probs, rows.width)]
    rng = np.random.default_rng(0)
    for _ in range(50):
        tails = [tuple(int(t) for t in rng.integers(0, VOCAB, 2)) for _ in range(5)]
        table.update(tails, _logits([{int(rng.integers(0, VOCAB)): 0.7} for _ in tails]))
    assert [a.nbytes for rows in table._tables for a in (rows.tokens, rows.probs, rows.width)] == sizes
    table.update([(5, 6), (3, 4)], _logits([{1: 0.6}, {2: 0.8}]))
    assert table.lookup((5, 6))[1] is None  # (3, 4) took the only pair row
    assert table.lookup((3, 4))[1][0][0] == 2
    with pytest.raises(ValueError, match="outside"):
        table.store([(VOCAB + 3,)], np.array([[1]]), np.array([[0.5]]))
    with pytest.raises(ValueError, match="power of two"):
        SuccessorTable(slots=3)


# ---------------------------------------------------------------------- calibration
def test_calibrator_starts_at_prior_and_follows_evidence():
    cal = AcceptanceCalibrator({"a": np.array([0.5, 0.1])}, strength=2.0)
    np.testing.assert_allclose(cal.estimate("a", np.array([0, 1])), [0.5, 0.1])
    cal.record("a", np.array([0, 0, 0, 1]), np.array([True, True, False, False]))
    # cell 0: (2 + 2 * 0.5) / (3 + 2); cell 1: (0 + 2 * 0.1) / (1 + 2)
    np.testing.assert_allclose(cal.estimate("a", np.array([0, 1])), [3 / 5, 0.2 / 3])
    np.testing.assert_allclose(cal.all_cells("a"), [3 / 5, 0.2 / 3])
    np.testing.assert_allclose(cal.estimate("a", np.array([1]), prior=np.array([0.4])), [0.8 / 3])
    cal.reset()
    np.testing.assert_allclose(cal.estimate("a", np.array([0])), [0.5])
    with pytest.raises(ValueError, match="prior"):
        AcceptanceCalibrator({"b": np.array([1.5])})


# ---------------------------------------------------------------------- best-first growth
def _toy_children(path: tuple[int, ...]) -> tuple[list[int], list[float]]:
    """Deterministic pseudo-random children of a path: distinct tokens, probabilities in (0, 1)."""
    rng = np.random.default_rng(abs(hash(path)) % 2**32)
    width = int(rng.integers(0, 4))
    toks = rng.choice(10, size=width, replace=False).tolist()
    return toks, rng.uniform(0.05, 0.95, size=width).tolist()


@settings(max_examples=40, deadline=None)
@given(max_nodes=st.integers(0, 12), root=st.integers(0, 9))
def test_grow_best_first_takes_the_best_paths(max_nodes, root):
    paths: dict[int, tuple[int, ...]] = {}

    def expand(node, parent, token):
        paths[node] = () if parent < 0 else paths[parent] + (token,)
        return _toy_children(paths[node])

    def score(path):
        s = 1.0
        for d in range(len(path)):
            toks, probs = _toy_children(path[:d])
            s *= probs[toks.index(path[d])]
        return s

    tree, index = grow_best_first(root, expand, max_nodes)
    assert tree.size <= max_nodes + 1 and tree.tokens[0] == root
    # every taken node's index points at its path in the breadth-first tree, with its score
    for node, path in paths.items():
        assert tuple(tree.path_tokens(int(index[node]))[1:].tolist()) == path
        assert tree.scores[index[node]] == pytest.approx(score(path))
    # optimality certificate: no candidate left out scores above a taken node (every path outside
    # the tree has such a candidate as an ancestor, and scores never grow along a path)
    taken = {tuple(tree.path_tokens(i)[1:].tolist()) for i in range(tree.size)}
    left_out = [p + (t,) for p in taken for t in _toy_children(p)[0] if p + (t,) not in taken]
    if left_out:
        assert tree.num_draft_nodes == max_nodes
        assert max(score(p) for p in left_out) <= min(tree.scores) + 1e-12


@settings(max_examples=40, deadline=None)
@given(max_nodes=st.integers(0, 12), min_score=st.floats(0.0, 1.0))
def test_grow_best_first_with_a_floor_is_the_unfloored_tree_cut_at_the_floor(max_nodes, min_score):
    """The floor only stops growth: the tree is the unfloored one's nodes scoring >= min_score (a
    prefix of its taken order), and fewer nodes are expanded."""

    def grow(floor):
        paths, expanded = {}, []

        def expand(node, parent, token):
            expanded.append(node)
            paths[node] = () if parent < 0 else paths[parent] + (token,)
            return _toy_children(paths[node])

        tree, index = grow_best_first(0, expand, max_nodes, min_score=floor)
        taken = [tuple(tree.path_tokens(int(i))[1:].tolist()) for i in index]
        return taken, tree.scores[index], len(expanded)

    full_taken, full_scores, full_expanded = grow(0.0)
    cut_taken, cut_scores, cut_expanded = grow(min_score)
    keep = 1 + int((full_scores[1:] >= min_score).sum())  # taken in order of falling score
    assert cut_taken == full_taken[:keep]
    assert (cut_scores[1:] >= min_score).all() and cut_expanded <= full_expanded


# ---------------------------------------------------------------------- the drafter on toy inputs
def _feedback(tree, accepted, context_before, new_tokens, node_logits, prefill=False) -> StepFeedback:
    return StepFeedback(
        tree=tree,
        accepted=np.asarray(accepted, dtype=np.int64),
        new_tokens=np.asarray(new_tokens, dtype=np.int64),
        node_logits=node_logits,
        mask_logits=None,
        context=np.concatenate([context_before, new_tokens]).astype(np.int64),
        is_prefill=prefill,
    )


def test_hybrid_merges_sources_into_one_tree_and_calibrates():
    d = HybridDrafter(budget=8, num_masks=0, max_ngram=3)  # 7 draft nodes
    prompt = np.array([1, 2, 3, 4, 1, 2])
    d.start(prompt)
    # prefill (root 2): the model's distribution after (1, 2) puts 0.7 on 3 and 0.2 on 5
    d.observe(_feedback(TokenTree.root_only(2), [0], prompt, [3], _logits([{3: 0.7, 5: 0.2}]), prefill=True))
    context = np.append(prompt, 3)
    tree = d.propose(3, context)
    paths = {tuple(tree.path_tokens(i)[1:].tolist()): i for i in range(tree.size)}
    # the context lookup copies the passage after (1, 2, 3) as a chain; at (.., 1, 2) the successor
    # table (3: 0.7) and the context (3) agree, and the table adds 5 as an alternative
    assert {(4,), (4, 1), (4, 1, 2), (4, 1, 2, 3), (4, 1, 2, 5)} <= set(paths)
    assert tree.size == 8
    for i in range(tree.size):  # one node per token below a parent
        kids = tree.tokens[tree.children(i)].tolist()
        assert len(kids) == len(set(kids))
    # the verifier takes 4 and 1, then says 8 where the tree had 2
    rows = [{9: 0.5}] * tree.size
    rows[0], rows[paths[(4,)]], rows[paths[(4, 1)]] = {4: 0.9}, {1: 0.8}, {8: 0.6}
    trials, hits = d.calibrator.trials["ngram"].sum(), d.calibrator.hits["ngram"].sum()
    accepted = [0, paths[(4,)], paths[(4, 1)]]
    d.observe(_feedback(tree, accepted, context, [4, 1, 8], _logits(rows)))
    # the three accepted nodes' context proposals (4, 1, 2) were scored: two were right
    assert d.calibrator.trials["ngram"].sum() - trials == 3
    assert d.calibrator.hits["ngram"].sum() - hits == 2
    assert d.calibrator.trials["succ"].sum() == 0  # no successor proposal was tested
    # the successor table learnt from every verified node: the rejected node (.., 1, 2) too
    assert d.successors.lookup((4, 1, 2))[1][0][0] == 9
    assert d.successors.lookup((3, 4, 1))[1][0][0] == 8


def test_hybrid_scores_no_stale_proposal_after_a_skipped_one():
    """A batched step that skips drafting verifies the root alone; the proposals of the tree before
    were made for another position and must not be scored against that step's token."""
    d = HybridDrafter(budget=8, num_masks=0, max_ngram=3)
    prompt = np.array([1, 2, 3, 4, 1, 2])
    d.start(prompt)
    d.observe(_feedback(TokenTree.root_only(2), [0], prompt, [3], _logits([{3: 0.7, 5: 0.2}]), prefill=True))
    context = np.append(prompt, 3)
    d.propose(3, context)  # the context proposes 4 after the root
    trials = {s: d.calibrator.trials[s].sum() for s in d.calibrator.trials}
    d.skip_proposal()
    d.observe(_feedback(TokenTree.root_only(3), [0], context, [4], _logits([{4: 0.9}])))
    assert {s: d.calibrator.trials[s].sum() for s in d.calibrator.trials} == trials
    # without the skip the same feedback scores the stale proposal at the root
    d.propose(3, context)
    d.observe(_feedback(TokenTree.root_only(3), [0], context, [4], _logits([{4: 0.9}])))
    assert d.calibrator.trials["ngram"].sum() > trials["ngram"]


def test_hybrid_learns_the_same_from_the_decoders_row_tops_as_from_the_logits():
    prompt = np.array([1, 2, 3, 4, 1, 2])
    drafters = [HybridDrafter(budget=8, max_ngram=3) for _ in range(2)]
    assert drafters[0].node_top_k == drafters[0].successors.top_k == 8
    for given_tops, d in zip((False, True), drafters):
        d.start(prompt)
        d.observe(_feedback(TokenTree.root_only(2), [0], prompt, [3], _logits([{3: 0.7, 5: 0.2}]), prefill=True))
        context = np.append(prompt, 3)
        tree = d.propose(3, context)
        logits = _logits([{9: 0.5, int(t) % 7: 0.3} for t in tree.tokens])
        fb = _feedback(tree, [0], context, [9], logits)
        if given_tops:
            fb.node_tops = RowTops.of(logits, d.node_top_k)
        d.observe(fb)
    for mine, theirs in zip(drafters[0].successors._tables, drafters[1].successors._tables):
        assert np.array_equal(mine.tokens, theirs.tokens) and np.array_equal(mine.probs, theirs.probs)
        assert np.array_equal(mine.width, theirs.width)


def test_hybrid_mask_source_proposes_the_first_level():
    d = HybridDrafter(budget=12, num_masks=1)  # 10 draft nodes, one mask on one of them
    d.start(np.array([3]))
    fb = _feedback(TokenTree.root_only(3), [0], np.array([3]), [3], _logits([{3: 0.9}]), prefill=True)
    fb.mask_logits = _logits([{7: 0.95, 3: 0.04}])  # the mask guesses the token after the next
    d.observe(fb)
    tree = d.propose(3, np.array([3, 3]))
    assert 7 in tree.tokens[tree.children(0)].tolist()
    assert d.mask_owners(tree).tolist() == [0]
    assert tree.size + d.num_masks * 1 <= d.budget  # the pass's inputs: nodes + the root's mask
    root_proposals = d._proposals[0]
    assert root_proposals[7][MASK] >= 0
    # the mask's repeat of the root token is pruned; the successor table still proposes 3
    assert root_proposals[3][MASK] == -1 and root_proposals[3][SUCC] >= 0


def test_hybrid_budget_masks_and_registration():
    assert "hybrid" in DRAFTERS
    # masks on one node by default: budget - 1 - k draft nodes; on every node: budget // (k+1) - 1
    for k, budget, nodes in [(0, 32, 31), (1, 32, 30), (2, 30, 27)]:
        d = make_drafter(ProbeConfig(drafter="hybrid", num_masks=k, budget=budget))
        assert isinstance(d, HybridDrafter) and d.num_masks == k and d.max_nodes == nodes
    assert HybridDrafter(32, 1, mask_nodes=None).max_nodes == 15
    assert HybridDrafter(32, 2, mask_nodes=3).max_nodes == 25
    with pytest.raises(ValueError, match="num_masks"):
        ProbeConfig(drafter="esp", num_masks=0)  # only the hybrid runs without masks
    with pytest.raises(ValueError, match="too small"):
        ProbeConfig(drafter="hybrid", num_masks=1, budget=3)
    with pytest.raises(ValueError, match="too small"):
        HybridDrafter(4, 2, mask_nodes=2)
    with pytest.raises(ValueError, match="mask_nodes"):
        HybridDrafter(30, 1, mask_nodes=0)
    with pytest.raises(ValueError, match="learn_from"):
        HybridDrafter(30, learn_from="some")
    d = HybridDrafter(budget=6)
    d.start(np.array([4]))
    assert d.propose(4, np.array([4])).size == 1  # nothing known yet: a root-only tree
    d.budget = 3  # an adaptive budget may change it between steps
    assert d.max_nodes == 2


def test_hybrid_masks_go_to_the_root_then_the_likeliest_deepest_accepted_nodes():
    # root 0 -> 1 (score 0.9) -> 3 (0.3); root -> 2 (0.05): the chance that each node is the
    # deepest accepted one is 0.05, 0.6, 0.05, 0.3
    tree = TokenTree(np.array([5, 6, 8, 7]), np.array([-1, 0, 0, 1]), np.array([1.0, 0.9, 0.05, 0.3]))
    assert HybridDrafter(30, 1, mask_nodes=1).mask_owners(tree).tolist() == [0]
    assert HybridDrafter(30, 1, mask_nodes=2).mask_owners(tree).tolist() == [0, 1]
    assert HybridDrafter(30, 1, mask_nodes=3).mask_owners(tree).tolist() == [0, 1, 3]
    assert HybridDrafter(30, 1, mask_nodes=4).mask_owners(tree).tolist() == [0, 1, 2, 3]
    assert HybridDrafter(30, 1, mask_nodes=None).mask_owners(tree) is None


def test_a_batched_step_caps_the_tree_to_its_best_nodes():
    """``node_cap`` (set by a batched step: what fits a row's part of the pass) stops the growth at
    the tree's best nodes, the same ones the uncapped tree starts with."""
    d = HybridDrafter(budget=8, num_masks=0, max_ngram=3)
    prompt = np.array([1, 2, 3, 4, 1, 2])
    d.start(prompt)
    d.observe(_feedback(TokenTree.root_only(2), [0], prompt, [3], _logits([{3: 0.7, 5: 0.2}]), prefill=True))
    context = np.append(prompt, 3)
    whole = d.propose(3, context)
    d.node_cap = 3
    assert d.node_limit == 3
    capped = d.propose(3, context)
    assert whole.size == 8 and capped.size == 4
    assert np.array_equal(capped.tokens, whole.tokens[:4]) and np.array_equal(capped.parents, whole.parents[:4])
    d.node_cap = 0
    assert d.propose(3, context).size == 1  # the root alone
    d.node_cap = 50
    assert d.node_limit == d.max_nodes == 7
