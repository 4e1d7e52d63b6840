"""Verification (probe_mtp.verify) on toy tensors: processing one node row equals the tree-wide
processing, the eager and lazy greedy walks, node targets and top candidates."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from probe_mtp.verify import accept_greedy, accept_greedy_lazily, node_targets, process_node_logits, process_node_row
from probe_mtp.vocab import top_candidates
from probe_mtp.tree import TokenTree

from tree_strategies import bfs_trees


def _tree():
    #        0(5)
    #      /   |   \
    #   1(7)  2(8)  3(9)
    #   /  \    |
    # 4(1) 5(2) 6(3)
    return TokenTree(
        np.array([5, 7, 8, 9, 1, 2, 3]),
        np.array([-1, 0, 0, 0, 1, 1, 2]),
        np.ones(7),
    )


@settings(max_examples=40, deadline=None)
@given(bfs_trees(), st.integers(0, 2**31 - 1))
def test_processing_one_node_row_equals_the_tree_wide_processing(tree, seed):
    """The lazy greedy walk processes only the rows it reaches: each equals the whole tree's row."""
    from transformers import LogitsProcessorList, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tree.size, 64, generator=gen)
    context = torch.randint(0, 64, (7,), generator=gen)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), NoRepeatNGramLogitsProcessor(2)])
    whole = process_node_logits(processors, context, tree, logits)
    for node in range(tree.size):
        assert torch.equal(process_node_row(processors, context, tree, logits, node), whole[node : node + 1])
    assert process_node_row(None, context, tree, logits, tree.size - 1).data_ptr() == logits[-1].data_ptr()  # a view


def test_accept_greedy_walks_matching_children():
    tree = _tree()
    targets = np.array([7, 2, 0, 0, 0, 4, 0])  # root -> 7 (node 1) -> 2 (node 5) -> bonus 4
    assert accept_greedy(tree, targets).tolist() == [0, 1, 5]
    targets = np.array([6, 0, 0, 0, 0, 0, 0])  # no child carries 6
    assert accept_greedy(tree, targets).tolist() == [0]
    targets = np.array([8, 0, 3, 0, 0, 0, 0])
    assert accept_greedy(tree, targets).tolist() == [0, 2, 6]
    assert accept_greedy(TokenTree.root_only(3), np.array([1])).tolist() == [0]


@settings(max_examples=200, deadline=None)
@given(tree=bfs_trees(max_width=5), seed=st.integers(0, 2**31 - 1))
def test_lazy_greedy_walk_matches_the_eager_one_and_asks_only_the_path(tree, seed):
    # targets drawn from the tokens in play, so that long accepted paths are common
    rng = np.random.default_rng(seed)
    targets = rng.choice(np.unique(tree.tokens), size=tree.size)
    asked = []
    path, bonus = accept_greedy_lazily(tree, lambda node: asked.append(node) or targets[node])
    assert path.tolist() == accept_greedy(tree, targets).tolist()
    assert bonus == targets[path[-1]]
    assert asked == path.tolist()


def test_node_targets_and_top_candidates():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert node_targets(logits).tolist() == [1, 0]
    toks, probs = top_candidates(logits, 2)
    assert toks[0].tolist() == [1, 2] and toks[1].tolist() == [0, 2]
    full = torch.softmax(logits, -1)
    assert np.allclose(probs[0], full[0, [1, 2]].numpy())
    toks, _ = top_candidates(logits, 10)  # width larger than the vocabulary is clipped
    assert toks[0].shape == (3,)
