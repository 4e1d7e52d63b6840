"""Property tests for the torch attention masks built from a layout: full-attention (cache + block),
sliding-window (checked against a brute-force loop) and the additive float form."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tree_strategies import bfs_trees

from probe_mtp.tree import (
    TokenTree,
    additive_mask,
    esp_layout,
    full_attention_mask,
    prefill_layout,
    sliding_attention_mask,
)

FAST = settings(max_examples=120, deadline=None)


@st.composite
def layouts(draw):
    tree = draw(bfs_trees(max_depth=3, max_width=3))
    return esp_layout(tree, draw(st.integers(0, 3)))


def bools(draw, n):
    return torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool)


# ---------------------------------------------------------------------------- full attention
@FAST
@given(lay=layouts(), past=st.integers(0, 12), data=st.data(), as_tensor=st.booleans())
def test_full_attention_mask(lay, past, data, as_tensor):
    n = lay.num_inputs
    past_visible = bools(data.draw, past) if data.draw(st.booleans()) else None
    block = torch.from_numpy(lay.visible.copy()) if as_tensor else lay.visible
    m = full_attention_mask(block, past, past_visible=past_visible)
    assert m.shape == (1, 1, n, past + n)
    assert m.dtype == torch.bool
    m = m[0, 0]
    if past_visible is None:
        assert m[:, :past].all()
    else:
        assert torch.equal(m[:, :past], past_visible[None, :].expand(n, past))
    assert np.array_equal(m[:, past:].numpy(), lay.visible)
    # every row sees at least one key (its own input), even with all of the cache masked
    assert m.any(dim=-1).all()


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 12), k=st.integers(0, 4))
def test_full_attention_mask_prefill_is_causal(p, k):
    lay = prefill_layout(p, k)
    m = full_attention_mask(lay.visible, 0)
    assert torch.equal(m[0, 0], torch.tril(torch.ones(p + k, p + k, dtype=torch.bool)))


# ---------------------------------------------------------------------------- additive
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@settings(max_examples=40, deadline=None)
@given(lay=layouts(), past=st.integers(0, 6))
def test_additive_mask(dtype, lay, past):
    m = full_attention_mask(lay.visible, past)
    a = additive_mask(m, dtype)
    assert a.dtype == dtype and a.shape == m.shape
    assert torch.all(a[m] == 0)
    assert torch.all(a[~m] == torch.finfo(dtype).min)
    assert torch.isfinite(a).all()


def test_additive_mask_hand_example():
    m = torch.tensor([[True, False], [False, True]])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = additive_mask(m, dtype)
        lo = torch.finfo(dtype).min
        assert a.tolist() == [[0.0, lo], [lo, 0.0]]


# ---------------------------------------------------------------------------- sliding window
def brute_sliding(visible, positions, kv_offset, cached, window, past_visible):
    n = len(positions)
    out = np.zeros((n, cached + n), dtype=bool)
    for q in range(n):
        qp = positions[q]
        for c in range(cached):
            p = kv_offset + c
            ok = p > qp - window
            if past_visible is not None:
                ok = ok and bool(past_visible[c])
            out[q, c] = ok
        for kv in range(n):
            out[q, cached + kv] = bool(visible[q, kv]) and positions[kv] > qp - window
    return out


@FAST
@given(
    lay=layouts(),
    kv_offset=st.integers(0, 20),
    cached=st.integers(0, 12),
    window=st.integers(1, 16),
    root_shift=st.integers(-3, 3),
    data=st.data(),
)
def test_sliding_attention_mask_matches_brute_force(lay, kv_offset, cached, window, root_shift, data):
    n = lay.num_inputs
    # the root normally sits right after the cache; also try positions around that
    p0 = max(0, kv_offset + cached + root_shift)
    positions = torch.from_numpy(lay.position_offsets.copy()) + p0
    past_visible = bools(data.draw, cached) if data.draw(st.booleans()) else None
    m = sliding_attention_mask(lay.visible, positions, kv_offset, cached + n, window, past_visible=past_visible)
    assert m.shape == (1, 1, n, cached + n) and m.dtype == torch.bool
    expected = brute_sliding(lay.visible, positions.tolist(), kv_offset, cached, window, past_visible)
    assert np.array_equal(m[0, 0].numpy(), expected)
    # the window only removes keys: never more than the full mask
    full = full_attention_mask(lay.visible, cached, past_visible=past_visible)[0, 0]
    assert not (m[0, 0] & ~full).any()
    # every row still sees itself
    assert m[0, 0, :, cached:].diagonal().all()


@settings(max_examples=60, deadline=None)
@given(lay=layouts(), cached=st.integers(0, 10), kv_offset=st.integers(0, 10))
def test_sliding_with_huge_window_equals_full(lay, cached, kv_offset):
    n = lay.num_inputs
    positions = torch.from_numpy(lay.position_offsets.copy()) + kv_offset + cached
    m = sliding_attention_mask(lay.visible, positions, kv_offset, cached + n, window=10_000)
    assert torch.equal(m, full_attention_mask(lay.visible, cached))


def test_sliding_attention_mask_hand_example():
    # chain root -> a, k = 0; cache holds positions 5, 6, 7; root at 8, a at 9; window 3:
    # root (q=8) sees p > 5: 6, 7, 8; a (q=9) sees p > 6: 7, 8, 9
    tree = TokenTree(np.array([1, 2]), np.array([-1, 0]), np.ones(2))
    lay = esp_layout(tree, 0)
    m = sliding_attention_mask(lay.visible, torch.tensor([8, 9]), kv_offset=5, kv_length=5, window=3)
    assert m[0, 0].tolist() == [
        [False, True, True, True, False],
        [False, False, True, True, True],
    ]
