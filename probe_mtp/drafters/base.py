"""The drafter interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from ..tree import TokenTree
from ..vocab import RowTops


@dataclass
class StepFeedback:
    """What one verification pass tells the drafter.

    - ``tree``: the tree that was verified (a root-only tree for the prefill pass);
    - ``accepted``: accepted node indices, root first;
    - ``new_tokens``: the tokens committed by this pass (accepted drafts + bonus), before any
      truncation at EOS or the length limit;
    - ``node_logits``: ``[tree.size, V]`` the model's logits after each node;
    - ``mask_logits``: ``[k, V]`` logits of the deepest accepted node's masks (None when k = 0 or
      when that node carried no masks);
    - ``context``: every committed token so far (prompt + generated), 1D numpy;
    - ``node_tops``: each node's most probable tokens and their probabilities, when the decoder
      computed them (at least ``Drafter.node_top_k`` wide); None: read ``node_logits``.
    """

    tree: TokenTree
    accepted: np.ndarray
    new_tokens: np.ndarray
    node_logits: torch.Tensor
    mask_logits: torch.Tensor | None
    context: np.ndarray
    is_prefill: bool = False
    node_tops: RowTops | None = None


class Drafter(ABC):
    """Proposes trees; ``num_masks`` mask inputs are appended to every node of its trees, or to the
    nodes :meth:`mask_owners` names."""

    name: str = "drafter"
    num_masks: int = 0
    # how many of every verified node's most probable tokens observe() reads (0: none); the decoder
    # then computes them once per pass (StepFeedback.node_tops) and its greedy walk reads them too
    node_top_k: int = 0

    def __init__(self, budget: int):
        self.budget = int(budget)
        # set before each proposal by the budget policy: nodes scoring below it would be cut from
        # the tree anyway, so a drafter that grows its tree node by node may stop there
        self.min_score = 0.0

    @property
    def max_nodes(self) -> int:
        """Draft nodes (root excluded) that fit the budget with this drafter's masks."""
        return self.budget // (self.num_masks + 1) - 1

    def start(self, prompt_ids: np.ndarray) -> None:
        """Reset per-generation state for a new prompt."""

    @abstractmethod
    def propose(self, root_token: int, context: np.ndarray) -> TokenTree:
        """The tree to verify next; ``context`` holds every committed token (root last)."""

    def mask_owners(self, tree: TokenTree) -> np.ndarray | None:
        """The nodes of ``tree`` (the last proposed tree) that carry the ``num_masks`` masks, in
        increasing order; None: every node.  ``StepFeedback.mask_logits`` is None after a pass whose
        deepest accepted node carried none."""
        return None

    def observe(self, feedback: StepFeedback) -> None:
        """Learn from a verification pass (called after prefill too)."""

    def draft_distributions(self):
        """For ``sampling_rule="rejection"``: ``(q, draws)`` of the last proposed tree, where
        ``q[node]`` is the distribution the node's children were drawn from (i.i.d.) and
        ``draws[node]`` the draws in order; ``None`` when the tree was not drawn that way (then
        sampling falls back to sample-and-match, which is exact for any tree)."""
        return None
