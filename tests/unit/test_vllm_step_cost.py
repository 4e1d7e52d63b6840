"""probe_mtp.vllm.step_cost on toy numbers (no vLLM needed): the fitted line recovers the step cost
it is fed, leans on its prior only while the widths give no slope, and the cut keeps a prefix of
every chain that gives the batch the best expected tokens per second among all such cuts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from probe_mtp.vllm.step_cost import PRIOR_SLOPE, StepCosts, cut_chains


def test_the_line_recovers_the_step_cost_it_is_fed():
    rng = np.random.default_rng(0)
    costs = StepCosts()
    for _ in range(400):
        tokens = int(rng.integers(1, 10))
        costs.record(tokens, 0.060 + 0.002 * tokens + rng.normal(0, 0.001))
    fixed, per_token = costs.line()
    assert fixed == pytest.approx(0.060, rel=0.03)
    assert per_token == pytest.approx(0.002, rel=0.1)


def test_without_a_spread_of_widths_the_slope_is_the_prior():
    costs = StepCosts()
    assert costs.line() is None
    for _ in range(50):
        costs.record(1, 0.05)
    fixed, per_token = costs.line()
    assert per_token == pytest.approx(PRIOR_SLOPE * 0.05)
    assert fixed + per_token == pytest.approx(0.05)


def test_the_window_keeps_the_latest_steps():
    costs = StepCosts(window=8)
    for tokens in range(1, 100):
        costs.record(tokens % 5 + 1, 1.0)
    assert len(costs) == 8
    costs.record(0, 1.0)
    costs.record(3, -1.0)  # nothing verified / a clock that went back: ignored
    assert len(costs) == 8


def test_free_tokens_are_all_kept_and_dear_ones_none():
    chains = [[0.9, 0.5, 0.1], [0.3], []]
    assert cut_chains(chains, 0.05, 0.0) == [3, 1, 0]
    assert cut_chains(chains, 0.05, 1.0) == [0, 0, 0]
    # one row, a step of 60 ms and 2 ms a token: a token pays when p > 0.002 s * the rate so far
    # (after 0.9, 0.5, 0.1: 2.5 tokens in 0.068 s, so p must exceed 0.0735)
    assert cut_chains([[0.9, 0.5, 0.1, 0.04, 0.03]], 0.060, 0.002) == [3]
    assert cut_chains([[0.9, 0.5, 0.1, 0.08, 0.03]], 0.060, 0.002) == [4]


def _rate(chains, keep, fixed, per_token, base):
    expected = len(chains) + sum(sum(chain[:k]) for chain, k in zip(chains, keep))
    return expected / (fixed + per_token * (base + sum(keep)))


chain = st.lists(st.floats(0.0, 1.0), max_size=4).map(lambda ps: list(np.cumprod(sorted(ps, reverse=True))))


@settings(max_examples=300, deadline=None)
@given(st.lists(chain, min_size=1, max_size=3), st.floats(0.001, 1.0), st.floats(0.0, 0.5), st.integers(0, 3))
def test_the_cut_is_the_best_prefix_cut(chains, fixed, per_token, masks):
    base = len(chains) + masks
    keep = cut_chains(chains, fixed, per_token, base=base)
    assert all(0 <= k <= len(c) for k, c in zip(keep, chains))
    best = max(_rate(chains, cut, fixed, per_token, base)
               for cut in itertools.product(*(range(len(c) + 1) for c in chains)))
    assert _rate(chains, keep, fixed, per_token, base) == pytest.approx(best, rel=1e-9, abs=1e-12)
