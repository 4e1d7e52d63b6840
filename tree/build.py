"""Building token trees from candidate distributions.

``best_first`` is the EAGLE-2-style dynamic tree of the ESP paper: depth d draws its candidates from
one distribution (mask d of the owner that seeded the tree), a path's score is the product of the
probabilities along it, and the ``max_nodes`` best-scoring paths are kept.  Because a child never
scores above its parent, the best ``max_nodes`` paths of all depths always form a tree.  The
search is vectorised: each depth keeps at most ``max_nodes`` live paths and scores all their
children in one outer product.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

import numpy as np

from .token_tree import TokenTree


def best_first(
    root_token: int,
    cand_tokens: Sequence[np.ndarray],
    cand_probs: Sequence[np.ndarray],
    max_nodes: int,
    prune_repeats: bool = True,
    first_level_only_top1: bool = False,
) -> TokenTree:
    """Build the tree of the ``max_nodes`` most probable paths.

    Args:
        root_token: the token at the root (the last committed token).
        cand_tokens: per depth d (index 0 = depth 1), candidate tokens sorted by descending
            probability.  Provide at least ``max_nodes + 1`` per depth so that pruning can
            replace a repeat by the next-best token.
        cand_probs: the matching probabilities (same shapes).
        max_nodes: draft-node budget (the root is not counted).
        prune_repeats: drop a candidate equal to its parent's token; the next-best candidate of
            that distribution takes its place.
        first_level_only_top1: keep only the single best child per depth (a chain), as ESP does
            right after prefill.
    """
    if max_nodes < 0:
        raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
    depth_count = len(cand_tokens)
    if len(cand_probs) != depth_count:
        raise ValueError("cand_tokens and cand_probs must have one entry per depth")
    if max_nodes == 0 or depth_count == 0:
        return TokenTree.root_only(root_token)
    width = 1 if first_level_only_top1 else max_nodes

    # live paths at the previous depth: token, score, index into the previous level's arrays
    prev_tokens = np.array([root_token], dtype=np.int64)
    prev_scores = np.array([1.0])
    levels_tokens: list[np.ndarray] = []
    levels_scores: list[np.ndarray] = []
    levels_parent: list[np.ndarray] = []  # parent index within the previous level (root level = [root])
    for d in range(depth_count):
        toks = np.asarray(cand_tokens[d], dtype=np.int64).reshape(-1)
        probs = np.asarray(cand_probs[d], dtype=np.float64).reshape(-1)
        if toks.shape != probs.shape:
            raise ValueError(f"depth {d + 1}: tokens and probabilities differ in shape")
        if toks.size == 0 or prev_tokens.size == 0:
            break
        scores = prev_scores[:, None] * probs[None, :]  # [parents, candidates]
        if prune_repeats:
            scores = np.where(toks[None, :] == prev_tokens[:, None], -np.inf, scores)
        flat = scores.reshape(-1)
        keep = min(width, int(np.isfinite(flat).sum()))
        if keep == 0:
            break
        # top-`keep` by score; ties broken by (parent rank, candidate rank), i.e. flat index
        order = np.lexsort((np.arange(flat.size), -flat))[:keep]
        parent_idx, cand_idx = np.divmod(order, toks.size)
        prev_tokens = toks[cand_idx]
        prev_scores = flat[order]
        levels_tokens.append(prev_tokens)
        levels_scores.append(prev_scores)
        levels_parent.append(parent_idx)

    if not levels_tokens:
        return TokenTree.root_only(root_token)

    # global top-`max_nodes` over all depths: order by (-score, depth, rank within depth)
    all_scores = np.concatenate(levels_scores)
    all_depths = np.concatenate([np.full(t.size, d + 1) for d, t in enumerate(levels_tokens)])
    all_rank = np.concatenate([np.arange(t.size) for t in levels_tokens])
    chosen = np.lexsort((all_rank, all_depths, -all_scores))[:max_nodes]
    chosen_mask = np.zeros(all_scores.size, dtype=bool)
    chosen_mask[chosen] = True

    # assemble breadth-first: level by level, keep chosen entries in rank order
    tokens = [np.array([root_token], dtype=np.int64)]
    parents = [np.array([-1], dtype=np.int64)]
    scores = [np.array([1.0])]
    start = 0
    prev_new_index = np.array([0], dtype=np.int64)  # level index -> tree index, previous level
    next_tree_index = 1
    for d, toks in enumerate(levels_tokens):
        sel = chosen_mask[start : start + toks.size]
        start += toks.size
        new_index = np.full(toks.size, -1, dtype=np.int64)
        count = int(sel.sum())
        if count == 0:
            break
        par_tree = prev_new_index[levels_parent[d][sel]]
        if np.any(par_tree < 0):  # cannot happen: children never outscore parents
            raise AssertionError("best-first selection is not ancestor-closed")
        new_index[sel] = np.arange(next_tree_index, next_tree_index + count)
        next_tree_index += count
        tokens.append(toks[sel])
        parents.append(par_tree)
        scores.append(levels_scores[d][sel])
        prev_new_index = new_index
    return TokenTree._from_unordered(np.concatenate(tokens), np.concatenate(parents), np.concatenate(scores))


def grow_best_first(
    root_token: int,
    expand: Callable[[int, int, int], tuple[np.ndarray, np.ndarray]],
    max_nodes: int,
    min_score: float = 0.0,
) -> tuple[TokenTree, np.ndarray]:
    """Grow the tree of the ``max_nodes`` best paths from a children function, one node at a time.

    ``expand(node, parent, token)`` returns the candidate children ``(tokens, probs)`` of a node
    just taken into the tree (``node`` numbers nodes in the order they were taken, the root 0 with
    parent -1); probabilities lie in [0, 1], so a child never outscores its parent and the taken
    set is always a tree.  Candidate tokens of one node must be distinct.  A child's
    score is its parent's score times its probability; the best candidate of all expanded nodes
    is taken next and expanded in its turn (EAGLE-2's best-first tree, with children that may come
    from a different distribution at every node).  Ties go to the earlier candidate.  Growth stops
    early once the best remaining candidate scores below ``min_score`` (every later one would too).

    Returns the breadth-first tree and ``index`` with ``index[node]`` = the tree index of the
    ``node``-th taken node.
    """
    if max_nodes < 0:
        raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
    tokens, parents, scores = [int(root_token)], [-1], [1.0]
    heap: list[tuple[float, int, int, int]] = []  # (-score, push order, parent node, token)
    pushed = 0

    def push(node: int) -> None:
        nonlocal pushed
        toks, probs = expand(node, parents[node], tokens[node])
        if isinstance(toks, np.ndarray):
            toks = toks.tolist()
        if isinstance(probs, np.ndarray):
            probs = probs.tolist()
        base = scores[node]
        for tok, p in zip(toks, probs):
            if p > 0.0:
                heapq.heappush(heap, (-base * min(p, 1.0), pushed, node, int(tok)))
                pushed += 1

    if max_nodes:
        push(0)
    while heap and len(tokens) <= max_nodes and -heap[0][0] >= min_score:
        neg, _, parent, tok = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        scores.append(-neg)
        if len(tokens) <= max_nodes:  # the last node's children could not be taken
            push(len(tokens) - 1)
    return TokenTree.from_parent_list(np.array(tokens), np.array(parents), np.array(scores))


def chain(root_token: int, tokens: Sequence[int], probs: Sequence[float] | None = None) -> TokenTree:
    """A single path root -> tokens[0] -> tokens[1] -> ... (prompt lookup, the top-1 path)."""
    toks = np.asarray(list(tokens), dtype=np.int64)
    n = toks.size
    if probs is None:
        scores = np.ones(n)
    else:
        scores = np.cumprod(np.asarray(list(probs), dtype=np.float64))
    return TokenTree(
        np.concatenate([[root_token], toks]),
        np.arange(-1, n, dtype=np.int64),
        np.concatenate([[1.0], scores]),
    )
