"""The adaptive budget, model-free: tree cutting, size choice, calibration (the cost curve itself
is in test_cost.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from probe_mtp.adaptive import AdaptiveBudget, BudgetState, DepthCalibration, FixedBudget, YieldCalibration, size_class
from probe_mtp.cost import CostCurve
from probe_mtp.tree import TokenTree, best_order, choose_node_count, esp_layout, keep_nodes, pad_layout, path_monotone

from tree_strategies import bfs_trees

FAST = settings(max_examples=100, deadline=None)
# the shape of a 2-core CPU's curve for SmolLM2 (ms): 2 inputs cost more than 4
CPU_CURVE = CostCurve.from_mapping({1: 57, 2: 91, 4: 80, 8: 78, 16: 90, 32: 117, 64: 174})
FLAT_CURVE = CostCurve.from_mapping({1: 10.0, 64: 10.5})


def scored(tree: TokenTree, values) -> TokenTree:
    return TokenTree(tree.tokens, tree.parents, np.asarray(values, dtype=np.float64))


@FAST
@given(bfs_trees(), st.data())
def test_path_monotone_and_best_order_are_prefix_closed(tree, data):
    values = np.array(data.draw(st.lists(st.floats(0, 1), min_size=tree.size, max_size=tree.size)))
    mono = path_monotone(tree, values)
    assert np.all(mono[1:] <= mono[tree.parents[1:]])
    assert np.all(mono <= values)
    order = best_order(tree, values)
    assert sorted(order.tolist()) == list(range(1, tree.size))
    for n in range(tree.size):
        kept = set(order[:n].tolist()) | {0}
        assert all(int(tree.parents[i]) in kept for i in kept if i != 0)  # every prefix is a tree
        cut = keep_nodes(tree, order[:n])
        assert cut.size == n + 1
        # the cut tree holds exactly the kept nodes' root paths
        want = sorted(tuple(tree.path_tokens(i).tolist()) for i in kept)
        got = sorted(tuple(cut.path_tokens(i).tolist()) for i in range(cut.size))
        assert want == got


def test_keep_nodes_refuses_orphans():
    tree = TokenTree(np.array([5, 6, 7]), np.array([-1, 0, 1]), np.ones(3))
    with pytest.raises(ValueError, match="parent"):
        keep_nodes(tree, np.array([2]))


def test_choose_node_count_maximises_tokens_per_second():
    cost = lambda n: float(n)  # noqa: E731 - linear cost: a node pays only if accepted for sure
    assert choose_node_count(np.array([0.9, 0.5]), cost, 1) == (0, 1.0)
    n, value = choose_node_count(np.array([1.0, 1.0, 0.2]), lambda i: 1.0 + 0.5 * i, 1)
    assert n == 2 and value == pytest.approx(3 / 2.5)
    # flat cost: take everything
    assert choose_node_count(np.full(10, 0.1), lambda n: 1.0, 2)[0] == 10
    # sizes that are not allowed are skipped, and max_inputs caps the pass
    n, _ = choose_node_count(np.full(10, 0.1), lambda n: 1.0, 2, allowed=lambda i: i != 22)
    assert n == 9 and choose_node_count(np.full(10, 0.1), lambda n: 1.0, 2, max_inputs=8)[0] == 3
    assert choose_node_count(np.full(3, 0.5), cost, 1, allowed=lambda i: False) == (-1, 0.0)


def test_choose_node_count_scales_expected_draft_tokens_by_the_gain_factor():
    gains, cost = np.full(6, 0.5), lambda n: 1.0 + 0.1 * n
    assert choose_node_count(gains, cost, 1)[0] == 6  # 4 tokens for 1.7
    # passes of more than 4 inputs were seen to yield a fifth of their estimates: stop at 3 nodes
    n, value = choose_node_count(gains, cost, 1, gain_factor=lambda inputs: 0.2 if inputs > 4 else 1.0)
    assert n == 3 and value == pytest.approx(2.5 / 1.4)
    # the bare pass is never scaled
    assert choose_node_count(gains, cost, 1, gain_factor=lambda inputs: 0.0) == (0, pytest.approx(1 / 1.1))


def test_yield_calibration_follows_what_each_size_class_yielded():
    yields = YieldCalibration()
    assert np.all(yields.factors() == 1.0)
    for _ in range(30):
        yields.observe(5, expected=6.0, yielded=2)  # wide passes: a third of their estimates
        yields.observe(3, expected=1.5, yielded=2)  # narrow passes: a little more than estimated
    f = yields.factors()
    assert f[5] == pytest.approx(1 / 3, abs=0.05) and 1.0 < f[3] <= YieldCalibration.MAX_FACTOR
    assert f[0] == f[6] == 1.0  # classes never seen keep the prior
    yields.observe(4, expected=1000.0, yielded=0)
    assert yields.factors()[4] == YieldCalibration.MIN_FACTOR


def test_the_budget_learns_that_wide_trees_yield_less_and_plans_narrower():
    chain = TokenTree(np.arange(24), np.arange(-1, 23), 0.93 ** np.arange(24))
    policy = AdaptiveBudget(CostCurve.from_mapping({1: 1.0, 8: 1.2, 32: 2.0, 64: 3.0}), num_masks=0, max_inputs=64)
    assert policy.plan(chain).tree.size > 16
    for _ in range(40):  # every pass accepts 2 draft tokens, where the wide ones expected ~10
        plan = policy.plan(chain)
        policy.observe(plan.tree, np.arange(3))
    assert policy.state.yields.factors()[size_class(24)] < 0.5
    assert policy.plan(chain).tree.size < 16
    # a state saved without the yield counts (an older memory file) loads with them empty
    arrays = policy.state.as_arrays()
    restored = BudgetState.from_arrays(arrays)
    assert np.array_equal(restored.yields.yielded, policy.state.yields.yielded)
    older = {k: v for k, v in arrays.items() if k not in ("yielded", "expected")}
    assert np.all(BudgetState.from_arrays(older).yields.factors() == 1.0)


LONG_CURVE = CostCurve((1, 8, 32), (10.0, 12.0, 20.0), 128, "toy", 1024, (12.0, 24.0, 60.0))


def test_adaptive_budget_verifies_smaller_trees_deep_into_a_long_context():
    policy = AdaptiveBudget(LONG_CURVE, num_masks=0, max_inputs=32)
    chain = TokenTree(np.arange(32), np.arange(-1, 31), 0.85 ** np.arange(32))
    short = policy.plan(chain, context_length=100).tree.size
    long = policy.plan(chain, context_length=3000).tree.size
    assert long < short
    assert policy.plan(chain, context_length=100).tree.size == short  # back where it was: tables are kept


def test_step_overhead_from_timings_makes_fewer_larger_steps_pay():
    policy = AdaptiveBudget(CPU_CURVE, num_masks=0, max_inputs=64)
    chain = TokenTree(np.arange(4), np.arange(-1, 3), 0.25 ** np.arange(4))
    assert policy.plan(chain).tree.size == 1  # 1.33 tokens for 78 (4 inputs padded to 8) < 1 for 57
    # real passes run at 1/1000 of the curve's numbers (its units are ms) and each step spends
    # another 100 ms outside the forward pass: 100 curve units on every step, bare or not
    for _ in range(3):
        policy.observe_timing(inputs=1, context=200, forward_seconds=0.057, step_seconds=0.157)
    assert policy.step_overhead == pytest.approx(100.0)
    assert policy.plan(chain).tree.size == 4  # 1.33 / 178 > 1 / 157
    policy.observe_timing(inputs=8, context=200, forward_seconds=0.0, step_seconds=0.1)  # ignored
    assert policy.step_overhead == pytest.approx(100.0)
    FixedBudget(1).observe_timing(1, 0, 0.1, 0.2)  # accepted, does nothing


def esp_like_tree(probs_depth1, probs_depth2=()):
    """Root with a fan of depth-1 candidates; the best one carries a depth-2 chain."""
    d1 = len(probs_depth1)
    tokens = [0] + list(range(1, d1 + 1)) + list(range(100, 100 + len(probs_depth2)))
    parents = [-1] + [0] * d1 + [1] * len(probs_depth2)
    scores = [1.0] + list(probs_depth1) + [probs_depth1[0] * p for p in probs_depth2]
    return TokenTree(np.array(tokens), np.array(parents), np.array(scores))


def test_adaptive_goes_bare_when_no_tree_pays_and_reprobes_with_backoff():
    policy = AdaptiveBudget(CPU_CURVE, num_masks=1, max_inputs=64)
    weak = esp_like_tree([0.02] * 14)
    plan = policy.plan(weak)
    assert plan.num_masks == 0 and plan.tree.size == 1  # a bare one-token step
    # with nothing to propose, masks are re-probed after 1, 2, 4, ... bare steps
    probes = [policy.plan(TokenTree.root_only(0)) for _ in range(14)]
    assert [i for i, p in enumerate(probes) if p.num_masks] == [0, 3, 8]
    assert probes[0].pad_to == 8  # root + 1 mask = 2 inputs would cost more than 8 on this curve


def test_adaptive_takes_a_tree_when_it_pays_and_never_an_inefficient_size():
    policy = AdaptiveBudget(CPU_CURVE, num_masks=1, max_inputs=64)
    strong = esp_like_tree([0.9, 0.05, 0.04, 0.03], [0.9, 0.8])
    plan = policy.plan(strong)
    assert plan.num_masks == 1 and plan.tree.size >= 2
    inputs = max(plan.pad_to, (plan.num_masks + 1) * plan.tree.size)
    assert CPU_CURVE.is_efficient(inputs)
    assert 1 in plan.tree.tokens  # the confident candidate is kept
    # on a flat (GPU-like) curve everything fits
    flat = AdaptiveBudget(FLAT_CURVE, num_masks=1, max_inputs=64)
    assert flat.plan(strong).tree.size == strong.size


# the shape of the Gemma 3 270M curve measured on this project's 2-core machine (c(1) = 1)
GEMMA_CPU_CURVE = CostCurve.from_mapping({1: 1.0, 2: 1.07, 4: 1.71, 8: 2.25, 16: 2.08, 32: 2.61, 64: 4.58})


def test_size_factors_price_each_size_class_by_its_own_timings():
    assert [size_class(n) for n in (1, 2, 3, 4, 7, 8, 16, 31, 32, 63, 64, 200)] == [0, 1, 1, 2, 2, 3, 4, 4, 5, 5, 6, 6]
    chain = TokenTree(np.arange(16), np.arange(-1, 15), 0.9 ** np.arange(16))
    policy = AdaptiveBudget(CPU_CURVE, num_masks=0, max_inputs=64)
    wide = policy.plan(chain).tree.size
    assert wide == 16
    # one-input passes run at the curve's times, passes of 16-31 inputs at twice theirs: after a
    # while the 16-31 class is priced at about twice its curve cost, relative to the others
    for _ in range(40):
        policy.observe_timing(inputs=1, context=200, forward_seconds=CPU_CURVE.cost(1) / 1000, step_seconds=CPU_CURVE.cost(1) / 1000)
        policy.observe_timing(inputs=16, context=200, forward_seconds=2 * CPU_CURVE.cost(16) / 1000, step_seconds=2 * CPU_CURVE.cost(16) / 1000)
    factors = policy.size_factors
    assert factors[4] / factors[0] == pytest.approx(2.0, rel=0.05)
    assert factors[1] == factors[2] == factors[3] == factors[5] == 1.0  # classes never seen keep their factor
    assert policy._cost(16) / policy._cost(1) == pytest.approx(2 * CPU_CURVE.cost(16) / CPU_CURVE.cost(1), rel=0.05)
    assert policy.plan(chain).tree.size < 16  # the plan moved off the dearer class


@FAST
@given(
    bfs_trees(),
    st.data(),
    st.sampled_from([CPU_CURVE, GEMMA_CPU_CURVE]),
    st.floats(0.0, 0.5),
    st.lists(st.tuples(st.integers(1, 64), st.floats(0.5, 2.0)), max_size=6),
)
def test_nodes_below_the_score_floor_never_pay(tree, data, curve, overhead, timings):
    """A tree whose draft nodes all score below the floor is never worth more than a bare step,
    whatever the step overhead and the size factors: the floor is where the drafter may stop growing."""
    policy = AdaptiveBudget(curve, num_masks=0, max_inputs=64)
    for inputs, ratio in timings:  # passes of various sizes running off the curve's times
        policy.observe_timing(inputs, 200, ratio * curve.cost(inputs), ratio * curve.cost(inputs))
    policy.step_overhead = overhead * curve.cost(1)
    floor = policy.score_floor()
    assert floor >= 0.0
    if floor == 0.0:
        # the size factors priced some wider pass at no more than a bare one (1-input passes seen
        # running slower than the scale, say): widening is free, so no node is below the floor
        assert policy.input_price == 0.0 and policy.cost_table[2:].min() <= policy.cost_table[1]
        return
    below = st.floats(0.0, floor, exclude_max=True)
    values = data.draw(st.lists(below, min_size=tree.size, max_size=tree.size))
    assert policy.plan(scored(tree, values)).tree.size == 1
    # nodes the calibration has learnt to trust more get a proportionally lower floor
    for _ in range(5):
        policy.observe(esp_like_tree([0.1]), np.array([0, 1]))
    assert policy.score_floor() < floor


def test_score_floor_on_flat_curves_and_fixed_budgets():
    assert AdaptiveBudget(FLAT_CURVE, num_masks=1, max_inputs=64).score_floor() < 1e-3  # width is nearly free
    assert FixedBudget(1).score_floor() == 0.0  # the whole tree is verified


def test_mask_free_drafters_get_bare_or_cheap_trees():
    policy = AdaptiveBudget(CPU_CURVE, num_masks=0, max_inputs=64)
    chain_tree = TokenTree(np.arange(6), np.arange(-1, 5), np.ones(6))
    plan = policy.plan(chain_tree)  # calibration starts trusting scores of 1: take the chain
    assert plan.num_masks == 0 and plan.tree.size == 6 and plan.pad_to == 8
    for _ in range(40):  # ... but chains that are never accepted stop being verified
        policy.observe(chain_tree, np.array([0]))
    assert policy.plan(chain_tree).tree.size == 1


def test_calibration_learns_acceptance_per_depth():
    cal = DepthCalibration(decay=1.0)
    tree = esp_like_tree([0.5, 0.5], [0.5])
    for _ in range(50):
        cal.observe(tree, accepted_depth=1)
    est = cal.estimates(tree)
    assert est[0] == 1.0
    assert est[1] + est[2] == pytest.approx(1.0, abs=0.05)  # one depth-1 node accepted per step
    assert est[3] < 0.05  # depth 2 never accepted


def test_masks_on_a_few_owners_are_costed_and_passed_on():
    """A drafter that puts its k masks on chosen nodes only pays k inputs per owner, not per node."""
    strong = esp_like_tree([0.9, 0.05, 0.04, 0.03], [0.9, 0.8])
    root_only = lambda tree: np.array([0])  # noqa: E731
    policy = AdaptiveBudget(FLAT_CURVE, num_masks=2, max_inputs=10, mask_owners=root_only, mask_nodes=1)
    plan = policy.plan(strong)
    # 7 nodes + 2 masks on the root = 9 inputs fit in 10; masks on every node (21) would not
    assert plan.num_masks == 2 and plan.tree.size == strong.size
    assert plan.owners.tolist() == [0] and plan.num_inputs == strong.size + 2
    everywhere = AdaptiveBudget(FLAT_CURVE, num_masks=2, max_inputs=10)
    assert everywhere.plan(strong).tree.size == 3  # (2+1) * 3 = 9 inputs
    assert everywhere.plan(strong).owners is None
    fixed = FixedBudget(2, root_only).plan(strong)
    assert fixed.tree is strong and fixed.owners.tolist() == [0] and fixed.num_inputs == strong.size + 2


def test_fixed_budget_keeps_the_tree():
    tree = esp_like_tree([0.1, 0.1])
    plan = FixedBudget(2).plan(tree)
    assert plan.tree is tree and plan.num_masks == 2


@FAST
@given(bfs_trees(max_depth=3, max_width=3), st.integers(0, 2), st.integers(0, 5))
def test_pad_layout_adds_inputs_that_nobody_sees(tree, k, extra):
    base = esp_layout(tree, k)
    padded = pad_layout(base, base.num_inputs + extra)
    n = base.num_inputs
    assert padded.num_inputs == n + extra and padded.num_pad == extra
    assert np.array_equal(padded.visible[:n, :n], base.visible)
    assert not padded.visible[:n, n:].any()  # nobody sees a pad
    assert np.array_equal(padded.visible[n:, n:], np.eye(extra, dtype=bool))  # a pad sees itself
    assert not padded.visible[n:, :n].any()
    assert np.all(padded.position_offsets[n:] == 0) and np.all(padded.owner[n:] == -1)
    for owner in range(tree.size):
        assert np.array_equal(padded.mask_slots(owner), base.mask_slots(owner))
    with pytest.raises(ValueError):
        pad_layout(base, n - 1)
