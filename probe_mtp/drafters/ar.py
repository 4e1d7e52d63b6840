"""The control: plain one-token decoding through the same loop (root-only trees, BC = 1)."""

from __future__ import annotations

import numpy as np

from ..tree import TokenTree
from .base import Drafter


class AutoregressiveDrafter(Drafter):
    """Proposes nothing: every pass is the root alone, so each step commits exactly the model's
    next token.  Runs through the same prefill / layout / verify / KV-selection code as every other
    drafter, which makes it the fair baseline for tokens-per-second comparisons (and a check that
    the harness itself is lossless).  ``budget`` is accepted for a uniform interface and ignored:
    one pass has one input."""

    name = "ar"
    budget_free = True

    def __init__(self, budget: int = 1):
        super().__init__(budget)

    @property
    def max_nodes(self) -> int:
        return 0

    def propose(self, root_token: int, context: np.ndarray) -> TokenTree:
        return TokenTree.root_only(root_token)
