"""Acceptance rules on toy trees and logits: chosen once per request, each a small function."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probe_mtp.acceptance import Greedy, RecursiveRejection, SampleAndMatch, acceptance_rule
from probe_mtp.drafters import ESPDrafter, HybridDrafter
from probe_mtp.tree import TokenTree
from probe_mtp.vocab import RowTops

from tree_strategies import bfs_trees

CPU = torch.device("cpu")


def _tree():
    #        0(5)
    #      /   |   \
    #   1(7)  2(8)  3(9)
    #   /  \    |
    # 4(1) 5(2) 6(3)
    return TokenTree(np.array([5, 7, 8, 9, 1, 2, 3]), np.array([-1, 0, 0, 0, 1, 1, 2]), np.ones(7))


def _peaked(targets, vocab=12):
    logits = torch.full((len(targets), vocab), -5.0)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    return logits


def test_greedy_walks_to_the_deepest_matching_node_and_adds_the_bonus():
    tree = _tree()
    logits = _peaked([7, 2, 0, 0, 0, 4, 0])  # root -> 7 (node 1) -> 2 (node 5) -> bonus 4
    for lazy in (True, False):
        verdict = Greedy(None, lazy=lazy)(tree, logits, torch.tensor([1, 2, 5]))
        assert verdict.path.tolist() == [0, 1, 5] and verdict.last == 5
        assert verdict.tokens.tolist() == [7, 2, 4]
        assert [row.shape for row in verdict.scores] == [(1, 12)] * 3
        assert torch.equal(verdict.scores[2], logits[5:6])


@settings(max_examples=60, deadline=None)
@given(tree=bfs_trees(max_width=4), seed=st.integers(0, 2**31 - 1))
def test_lazy_and_eager_greedy_agree_with_and_without_row_tops(tree, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tree.size, 16, generator=gen) * 4
    context = torch.tensor([3, 4])
    eager = Greedy(None, lazy=False)(tree, logits, context)
    for tops in (None, RowTops.of(logits, 4)):
        lazy = Greedy(None, lazy=True)(tree, logits, context, tops)
        assert lazy.path.tolist() == eager.path.tolist() and lazy.tokens.tolist() == eager.tokens.tolist()


def test_greedy_with_processors_processes_each_nodes_own_path():
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    tree = TokenTree.from_paths(5, [[7, 7]])
    logits = torch.zeros(3, 10)
    logits[:, 7] = 1.0  # the model likes 7 everywhere ...
    logits[:, 8] = 0.9
    # ... but a strong repetition penalty on the node's own path makes 8 win after a 7
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(5.0)])
    verdict = Greedy(processors, lazy=True)(tree, logits, torch.tensor([1, 2, 5]))
    assert verdict.tokens.tolist() == [7, 8]


def test_sample_and_match_follows_a_certain_draw_and_draws_the_bonus():
    tree = _tree()
    logits = _peaked([8, 0, 3, 0, 0, 0, 6]) * 10  # practically certain draws: 8, then 3, then 6
    verdict = SampleAndMatch(None, torch.Generator().manual_seed(0))(tree, logits, torch.tensor([5]))
    assert verdict.path.tolist() == [0, 2, 6] and verdict.tokens.tolist() == [8, 3, 6]


def test_recursive_rejection_without_drawn_children_is_sample_and_match():
    drafter = ESPDrafter(1, 10)
    rule = RecursiveRejection(None, torch.Generator().manual_seed(0), drafter)
    assert drafter.draft_distributions() is None
    verdict = rule(TokenTree.root_only(3), _peaked([4]) * 10, torch.tensor([3]))
    assert verdict.tokens.tolist() == [4]


def test_the_rule_is_chosen_once_per_request():
    esp, hybrid = ESPDrafter(1, 10), HybridDrafter(10, 1)
    assert isinstance(acceptance_rule(False, "rejection", None, None, esp, CPU), Greedy)
    assert acceptance_rule(False, "match", None, None, esp, CPU).lazy
    assert not acceptance_rule(False, "match", None, None, esp, torch.device("meta")).lazy
    assert type(acceptance_rule(True, "match", None, None, esp, CPU)) is SampleAndMatch
    assert type(acceptance_rule(True, "rejection", None, None, hybrid, CPU)) is SampleAndMatch  # cannot draw
    rule = acceptance_rule(True, "rejection", None, None, esp, CPU)
    assert type(rule) is RecursiveRejection and rule.needs_whole_tree
