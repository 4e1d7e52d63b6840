"""Hypothesis strategies shared by the tree tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from probe_mtp.tree import TokenTree


@st.composite
def bfs_trees(draw, max_depth=4, max_width=4):
    """A valid breadth-first tree: level by level, each node's parent drawn from the level above."""
    tokens, parents = [draw(st.integers(0, 50))], [-1]
    prev_level = [0]
    for _ in range(draw(st.integers(0, max_depth))):
        level = []
        for _ in range(draw(st.integers(1, max_width))):
            level.append(len(tokens))
            parents.append(draw(st.sampled_from(prev_level)))
            tokens.append(draw(st.integers(0, 50)))
        prev_level = level
    return TokenTree(np.array(tokens), np.array(parents), np.ones(len(tokens)))
