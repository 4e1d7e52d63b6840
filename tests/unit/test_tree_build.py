"""Property tests for tree construction: ``best_first`` (EAGLE-2-style dynamic trees with repeat
pruning) and ``chain``, checked against a brute-force enumeration of all legal paths."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from probe_mtp.tree import TokenTree, best_first, block_complexity, chain, node_budget

FAST = settings(max_examples=150, deadline=None)

VOCAB = 7  # small, so that repeats of the parent's token happen often


# ---------------------------------------------------------------------------- strategies
@st.composite
def candidates(draw, max_depths=3, max_cands=5, min_cands=0, allow_one=True):
    """Per-depth candidate lists as ``best_first`` expects them: distinct tokens per depth,
    distinct probabilities per depth, sorted by descending probability."""
    depths = draw(st.integers(0, max_depths))
    toks, probs = [], []
    prob_values = st.floats(0.01, 1.0 if allow_one else 0.99, allow_nan=False)
    for _ in range(depths):
        c = draw(st.integers(min_cands, max_cands))
        t = draw(st.lists(st.integers(0, VOCAB - 1), min_size=c, max_size=c, unique=True))
        p = draw(st.lists(prob_values, min_size=c, max_size=c, unique=True))
        p = sorted(p, reverse=True)
        toks.append(np.array(t, dtype=np.int64))
        probs.append(np.array(p, dtype=np.float64))
    return toks, probs


roots = st.integers(0, VOCAB - 1)


# ---------------------------------------------------------------------------- brute force
def all_legal_paths(root, toks, probs, prune):
    """Every path root -> c1 -> c2 -> ... (depth >= 1) drawing depth d's token from the depth-d
    candidates, with its score (product of probabilities, multiplied in path order from 1.0, as
    ``best_first`` does).  With ``prune`` a token equal to its parent's token is not allowed."""
    out = {}
    frontier = [((), root, 1.0)]
    for d in range(len(toks)):
        nxt = []
        for path, last, score in frontier:
            for t, p in zip(toks[d].tolist(), probs[d].tolist()):
                if prune and t == last:
                    continue
                s = score * p
                new = path + (t,)
                out[new] = s
                nxt.append((new, t, s))
        frontier = nxt
    return out


def tree_paths(tree: TokenTree) -> dict[tuple[int, ...], float]:
    """Token path (below the root) -> score, for every draft node."""
    return {tuple(tree.path_tokens(i)[1:].tolist()): float(tree.scores[i]) for i in range(1, tree.size)}


def assert_valid_tree(tree: TokenTree, root: int):
    assert tree.tokens[0] == root
    assert tree.parents[0] == -1
    n = tree.size
    # parents precede children, and the ordering is breadth-first (non-decreasing depth)
    assert np.all(tree.parents[1:] < np.arange(1, n))
    assert np.all(tree.parents[1:] >= 0)
    assert np.all(np.diff(tree.depths) >= 0)
    assert np.all(tree.depths[1:] == tree.depths[tree.parents[1:]] + 1)
    # ancestor-closed: every path's prefixes are themselves nodes (true by parent pointers, but
    # check on the token level too)
    paths = tree_paths(tree)
    for p in paths:
        for m in range(1, len(p)):
            assert p[:m] in paths
    # sibling tokens are distinct (so token paths identify nodes)
    for i in range(n):
        kids = tree.children(i)
        assert len(set(tree.tokens[kids].tolist())) == kids.size
    assert len(paths) == n - 1


