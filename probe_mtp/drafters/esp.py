"""The ESP drafter: proposals from the mask positions of the previous pass."""

from __future__ import annotations

import numpy as np
import torch

from ..tree import TokenTree, best_first, node_budget
from .base import Drafter, StepFeedback


class ESPDrafter(Drafter):
    """Embedding-space probing.  Mask j of the deepest accepted node proposes depth j of the next
    tree; candidates are ranked by the product of mask probabilities along their path and the best
    ``max_nodes`` are kept (repeats of the parent token pruned).  Right after prefill only the top-1
    path is expanded."""

    name = "esp"
    mask_use = "required"

    @classmethod
    def from_config(cls, config) -> "ESPDrafter":
        return cls(config.num_masks, config.tree_budget, prune_repeats=config.prune_repeats)

    def __init__(self, num_masks: int, budget: int, prune_repeats: bool = True):
        super().__init__(budget)
        self.num_masks = int(num_masks)
        node_budget(budget, num_masks)  # raises a clear error when even one node does not fit
        self.prune_repeats = prune_repeats
        self._cand_tokens: list[np.ndarray] | None = None
        self._cand_probs: list[np.ndarray] | None = None
        self._after_prefill = True
        # sampling_rule="rejection": children are drawn i.i.d. from the masks' distributions
        self._generator: torch.Generator | None = None
        self._draw_mode = False
        self._mask_probs: torch.Tensor | None = None
        self._last_draws: tuple[dict, dict] | None = None

    def draw_children(self, generator: torch.Generator | None) -> bool:
        """Draw children i.i.d. from the masks' distributions (for recursive rejection sampling)
        instead of taking the top candidates."""
        self._draw_mode = True
        self._generator = generator
        return True

    def start(self, prompt_ids: np.ndarray) -> None:
        self._cand_tokens = self._cand_probs = None
        self._after_prefill = True

    def propose(self, root_token: int, context: np.ndarray) -> TokenTree:
        self._last_draws = None
        if self._cand_tokens is None:
            return TokenTree.root_only(root_token)
        if self._draw_mode:
            return self._drawn_tree(root_token)
        return best_first(
            root_token,
            self._cand_tokens,
            self._cand_probs,
            self.max_nodes,
            prune_repeats=self.prune_repeats,
            first_level_only_top1=self._after_prefill,
        )

    @property
    def mask_top_k(self) -> int:
        """One spare candidate per depth, so that pruning a repeat leaves ``max_nodes`` options."""
        return self.max_nodes + 1

    def observe(self, feedback: StepFeedback) -> None:
        self._after_prefill = feedback.is_prefill
        if feedback.mask_logits is None:
            self._cand_tokens = self._cand_probs = None
            return
        # one spare candidate per depth so that pruning a repeat leaves max_nodes options
        self._cand_tokens, self._cand_probs = feedback.mask_candidates(self.mask_top_k)
        if self._draw_mode:
            self._mask_probs = torch.softmax(feedback.mask_logits.float(), dim=-1)

    def draft_distributions(self):
        return self._last_draws

    def _drawn_tree(self, root_token: int) -> TokenTree:
        """Breadth-first: each node draws i.i.d. from the distribution of the next depth until the
        node budget is spent (a draw of an existing child token adds a draw, not a node).  Whether a
        further draw is made depends only on earlier draws, which keeps recursive rejection exact.
        Repeat pruning does not apply: it would change the draft distribution."""
        budget = self.max_nodes
        depth_count = self._mask_probs.shape[0]
        per_node = max(1, budget if depth_count == 1 else int(np.ceil(budget / depth_count)))
        draws_per_node = per_node * 2  # a few repeats are expected; bound the work
        parents, tokens, owner_draws = [-1], [root_token], {}
        frontier = [0]
        depth = 0
        while frontier and depth < depth_count and len(tokens) - 1 < budget:
            q = self._mask_probs[depth]
            next_frontier = []
            for node in frontier:
                children: dict[int, int] = {}
                drawn: list[int] = []
                for tok in torch.multinomial(q, draws_per_node, replacement=True, generator=self._generator).tolist():
                    if tok not in children:
                        if len(tokens) - 1 >= budget or len(children) >= per_node:
                            break
                        children[tok] = len(tokens)
                        parents.append(node)
                        tokens.append(tok)
                        next_frontier.append(children[tok])
                    drawn.append(tok)
                if drawn:
                    owner_draws[node] = drawn
            frontier = next_frontier
            depth += 1
        tree = TokenTree(np.array(tokens), np.array(parents), np.ones(len(tokens)))
        node_depth = tree.depths
        q_by_node = {node: self._mask_probs[int(node_depth[node])] for node in owner_draws}
        self._last_draws = (q_by_node, owner_draws)
        return tree
