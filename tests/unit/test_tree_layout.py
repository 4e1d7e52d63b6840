"""Property tests for the ESP input layout (``esp_layout``) and the prefill layout, checked
against the ESP layout's rules (tree/layout.py) written out as brute-force loops."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tree_strategies import bfs_trees

from probe_mtp.tree import TokenTree, block_complexity, chain, esp_layout, prefill_layout

FAST = settings(max_examples=150, deadline=None)


def ancestors_or_self(tree: TokenTree, i: int) -> set[int]:
    out = {i}
    while tree.parents[i] >= 0:
        i = int(tree.parents[i])
        out.add(i)
    return out


def expected_layout(tree: TokenTree, k: int, owners=None):
    """The layout written out from the rules: input order, owners, visibility, offsets."""
    n = tree.size
    owners = range(n) if owners is None else owners
    order = [(b, 0) for b in range(n)] + [(b, j) for b in owners for j in range(1, k + 1)]
    index = {key: q for q, key in enumerate(order)}
    total = len(order)
    visible = np.zeros((total, total), dtype=bool)
    offsets = np.zeros(total, dtype=np.int64)
    for q, (b, j) in enumerate(order):
        seen = set(ancestors_or_self(tree, b))  # a node sees its ancestors and itself
        if j > 0:  # mask j of owner b: what b sees, plus b, plus b's masks 1..j
            seen |= {index[(b, jj)] for jj in range(1, j + 1)}
        visible[q, sorted(seen)] = True
        offsets[q] = tree.depths[b] + j
    return order, visible, offsets


def _owners(data, tree: TokenTree):
    """None (masks on every node) or an increasing subset of the tree's nodes."""
    if data.draw(st.booleans()):
        return None
    return sorted(data.draw(st.sets(st.integers(0, tree.size - 1))))


@FAST
@given(tree=bfs_trees(), k=st.integers(0, 3), data=st.data())
def test_esp_layout_matches_rules(tree, k, data):
    owners = _owners(data, tree)
    lay = esp_layout(tree, k, owners)
    n = tree.size
    m = n if owners is None else len(owners)
    N = n + m * k
    assert lay.num_inputs == N
    if owners is None:
        assert N == block_complexity(n, k)
    assert lay.tree_size == n and lay.num_masks == k
    assert lay.visible.shape == (N, N) and lay.visible.dtype == bool

    order, visible, offsets = expected_layout(tree, k, owners)
    # order of inputs: root, nodes breadth-first, then masks grouped by owner in owner order
    assert lay.owner.tolist() == [b for b, _ in order]
    assert lay.mask_index.tolist() == [j for _, j in order]
    assert lay.is_mask.tolist() == [j > 0 for _, j in order]
    assert np.array_equal(lay.visible, visible)
    assert lay.position_offsets.tolist() == offsets.tolist()
    for r, b in enumerate(range(n) if owners is None else owners):
        assert lay.mask_slots(b).tolist() == [n + r * k + (j - 1) for j in range(1, k + 1)]
    if owners is not None:
        for b in set(range(n)) - set(owners):
            assert lay.mask_slots(b).size == 0


@FAST
@given(tree=bfs_trees(), k=st.integers(0, 3), data=st.data())
def test_esp_layout_attention_rules_individually(tree, k, data):
    """The same rules, each stated on its own (so a failure names the rule that broke)."""
    owners = _owners(data, tree)
    lay = esp_layout(tree, k, owners)
    n = tree.size
    vis = lay.visible
    is_mask = lay.mask_index > 0
    anc = [ancestors_or_self(tree, i) for i in range(n)]
    for i in range(n):
        # node i sees exactly its ancestors and itself, and no mask
        assert set(np.flatnonzero(vis[i]).tolist()) == anc[i]
        assert not vis[i, is_mask].any()
        assert lay.position_offsets[i] == tree.depths[i]
    for b in range(n):
        slots = lay.mask_slots(b)
        assert slots.size == (k if owners is None or b in owners else 0)
        assert lay.owner[slots].tolist() == [b] * slots.size
        assert lay.mask_index[slots].tolist() == list(range(1, slots.size + 1))
        for j, q in enumerate(slots.tolist(), start=1):
            row = vis[q]
            # what b sees plus b itself (b is in its own row)
            assert np.array_equal(row[:n], vis[b, :n])
            assert row[b]
            # its own masks 1..j, not j+1..k
            assert row[slots[:j]].all()
            assert not row[slots[j:]].any()
            # never another owner's masks
            others = is_mask & (lay.owner != b)
            assert not row[others].any()
            assert lay.position_offsets[q] == tree.depths[b] + j
    # a query never sees a key at a later position: every visible key is at an offset <= its own
    qpos, kpos = np.nonzero(vis)
    assert np.all(lay.position_offsets[kpos] <= lay.position_offsets[qpos])
    # every row sees at least itself
    assert np.all(np.diag(vis))


