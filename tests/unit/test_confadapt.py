"""ConfAdapt (acceptance="confadapt"), model-free: grafting the confident chain, the confident run,
the extension, and clear errors for bad knobs (the rule on SmolLM2 is in
tests/models/test_confadapt_on_smollm2.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe_mtp import ProbeConfig
from probe_mtp.confadapt import confident_run, extend_confident, graft_chain
from probe_mtp.tree import TokenTree


# --------------------------------------------------------------------------- pieces


def test_graft_chain_keeps_breadth_first_order():
    tree = TokenTree.from_paths(7, [[8, 9], [10]])
    full = graft_chain([5, 6], tree)
    assert full.tokens.tolist() == [5, 6] + tree.tokens.tolist()
    assert full.parents[:3].tolist() == [-1, 0, 1]
    assert full.parents[3:].tolist() == (tree.parents[1:] + 2).tolist()
    assert full.depths.tolist() == [0, 1] + (tree.depths + 2).tolist()
    assert graft_chain([], tree) is tree


def test_confident_run_counts_from_mask_one():
    logits = torch.full((3, 5), -20.0)
    logits[0, 1] = 20.0  # p ~ 1
    logits[1, 2] = 0.0  # uniform-ish: p ~ 0.2
    logits[1] = 0.0
    logits[2, 3] = 20.0  # confident, but after an unconfident mask: not emitted
    assert confident_run(logits, 0.9) == 1
    assert confident_run(logits, 0.1) == 3
    assert confident_run(logits, 1.01) == 0
    assert confident_run(None, 0.5) == 0


def test_extension_appends_the_confident_run_and_keeps_the_leftover_masks():
    logits = torch.full((2, 6), -20.0)
    logits[0, 4] = 20.0
    logits[1] = 0.0
    tokens, scores, rest, unverified = extend_confident(np.array([1, 2]), list(torch.zeros((2, 6)).split(1)), logits, 0.9)
    assert tokens.tolist() == [1, 2, 4] and unverified == 1
    assert len(scores) == 3 and scores[2].shape == (1, 6) and torch.equal(scores[2][0], logits[0])
    assert torch.equal(rest, logits[1:])
    tokens, _, rest, unverified = extend_confident(np.array([3]), None, logits[1:], 0.9)
    assert tokens.tolist() == [3] and unverified == 0 and rest is not None


@pytest.mark.parametrize(
    "knobs,words",
    [
        (dict(acceptance="nope"), "acceptance"),
        (dict(threshold=-0.1), "threshold"),
        (dict(threshold=float("nan")), "threshold"),
        (dict(acceptance="confadapt", drafter="pld"), "uses no masks"),
        (dict(masks=3), "masks"),
    ],
)
def test_bad_knobs_are_clear_errors(knobs, words):
    with pytest.raises((ValueError, TypeError), match=words):
        ProbeConfig(**knobs)