# ---------------------------------------------------------------------------- properties
@FAST
@given(root=roots, cands=candidates(), max_nodes=st.integers(0, 9), prune=st.booleans())
def test_best_first_matches_brute_force_top_paths(root, cands, max_nodes, prune):
    toks, probs = cands
    tree = best_first(root, toks, probs, max_nodes, prune_repeats=prune)
    assert_valid_tree(tree, root)

    legal = all_legal_paths(root, toks, probs, prune)
    got = tree_paths(tree)
    # never more than max_nodes; exactly min(max_nodes, #legal paths)
    assert tree.num_draft_nodes <= max_nodes
    assert tree.num_draft_nodes == min(max_nodes, len(legal))
    # depth never exceeds the number of distributions given
    assert tree.max_depth <= len(toks)
    # every kept path is legal, and its score is the product of the per-depth probabilities
    for path, score in got.items():
        assert path in legal
        assert score == legal[path]
        expected = 1.0
        for d, t in enumerate(path):
            idx = int(np.flatnonzero(toks[d] == t)[0])
            expected *= float(probs[d][idx])
        assert score == pytest.approx(expected, rel=1e-12)
        if prune:
            full = (root,) + path
            assert all(a != b for a, b in zip(full, full[1:]))
    # the kept set is the top-max_nodes of all legal paths by score (tie-robust: the sorted
    # scores agree; where the cut is not a tie, the sets agree exactly)
    ranked = sorted(legal.values(), reverse=True)
    assert sorted(got.values(), reverse=True) == ranked[:max_nodes]
    if len(ranked) > max_nodes and max_nodes > 0 and ranked[max_nodes - 1] > ranked[max_nodes]:
        top = {p for p, s in legal.items() if s >= ranked[max_nodes - 1]}
        assert set(got) == top
    if len(ranked) <= max_nodes:
        assert set(got) == set(legal)


@FAST
@given(root=roots, cands=candidates(max_depths=4, max_cands=4), max_nodes=st.integers(0, 12))
def test_prune_repeats_replaces_by_next_best(root, cands, max_nodes):
    """With pruning no child repeats its parent's token, and the slot goes to the next-best
    candidate: the tree is what the brute force picks with repeats excluded, not a smaller one."""
    toks, probs = cands
    tree = best_first(root, toks, probs, max_nodes, prune_repeats=True)
    for i in range(1, tree.size):
        assert tree.tokens[i] != tree.tokens[tree.parents[i]]
    legal = all_legal_paths(root, toks, probs, prune=True)
    assert tree.num_draft_nodes == min(max_nodes, len(legal))


@FAST
@given(
    root=roots,
    cands=candidates(max_depths=3, max_cands=6),
    budget=st.integers(2, 40),
    k=st.integers(0, 4),
    prune=st.booleans(),
)
def test_best_first_respects_block_complexity_budget(root, cands, budget, k, prune):
    assume(budget >= 2 * (k + 1))
    toks, probs = cands
    max_nodes = node_budget(budget, k)
    tree = best_first(root, toks, probs, max_nodes, prune_repeats=prune)
    assert tree.num_draft_nodes <= max_nodes
    assert block_complexity(tree.size, k) <= budget


@FAST
@given(
    root=roots,
    cands=candidates(max_depths=4, max_cands=4),
    max_nodes=st.integers(0, 6),
    prune=st.booleans(),
)
def test_first_level_only_top1_is_chain_of_top1(root, cands, max_nodes, prune):
    toks, probs = cands
    tree = best_first(root, toks, probs, max_nodes, prune_repeats=prune, first_level_only_top1=True)
    assert_valid_tree(tree, root)
    # expected: at each depth the most probable candidate (first in the sorted list), skipping one
    # equal to the previous token when pruning; stop at the budget or when none is left
    expected_tokens, expected_scores = [], []
    last, score = root, 1.0
    for d in range(len(toks)):
        if len(expected_tokens) == max_nodes:
            break
        options = [(p, -r, t) for r, (t, p) in enumerate(zip(toks[d].tolist(), probs[d].tolist()))
                   if not (prune and t == last)]
        if not options:
            break
        p, _, t = max(options)
        score *= p
        expected_tokens.append(t)
        expected_scores.append(score)
        last = t
    assert tree.tokens.tolist() == [root] + expected_tokens
    assert tree.parents.tolist() == list(range(-1, len(expected_tokens)))
    assert tree.scores.tolist() == [1.0] + expected_scores
    assert tree.max_depth == len(expected_tokens) <= len(toks)