def test_esp_layout_rejects_bad_owners():
    tree = chain(5, [1, 2])
    for bad in ([3], [1, 1], [2, 1], [-1]):
        with pytest.raises(ValueError, match="owners"):
            esp_layout(tree, 1, np.array(bad))


@FAST
@given(tree=bfs_trees(), k=st.integers(0, 3))
def test_esp_layout_arrays_read_only_and_shape_determined(tree, k):
    lay = esp_layout(tree, k)
    for arr in (lay.visible, lay.position_offsets, lay.owner, lay.mask_index):
        assert not arr.flags.writeable
    # the layout depends on the shape only: other tokens and scores give the same layout
    other = TokenTree(tree.tokens + 1, tree.parents, np.full(tree.size, 0.5))
    assert other.shape_key == tree.shape_key
    lay2 = esp_layout(other, k)
    assert np.array_equal(lay.visible, lay2.visible)
    assert np.array_equal(lay.position_offsets, lay2.position_offsets)


@FAST
@given(p=st.integers(1, 24), k=st.integers(0, 5))
def test_prefill_layout(p, k):
    lay = prefill_layout(p, k)
    N = p + k
    assert lay.num_inputs == N
    vis = lay.visible
    assert vis.shape == (N, N) and vis.dtype == bool
    # causal over the prompt
    assert np.array_equal(vis[:p, :p], np.tril(np.ones((p, p), dtype=bool)))
    assert not vis[:p, p:].any()
    # mask j sees the whole prompt and masks 1..j only
    for j in range(1, k + 1):
        row = vis[p + j - 1]
        assert row[:p].all()
        assert row[p : p + j].all()
        assert not row[p + j :].any()
    assert lay.position_offsets.tolist() == list(range(p)) + [p - 1 + j for j in range(1, k + 1)]
    assert lay.mask_slots(p - 1).tolist() == list(range(p, p + k))
    assert lay.owner[p:].tolist() == [p - 1] * k
    assert lay.mask_index.tolist() == [0] * p + list(range(1, k + 1))
    for arr in (lay.visible, lay.position_offsets, lay.owner, lay.mask_index):
        assert not arr.flags.writeable


@FAST
@given(p=st.integers(1, 10), k=st.integers(0, 4))
def test_prefill_masks_agree_with_chain_layout_of_masks(p, k):
    """The prefill masks follow the same rule as a tree's masks: the masks of the last prompt token
    in ``prefill_layout`` see what the masks of the deepest node of a chain see in ``esp_layout``."""
    pre = prefill_layout(p, k)
    lay = esp_layout(chain(0, list(range(1, p))), k)
    tail = lay.mask_slots(p - 1)
    sub = np.concatenate([np.arange(p), tail])
    assert np.array_equal(pre.visible, lay.visible[np.ix_(sub, sub)])
    assert pre.position_offsets.tolist() == lay.position_offsets[sub].tolist()


def test_esp_layout_hand_example():
    # root 0 with children 1, 2; node 3 under 1; k = 2
    tree = TokenTree(np.array([10, 11, 12, 13]), np.array([-1, 0, 0, 1]), np.ones(4))
    lay = esp_layout(tree, 2)
    assert lay.num_inputs == 12
    # inputs: 0..3 nodes; masks: (0,1)=4 (0,2)=5 (1,1)=6 (1,2)=7 (2,1)=8 (2,2)=9 (3,1)=10 (3,2)=11
    assert lay.owner.tolist() == [0, 1, 2, 3, 0, 0, 1, 1, 2, 2, 3, 3]
    assert lay.mask_index.tolist() == [0, 0, 0, 0, 1, 2, 1, 2, 1, 2, 1, 2]
    assert lay.position_offsets.tolist() == [0, 1, 1, 2, 1, 2, 2, 3, 2, 3, 3, 4]
    rows = {q: np.flatnonzero(lay.visible[q]).tolist() for q in range(12)}
    assert rows == {
        0: [0],
        1: [0, 1],
        2: [0, 2],
        3: [0, 1, 3],
        4: [0, 4],
        5: [0, 4, 5],
        6: [0, 1, 6],
        7: [0, 1, 6, 7],
        8: [0, 2, 8],
        9: [0, 2, 8, 9],
        10: [0, 1, 3, 10],
        11: [0, 1, 3, 10, 11],
    }
    assert lay.mask_slots(3).tolist() == [10, 11]


def test_prefill_layout_hand_example():
    lay = prefill_layout(3, 2)
    assert lay.visible.astype(int).tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ]
    assert lay.position_offsets.tolist() == [0, 1, 2, 3, 4]


def test_layout_rejects_negative_masks():
    tree = TokenTree.root_only(1)
    with pytest.raises(ValueError):
        esp_layout(tree, -1)
    with pytest.raises(ValueError):
        prefill_layout(0, 1)
    with pytest.raises(ValueError):
        prefill_layout(3, -1)
