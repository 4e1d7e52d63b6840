"""The block reductions of probe_mtp.vocab against torch's own argmax and topk."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probe_mtp.vocab import BLOCK, RowTops, top_probabilities, vocab_argmax, vocab_topk


def _logits(seed: int, rows: int, vocab: int, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 4
    if ties:  # few distinct values: many ties, the maximum repeated across blocks
        x = x.round()
    return x


@pytest.mark.cpu_only  # the block reduction is the CPU path (accelerators call torch directly)
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5), blocks=st.sampled_from([8, 64, 300]),
       extra=st.sampled_from([0, 0, 7]), ties=st.booleans())
def test_vocab_argmax_is_torch_argmax_including_first_of_ties(seed, rows, blocks, extra, ties):
    x = _logits(seed, rows, blocks * BLOCK + extra, ties)
    assert torch.equal(vocab_argmax(x), x.argmax(dim=-1))


@pytest.mark.cpu_only  # the block reduction is the CPU path (accelerators call torch directly)
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5), blocks=st.sampled_from([8, 64, 300]),
       extra=st.sampled_from([0, 0, 7]), k=st.integers(1, 12), ties=st.booleans())
def test_vocab_topk_has_torch_topk_values_and_valid_indices(seed, rows, blocks, extra, k, ties):
    x = _logits(seed, rows, blocks * BLOCK + extra, ties)
    values, indices = vocab_topk(x, k)
    expected = torch.topk(x, min(k, x.shape[-1]), dim=-1)
    assert torch.equal(values, expected.values)
    assert torch.equal(x.gather(1, indices), values)  # the indices point at those values
    assert all(len(set(r.tolist())) == r.numel() for r in indices)  # distinct tokens
    if not ties:
        assert torch.equal(indices, expected.indices)


@pytest.mark.cpu_only  # the block reduction is the CPU path (accelerators call torch directly)
def test_vocab_argmax_keeps_the_nan_convention_and_works_on_row_views():
    x = _logits(0, 3, 64 * BLOCK, False)
    x[1, 100] = float("nan")
    assert torch.equal(vocab_argmax(x), x.argmax(dim=-1))
    assert int(vocab_argmax(x[2:3])[0]) == int(x[2].argmax())


def test_top_probabilities_match_the_softmax():
    x = _logits(1, 4, 64 * BLOCK, False)
    tokens, probs = top_probabilities(x, 5)
    full = torch.softmax(x, dim=-1)
    assert torch.equal(tokens, torch.topk(full, 5, dim=-1).indices)
    assert torch.allclose(probs, full.gather(1, tokens))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_top_probabilities_of_half_precision_logits(dtype):
    x = _logits(2, 2, 64 * BLOCK, False).to(dtype)
    tokens, probs = top_probabilities(x, 3)
    assert probs.dtype == torch.float32 and torch.allclose(probs, torch.softmax(x.float(), -1).gather(1, tokens))


def test_top_probabilities_in_row_chunks_are_the_whole_softmax():
    x = _logits(3, 11, 8 * BLOCK, False)
    tokens, probs = top_probabilities(x, 4, rows_per_call=3)
    assert torch.equal(probs, torch.softmax(x, dim=-1).gather(1, tokens))


def _peaked(seed: int, rows: int, blocks: int, spikes: int) -> torch.Tensor:
    """Rows like a language model's: a low floor with a few tokens far above it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks * BLOCK, generator=g) * 2 - 20
    where = torch.randint(0, blocks * BLOCK, (rows, spikes), generator=g)
    return x.scatter_(1, where, torch.rand(rows, spikes, generator=g) * 12 - 4)


def test_row_tops_give_the_argmax_only_where_it_is_unique():
    x = _peaked(7, 4, 64, 6)
    x[1, 100] = x[1, 3000] = x[1].max() + 1  # a tie for the maximum
    x[2, 50] = float("nan")
    tops = RowTops.of(x, 3)
    assert tops.tokens.shape == (4, 3) and tops.probs.dtype == np.float64
    assert tops.argmax(0) == int(x[0].argmax()) and tops.argmax(3) == int(x[3].argmax())
    assert tops.argmax(1) is None and tops.argmax(2) is None
    assert RowTops.of(x, 1).argmax(0) is None  # one token kept: uniqueness unknown
