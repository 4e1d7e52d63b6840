"""The token tree: draft tokens with parent pointers, depths and cumulative probabilities."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass(frozen=True, eq=False)
class TokenTree:
    """A tree of draft tokens in breadth-first order.

    Node 0 is the root: the last committed token, not yet in the KV cache.  Every other node is a
    draft token.  Arrays are numpy, one entry per node:

    - ``tokens[i]``: the token id at node i;
    - ``parents[i]``: the index of i's parent (``-1`` for the root); always ``parents[i] < i``;
    - ``scores[i]``: the cumulative probability of the path root..i (1.0 at the root);
    - ``depths[i]``: derived, 0 at the root; non-decreasing along the array (breadth-first).
    """

    tokens: np.ndarray
    parents: np.ndarray
    scores: np.ndarray
    depths: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        parents = np.asarray(self.parents, dtype=np.int64).reshape(-1)
        scores = np.asarray(self.scores, dtype=np.float64).reshape(-1)
        n = tokens.shape[0]
        if n == 0:
            raise ValueError("a token tree needs at least its root")
        if parents.shape[0] != n or scores.shape[0] != n:
            raise ValueError("tokens, parents and scores must have one entry per node")
        if parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        if n > 1 and not np.all((parents[1:] >= 0) & (parents[1:] < np.arange(1, n))):
            raise ValueError("every non-root node's parent must come before it")
        depths = np.zeros(n, dtype=np.int64)
        for i in range(1, n):  # parents[i] < i, so one forward sweep suffices
            depths[i] = depths[parents[i]] + 1
        if n > 1 and np.any(np.diff(depths) < 0):
            raise ValueError("nodes must be in breadth-first order (depths non-decreasing)")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "scores", scores)
        object.__setattr__(self, "depths", depths)
        for arr in (tokens, parents, scores, depths):
            arr.setflags(write=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def root_only(cls, root_token: int) -> "TokenTree":
        return cls(np.array([root_token]), np.array([-1]), np.array([1.0]))

    @classmethod
    def from_paths(
        cls,
        root_token: int,
        paths: Sequence[Sequence[int]],
        path_scores: Sequence[Sequence[float]] | None = None,
    ) -> "TokenTree":
        """Merge token paths (each starting below the root) into one tree, sharing prefixes.

        ``path_scores[p][d]`` is the cumulative score of path p at depth d+1; where two paths
        share a prefix node the higher score is kept.  Without scores every node scores 1.0.
        """
        # trie: key (parent_index_in_trie, token) -> trie index
        trie_parent = [-1]
        trie_token = [int(root_token)]
        trie_score = [1.0]
        index: dict[tuple[int, int], int] = {}
        for p, path in enumerate(paths):
            node = 0
            for d, tok in enumerate(path):
                key = (node, int(tok))
                score = 1.0 if path_scores is None else float(path_scores[p][d])
                child = index.get(key)
                if child is None:
                    child = len(trie_token)
                    index[key] = child
                    trie_parent.append(node)
                    trie_token.append(int(tok))
                    trie_score.append(score)
                else:
                    trie_score[child] = max(trie_score[child], score)
                node = child
        return cls._from_unordered(np.array(trie_token), np.array(trie_parent), np.array(trie_score))

    @classmethod
    def _from_unordered(cls, tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray) -> "TokenTree":
        """Reorder a tree whose parents precede children (any order) into breadth-first order."""
        return cls.from_parent_list(tokens, parents, scores)[0]

    @classmethod
    def from_parent_list(
        cls, tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray
    ) -> tuple["TokenTree", np.ndarray]:
        """A breadth-first tree from nodes listed in any order in which parents precede their
        children (node 0 the root); also returns ``index``, the new position of each listed node."""
        tokens = np.asarray(tokens, dtype=np.int64)
        parents = np.asarray(parents, dtype=np.int64)
        n = tokens.shape[0]
        depths = np.zeros(n, dtype=np.int64)
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
        # stable: by depth, then by original index (keeps parents' relative order)
        order = np.lexsort((np.arange(n), depths))
        new_index = np.empty(n, dtype=np.int64)
        new_index[order] = np.arange(n)
        new_parents = np.where(parents[order] >= 0, new_index[np.maximum(parents[order], 0)], -1)
        return cls(tokens[order], new_parents, np.asarray(scores, dtype=np.float64)[order]), new_index

    # ------------------------------------------------------------------ queries
    @property
    def size(self) -> int:
        """Number of nodes including the root."""
        return int(self.tokens.shape[0])

    @property
    def num_draft_nodes(self) -> int:
        return self.size - 1

    @property
    def max_depth(self) -> int:
        return int(self.depths[-1])

    @property
    def shape_key(self) -> tuple[int, ...]:
        """A hashable key of the tree's shape (parents only): equal keys mean equal layouts."""
        return tuple(self.parents.tolist())

    def children(self, i: int) -> np.ndarray:
        return np.flatnonzero(self.parents == i)

    def path(self, i: int) -> np.ndarray:
        """Node indices from the root to i, inclusive."""
        out = [i]
        while self.parents[out[-1]] >= 0:
            out.append(int(self.parents[out[-1]]))
        return np.array(out[::-1], dtype=np.int64)

    def path_tokens(self, i: int) -> np.ndarray:
        return self.tokens[self.path(i)]

    def ancestor_matrix(self) -> np.ndarray:
        """``A[i, j]`` is True iff j is an ancestor of i or i itself (bool ``[n, n]``).

        Built level by level: a node's row is its parent's row plus itself, so the work is one
        vectorised row copy per depth.
        """
        n = self.size
        anc = np.eye(n, dtype=bool)
        for d in range(1, self.max_depth + 1):
            level = np.flatnonzero(self.depths == d)
            anc[level] |= anc[self.parents[level]]
        return anc

    def to_networkx(self):
        """A ``networkx.DiGraph`` with edges parent -> child and node attributes
        ``token``, ``depth`` and ``score``."""
        import networkx as nx

        g = nx.DiGraph()
        for i in range(self.size):
            g.add_node(i, token=int(self.tokens[i]), depth=int(self.depths[i]), score=float(self.scores[i]))
        for i in range(1, self.size):
            g.add_edge(int(self.parents[i]), i)
        return g

    def __repr__(self) -> str:
        return f"TokenTree(size={self.size}, max_depth={self.max_depth}, tokens={self.tokens.tolist()})"