@FAST
@given(root=roots, cands=candidates(), max_nodes=st.integers(0, 9), prune=st.booleans())
def test_best_first_scores_never_increase_along_paths(root, cands, max_nodes, prune):
    toks, probs = cands
    tree = best_first(root, toks, probs, max_nodes, prune_repeats=prune)
    assert tree.scores[0] == 1.0
    assert np.all(tree.scores[1:] <= tree.scores[tree.parents[1:]])
    assert np.all(tree.scores[1:] > 0)


@settings(max_examples=60, deadline=None)
@given(root=roots, cands=candidates(), max_nodes=st.integers(0, 9), prune=st.booleans(),
       top1=st.booleans())
def test_best_first_accepts_lists_and_is_deterministic(root, cands, max_nodes, prune, top1):
    toks, probs = cands
    a = best_first(root, toks, probs, max_nodes, prune_repeats=prune, first_level_only_top1=top1)
    b = best_first(root, [t.tolist() for t in toks], [p.tolist() for p in probs], max_nodes,
                   prune_repeats=prune, first_level_only_top1=top1)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.parents.tolist() == b.parents.tolist()
    assert a.scores.tolist() == b.scores.tolist()


@FAST
@given(root=st.integers(0, 1000), tokens=st.lists(st.integers(0, 1000), max_size=10), data=st.data())
def test_chain_is_a_single_path(root, tokens, data):
    probs = data.draw(st.none() | st.lists(st.floats(0.01, 1.0), min_size=len(tokens), max_size=len(tokens)))
    tree = chain(root, tokens, probs)
    n = len(tokens)
    assert tree.size == n + 1
    assert tree.tokens.tolist() == [root] + tokens
    assert tree.parents.tolist() == list(range(-1, n))
    assert tree.depths.tolist() == list(range(n + 1))
    if probs is None:
        assert np.all(tree.scores == 1.0)
    else:
        assert tree.scores == pytest.approx(np.concatenate([[1.0], np.cumprod(probs)]))


# ---------------------------------------------------------------------------- hand-checked examples
def test_best_first_hand_example_with_pruning():
    # depth 1 from root 5: token 5 (0.6) repeats the root and is pruned -> 1 (0.3), 2 (0.1)
    # depth 2: under 1: 1 pruned, 3 = 0.12, 4 = 0.03; under 2: 1 = 0.05, 3 = 0.04, 4 = 0.01
    # top 3 of {0.3, 0.1, 0.12, 0.05, 0.04, 0.03, 0.01} = 1, 1->3, 2
    tree = best_first(5, [[5, 1, 2], [1, 3, 4]], [[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]], max_nodes=3)
    assert tree.tokens.tolist() == [5, 1, 2, 3]
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.scores == pytest.approx([1.0, 0.3, 0.1, 0.12])
    assert tree.depths.tolist() == [0, 1, 1, 2]


def test_best_first_hand_example_without_pruning():
    tree = best_first(5, [[5, 1, 2], [1, 3, 4]], [[0.6, 0.29, 0.1], [0.5, 0.4, 0.1]], max_nodes=3,
                      prune_repeats=False)
    # candidates: 0.6 (5), 0.30 (5->1), 0.29 (1), 0.24 (5->3), ...
    assert tree.tokens.tolist() == [5, 5, 1, 1]
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.scores == pytest.approx([1.0, 0.6, 0.29, 0.3])


def test_best_first_paper_static_equivalent_k1_bc10():
    # k = 1, BC = 10 -> 4 draft nodes; with one distribution: the top-4 depth-1 alternatives
    max_nodes = node_budget(10, 1)
    assert max_nodes == 4
    toks = [np.array([10, 11, 12, 13, 14, 15])]
    probs = [np.array([0.3, 0.2, 0.15, 0.1, 0.05, 0.01])]
    tree = best_first(0, toks, probs, max_nodes)
    assert tree.tokens.tolist() == [0, 10, 11, 12, 13]
    assert tree.parents.tolist() == [-1, 0, 0, 0, 0]
    assert block_complexity(tree.size, 1) == 10


