"""The ESP drafter: proposals from the mask positions of the previous pass."""

from __future__ import annotations

import numpy as np

from ..step import top_candidates
from ..tree import TokenTree, best_first, node_budget
from .base import Drafter, StepFeedback


class ESPDrafter(Drafter):
    """Embedding-space probing.  Mask j of the deepest accepted node proposes depth j of the next
    tree; candidates are ranked by the product of mask probabilities along their path and the best
    ``max_nodes`` are kept (repeats of the parent token pruned).  Right after prefill only the top-1
    path is expanded."""

    name = "esp"

    def __init__(self, num_masks: int, budget: int, prune_repeats: bool = True):
        super().__init__(budget)
        self.num_masks = int(num_masks)
        node_budget(budget, num_masks)  # raises a clear error when even one node does not fit
        self.prune_repeats = prune_repeats
        self._cand_tokens: list[np.ndarray] | None = None
        self._cand_probs: list[np.ndarray] | None = None
        self._after_prefill = True

    def start(self, prompt_ids: np.ndarray) -> None:
        self._cand_tokens = self._cand_probs = None
        self._after_prefill = True

    def propose(self, root_token: int, context: np.ndarray) -> TokenTree:
        if self._cand_tokens is None:
            return TokenTree.root_only(root_token)
        return best_first(
            root_token,
            self._cand_tokens,
            self._cand_probs,
            self.max_nodes,
            prune_repeats=self.prune_repeats,
            first_level_only_top1=self._after_prefill,
        )

    def observe(self, feedback: StepFeedback) -> None:
        self._after_prefill = feedback.is_prefill
        if feedback.mask_logits is None:
            self._cand_tokens = self._cand_probs = None
            return
        # one spare candidate per depth so that pruning a repeat leaves max_nodes options
        self._cand_tokens, self._cand_probs = top_candidates(feedback.mask_logits, self.max_nodes + 1)
