"""Property tests for the TokenTree container and block-complexity accounting."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from probe_mtp.tree import TokenTree, block_complexity, min_block_complexity, node_budget

FAST = settings(max_examples=150, deadline=None)


# ---------------------------------------------------------------------------- strategies
@st.composite
def bfs_trees(draw, max_depth=4, max_width=4):
    """A valid breadth-first tree: level by level, each node's parent drawn from the level above."""
    root = draw(st.integers(0, 50))
    tokens, parents, scores = [root], [-1], [1.0]
    prev_level = [0]
    for _ in range(draw(st.integers(0, max_depth))):
        level = []
        for _ in range(draw(st.integers(1, max_width))):
            p = draw(st.sampled_from(prev_level))
            level.append(len(tokens))
            tokens.append(draw(st.integers(0, 50)))
            parents.append(p)
            scores.append(scores[p] * draw(st.floats(0.01, 1.0)))
        prev_level = level
    return TokenTree(np.array(tokens), np.array(parents), np.array(scores))


def brute_depth(parents, i):
    d = 0
    while parents[i] >= 0:
        i = parents[i]
        d += 1
    return d


# ---------------------------------------------------------------------------- TokenTree
@FAST
@given(tree=bfs_trees())
def test_tree_invariants_and_queries(tree):
    n = tree.size
    assert tree.num_draft_nodes == n - 1
    assert tree.parents[0] == -1 and tree.depths[0] == 0
    assert [brute_depth(tree.parents, i) for i in range(n)] == tree.depths.tolist()
    assert tree.max_depth == max(tree.depths.tolist())
    assert np.all(np.diff(tree.depths) >= 0)
    for i in range(n):
        path = tree.path(i)
        assert path[0] == 0 and path[-1] == i and len(path) == tree.depths[i] + 1
        assert np.all(tree.parents[path[1:]] == path[:-1])
        assert tree.path_tokens(i).tolist() == tree.tokens[path].tolist()
        kids = tree.children(i)
        assert kids.tolist() == [c for c in range(n) if tree.parents[c] == i]
    assert tree.shape_key == tuple(tree.parents.tolist())
    # arrays are read-only
    for arr in (tree.tokens, tree.parents, tree.scores, tree.depths):
        assert not arr.flags.writeable


@FAST
@given(tree=bfs_trees())
def test_ancestor_matrix_matches_paths(tree):
    anc = tree.ancestor_matrix()
    n = tree.size
    assert anc.shape == (n, n) and anc.dtype == bool
    expected = np.zeros((n, n), dtype=bool)
    for i in range(n):
        expected[i, tree.path(i)] = True
    assert np.array_equal(anc, expected)
    assert np.all(np.diag(anc))
    assert np.all(anc[:, 0])  # the root is everyone's ancestor
    assert not np.any(np.triu(anc, 1))  # ancestors precede descendants


@FAST
@given(tree=bfs_trees())
def test_to_networkx_is_arborescence_rooted_at_0(tree):
    g = tree.to_networkx()
    assert isinstance(g, nx.DiGraph)
    assert g.number_of_nodes() == tree.size
    assert nx.is_arborescence(g)
    assert g.in_degree(0) == 0
    assert set(g.edges()) == {(int(tree.parents[i]), i) for i in range(1, tree.size)}
    for i in range(tree.size):
        attrs = g.nodes[i]
        assert attrs["token"] == int(tree.tokens[i])
        assert attrs["depth"] == int(tree.depths[i])
        assert attrs["score"] == float(tree.scores[i])
        assert nx.shortest_path_length(g, 0, i) == tree.depths[i]


paths_strategy = st.lists(st.lists(st.integers(0, 3), max_size=4), max_size=6)


@FAST
@given(root=st.integers(0, 3), paths=paths_strategy, data=st.data(), with_scores=st.booleans())
def test_from_paths_merges_shared_prefixes(root, paths, data, with_scores):
    scores = None
    if with_scores:
        scores = [data.draw(st.lists(st.floats(0.0, 1.0), min_size=len(p), max_size=len(p))) for p in paths]
    tree = TokenTree.from_paths(root, paths, scores)

    prefixes = {tuple(p[:m]) for p in paths for m in range(1, len(p) + 1)}
    assert tree.size == 1 + len(prefixes)  # one node per distinct non-empty prefix, plus the root
    assert tree.tokens[0] == root and tree.scores[0] == 1.0
    # breadth-first, parents first
    assert np.all(np.diff(tree.depths) >= 0)
    assert np.all(tree.parents[1:] < np.arange(1, tree.size))
    node_of = {tuple(tree.path_tokens(i)[1:].tolist()): i for i in range(1, tree.size)}
    assert set(node_of) == prefixes  # distinct nodes have distinct token paths (siblings distinct)
    for pre, i in node_of.items():
        if scores is None:
            assert tree.scores[i] == 1.0
        else:
            best = max(scores[q][len(pre) - 1] for q, p in enumerate(paths)
                       if len(p) >= len(pre) and tuple(p[: len(pre)]) == pre)
            assert tree.scores[i] == best


