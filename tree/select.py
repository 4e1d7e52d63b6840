"""Cutting a tree down to its best nodes, and choosing how many nodes a pass should verify.

Both are model-free: they take per-node acceptance estimates and a cost function of the number of
inputs of a pass, whatever produced them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .token_tree import TokenTree


def path_monotone(tree: TokenTree, values: np.ndarray) -> np.ndarray:
    """``values`` made non-increasing along every root-to-leaf path (``v[i] <= v[parent(i)]``).

    A node can only be accepted when its parent is, so an acceptance estimate above the parent's is
    never right; after this, the best n nodes by value always form a tree (prefix-closed).
    """
    out = np.asarray(values, dtype=np.float64).copy()
    if out.shape[0] != tree.size:
        raise ValueError(f"need one value per node ({tree.size}), got {out.shape[0]}")
    parents = tree.parents
    for d in range(1, tree.max_depth + 1):  # one vectorised sweep per depth
        at = np.flatnonzero(tree.depths == d)
        out[at] = np.minimum(out[at], out[parents[at]])
    return out


def best_order(tree: TokenTree, values: np.ndarray) -> np.ndarray:
    """Draft nodes (root excluded) in decreasing order of their path-monotone value; ties keep
    breadth-first order, so every node comes after its parent."""
    mono = path_monotone(tree, values)
    draft = np.arange(1, tree.size)
    return draft[np.lexsort((draft, -mono[1:]))]


def keep_nodes(tree: TokenTree, keep: np.ndarray) -> TokenTree:
    """The subtree of the root and the draft nodes ``keep`` (which must hold every kept node's
    parent), renumbered in breadth-first order."""
    idx = np.unique(np.concatenate([[0], np.asarray(keep, dtype=np.int64)]))
    if idx.size == tree.size:
        return tree
    new_index = np.full(tree.size, -1, dtype=np.int64)
    new_index[idx] = np.arange(idx.size)
    parents = tree.parents[idx]
    kept_parents = np.where(parents < 0, -1, new_index[np.maximum(parents, 0)])
    if np.any(kept_parents[1:] < 0):
        raise ValueError("keep_nodes: a kept node's parent was not kept")
    return TokenTree(tree.tokens[idx], kept_parents, tree.scores[idx])


def choose_node_count(
    gains: np.ndarray,
    cost: Callable[[int], float],
    inputs_per_node: int | Callable[[int], int],
    allowed: Callable[[int], bool] = lambda n: True,
    max_inputs: int | None = None,
    gain_factor: Callable[[int], float] | None = None,
) -> tuple[int, float]:
    """How many of the ranked draft nodes to verify: ``n`` maximising expected tokens per second,
    ``(1 + gains[:n].sum()) / cost(inputs(n + 1))``, where ``inputs(size)`` is
    ``inputs_per_node * size``, or ``inputs_per_node(size)`` when it is a function (for layouts
    whose masks sit on a few nodes only).

    ``gains[i]`` is the estimated acceptance probability of the i-th best node (expected tokens it
    adds); the 1 is the bonus token every pass yields.  Input counts for which ``allowed`` is False
    (sizes the cost curve shows to be slow) and those over ``max_inputs`` are skipped.
    ``gain_factor(inputs)``: scales the draft tokens expected of a pass of that many inputs (what
    such passes were seen to yield against their estimates; None: 1).  Returns
    ``(n, value)``; ``(-1, 0.0)`` when no size is allowed.
    """
    gains = np.asarray(gains, dtype=np.float64)
    drafted = np.concatenate([[0.0], np.cumsum(gains)])
    inputs_of = inputs_per_node if callable(inputs_per_node) else (lambda size: inputs_per_node * size)
    best_n, best_value = -1, 0.0
    for n in range(drafted.shape[0]):
        inputs = int(inputs_of(n + 1))
        if max_inputs is not None and inputs > max_inputs:
            break
        if not allowed(inputs):
            continue
        expected = 1.0 + (drafted[n] if gain_factor is None or n == 0 else drafted[n] * gain_factor(inputs))
        value = expected / cost(inputs)
        if value > best_value:
            best_n, best_value = n, value
    return best_n, best_value