def test_best_first_pruned_token_replaced_by_next_best():
    # root 3; depth-1 top token is 3 (a repeat): the 4 kept are the next four
    toks = [np.array([3, 4, 5, 6, 7])]
    probs = [np.array([0.5, 0.2, 0.1, 0.05, 0.01])]
    tree = best_first(3, toks, probs, 4)
    assert tree.tokens.tolist() == [3, 4, 5, 6, 7]
    tree = best_first(3, toks, probs, 4, prune_repeats=False)
    assert tree.tokens.tolist() == [3, 3, 4, 5, 6]


def test_first_level_only_top1_hand_example():
    tree = best_first(7, [[7, 3, 4], [3, 8], [9, 1]], [[0.5, 0.3, 0.2], [0.6, 0.4], [0.9, 0.1]],
                      max_nodes=10, first_level_only_top1=True)
    assert tree.tokens.tolist() == [7, 3, 8, 9]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.scores == pytest.approx([1.0, 0.3, 0.3 * 0.4, 0.3 * 0.4 * 0.9])


def test_best_first_stops_when_a_depth_is_all_repeats():
    # depth 2's only candidate repeats depth 1's token: the tree stops at depth 1
    tree = best_first(0, [[1], [1], [2]], [[0.9], [0.9], [0.9]], max_nodes=5)
    assert tree.tokens.tolist() == [0, 1]


def test_best_first_degenerate_inputs():
    assert best_first(4, [], [], 5).size == 1
    assert best_first(4, [[1, 2]], [[0.6, 0.4]], 0).size == 1
    assert best_first(4, [[]], [[]], 3).size == 1
    with pytest.raises(ValueError):
        best_first(4, [[1, 2]], [[0.6, 0.4]], -1)
    with pytest.raises(ValueError):
        best_first(4, [[1, 2]], [[0.6, 0.4], [0.5]], 2)
    with pytest.raises(ValueError):
        best_first(4, [[1, 2]], [[0.6]], 2)


def test_brute_force_helper_sanity():
    legal = all_legal_paths(5, [np.array([5, 1])], [np.array([0.6, 0.4])], prune=True)
    assert legal == {(1,): 0.4}
    legal = all_legal_paths(5, [np.array([5, 1]), np.array([1])], [np.array([0.6, 0.4]), np.array([0.5])],
                            prune=False)
    assert set(legal) == {(5,), (1,), (5, 1), (1, 1)}
    assert list(itertools.islice(sorted(legal.values(), reverse=True), 1)) == [0.6]


@st.composite
def tied_candidates(draw):
    """Candidates with exact ties, zero probabilities and any order (not the documented sorted
    input): the tree must still be valid and hold the best possible multiset of scores."""
    toks, probs = [], []
    for _ in range(draw(st.integers(0, 3))):
        c = draw(st.integers(0, 5))
        toks.append(np.array(draw(st.lists(st.integers(0, VOCAB - 1), min_size=c, max_size=c, unique=True)),
                             dtype=np.int64))
        probs.append(np.array(draw(st.lists(st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0]),
                                            min_size=c, max_size=c)), dtype=np.float64))
    return toks, probs


@FAST
@given(root=roots, cands=tied_candidates(), max_nodes=st.integers(0, 9), prune=st.booleans())
def test_best_first_with_ties_keeps_best_score_multiset(root, cands, max_nodes, prune):
    toks, probs = cands
    tree = best_first(root, toks, probs, max_nodes, prune_repeats=prune)
    assert_valid_tree(tree, root)
    legal = all_legal_paths(root, toks, probs, prune)
    got = tree_paths(tree)
    assert all(p in legal and legal[p] == s for p, s in got.items())
    assert sorted(got.values(), reverse=True) == sorted(legal.values(), reverse=True)[:max_nodes]