def test_from_paths_hand_example():
    tree = TokenTree.from_paths(9, [[1, 2, 3], [1, 4], [5]], [[0.5, 0.2, 0.1], [0.6, 0.3], [0.4]])
    assert tree.tokens.tolist() == [9, 1, 5, 2, 4, 3]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3]
    assert tree.scores.tolist() == [1.0, 0.6, 0.4, 0.2, 0.3, 0.1]  # node "1" keeps the max, 0.6
    assert TokenTree.from_paths(9, []).size == 1
    assert TokenTree.from_paths(9, [[], [1]]).tokens.tolist() == [9, 1]


def test_root_only():
    t = TokenTree.root_only(17)
    assert t.size == 1 and t.max_depth == 0 and t.tokens.tolist() == [17]
    assert t.ancestor_matrix().tolist() == [[True]]
    assert nx.is_arborescence(t.to_networkx())


@pytest.mark.parametrize(
    "parents",
    [
        [0, 0],  # root's parent is not -1
        [-1, 1],  # a node is its own parent
        [-1, 0, 3, 0],  # parent after the child
        [-1, -1],  # a second root
        [-1, 0, -2],  # negative parent
        [-1, 0, 1, 0],  # depths 0,1,2,1: not breadth-first
        [-1, 0, 1, 2, 1],  # depths 0,1,2,3,2: not breadth-first
    ],
)
def test_constructor_rejects_bad_parents(parents):
    n = len(parents)
    with pytest.raises(ValueError):
        TokenTree(np.arange(n), np.array(parents), np.ones(n))


def test_constructor_rejects_bad_shapes():
    with pytest.raises(ValueError):
        TokenTree(np.array([], dtype=np.int64), np.array([], dtype=np.int64), np.array([]))
    with pytest.raises(ValueError):
        TokenTree(np.arange(3), np.array([-1, 0]), np.ones(3))
    with pytest.raises(ValueError):
        TokenTree(np.arange(3), np.array([-1, 0, 0]), np.ones(2))


@FAST
@given(data=st.data(), n=st.integers(1, 9))
def test_constructor_accepts_exactly_valid_bfs_parent_arrays(data, n):
    """Any parent array: accepted iff the root is first, parents precede children, and depths are
    non-decreasing; otherwise ValueError."""
    parents = [data.draw(st.integers(-2, n))] + [data.draw(st.integers(-2, n)) for _ in range(1, n)]
    valid = parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, n))
    if valid:
        depths = [brute_depth(parents, i) for i in range(n)]
        valid = all(a <= b for a, b in zip(depths, depths[1:]))
    if valid:
        t = TokenTree(np.arange(n), np.array(parents), np.ones(n))
        assert t.parents.tolist() == parents
    else:
        with pytest.raises(ValueError):
            TokenTree(np.arange(n), np.array(parents), np.ones(n))


# ---------------------------------------------------------------------------- budget
@FAST
@given(k=st.integers(0, 6), budget=st.integers(-5, 200))
def test_node_budget(k, budget):
    assert min_block_complexity(k) == 2 * (k + 1)
    if budget < 2 * (k + 1):
        with pytest.raises(ValueError, match="budget"):
            node_budget(budget, k)
        return
    b = node_budget(budget, k)
    assert b == budget // (k + 1) - 1
    assert b >= 1
    # the largest tree that fits: b draft nodes fit, b + 1 do not
    assert block_complexity(b + 1, k) <= budget
    assert block_complexity(b + 2, k) > budget


@FAST
@given(size=st.integers(1, 100), k=st.integers(0, 6))
def test_block_complexity(size, k):
    assert block_complexity(size, k) == (k + 1) * size


def test_budget_hand_examples():
    # the paper's static trees: BC=10 k=1 [4]; BC=30 k=1 [14]; BC=60 k=2 [15, 4]; BC=60 k=1 [29]
    assert node_budget(10, 1) == 4
    assert node_budget(30, 1) == 14
    assert node_budget(60, 2) == 19 == 15 + 4
    assert node_budget(60, 1) == 29
    assert block_complexity(1 + 15 + 4, 2) == 60
    assert min_block_complexity(0) == 2 and min_block_complexity(2) == 6
    assert node_budget(6, 2) == 1
    with pytest.raises(ValueError, match="budget"):
        node_budget(5, 2)
    with pytest.raises(ValueError):
        node_budget(10, -1)
    with pytest.raises(ValueError):
        block_complexity(0, 1)
    with pytest.raises(ValueError):
        block_complexity(3, -1)
