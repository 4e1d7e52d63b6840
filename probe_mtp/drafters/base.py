"""The drafter interface: every hook the decoding loop calls, with its default.

A drafter proposes the token tree the next pass verifies and learns from what verification found.
The loop calls, per generation:

- :meth:`Drafter.start` once with the prompt;
- per step :meth:`Drafter.propose` (after setting :attr:`Drafter.min_score` and
  :attr:`Drafter.node_cap`; a batched step that
  skips drafting calls :meth:`Drafter.skip_proposal` instead), then
  :meth:`Drafter.mask_owners` / :meth:`Drafter.mask_free_nodes` through the budget policy, and
  :meth:`Drafter.observe` with the pass's :class:`StepFeedback` (also after the prefill);
- for ``sampling_rule="rejection"``: :meth:`Drafter.draw_children` once, and
  :meth:`Drafter.draft_distributions` after each proposal.

Only :meth:`propose` is abstract; a drafter that proposes from the context alone needs nothing else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..tree import TokenTree
from ..vocab import RowTops

MASK_USES = ("required", "optional", "none")


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
      computed them (at least ``Drafter.node_top_k`` wide); None: read ``node_logits``;
    - ``mask_tops``: the same for the rows of ``mask_logits`` (at least ``Drafter.mask_top_k``
      wide), on the host; None: read ``mask_logits``.
    """

    tree: TokenTree
    accepted: np.ndarray
    new_tokens: np.ndarray
    node_logits: torch.Tensor
    mask_logits: torch.Tensor | None
    context: np.ndarray
    is_prefill: bool = False
    node_tops: RowTops | None = None
    mask_tops: RowTops | None = None

    def mask_candidates(self, width: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per mask row, its ``width`` most probable tokens and their probabilities (from
        ``mask_tops`` when wide enough: no further transfer from the device)."""
        tops = self.mask_tops
        if tops is None or tops.width < min(width, self.mask_logits.shape[-1]):
            tops = RowTops.of(self.mask_logits, width)
        return list(tops.tokens[:, :width]), list(tops.probs[:, :width])


class Drafter(ABC):
    """Proposes trees; ``num_masks`` mask inputs are appended to every node of its trees, or to the
    nodes :meth:`mask_owners` names.

    Class attributes the registry (:mod:`probe_mtp.drafters.registry`) and the configuration read:

    - ``name``: the drafter's name in ``ProbeConfig.drafter``, the CLI and the report;
    - ``mask_use``: ``"required"`` (needs ``num_masks`` >= 1), ``"optional"`` (``num_masks=0``
      turns the probe off) or ``"none"`` (appends no masks; ``num_masks`` does not apply);
    - ``budget_free``: its trees do not depend on the budget (measured once in a budget sweep).
    """

    name: ClassVar[str] = "drafter"
    mask_use: ClassVar[str] = "none"
    budget_free: ClassVar[bool] = False
    num_masks: int = 0
    # nodes carrying the masks when only some do (see mask_owners); None: every node
    mask_nodes: int | None = None

    def __init__(self, budget: int):
        self.budget = int(budget)
        # set before each proposal by the budget policy: nodes scoring below it would be cut from
        # the tree anyway, so a drafter that grows its tree node by node may stop there
        self.min_score = 0.0
        # set before each proposal of a batched step: at most this many draft nodes fit the row's
        # part of the pass (None: no cap beyond the budget); a drafter may stop growing there
        self.node_cap: int | None = None

    @classmethod
    def from_config(cls, config) -> "Drafter":
        """The drafter a :class:`~probe_mtp.config.ProbeConfig` asks for, sized by its
        ``tree_budget`` (``budget``, or ``max_budget`` when the budget is adaptive)."""
        return cls(config.tree_budget)

    @property
    def max_nodes(self) -> int:
        """Draft nodes (root excluded) that fit the budget with this drafter's masks."""
        return self.budget // (self.num_masks + 1) - 1

    @property
    def node_limit(self) -> int:
        """:attr:`max_nodes`, or fewer when a batched step caps the tree (:attr:`node_cap`)."""
        return self.max_nodes if self.node_cap is None else max(0, min(self.max_nodes, self.node_cap))

    @property
    def node_top_k(self) -> int:
        """How many of every verified node's most probable tokens :meth:`observe` reads (0: none);
        the decoder then computes them once per pass (``StepFeedback.node_tops``) and its greedy
        walk reads them too."""
        return 0

    @property
    def mask_top_k(self) -> int:
        """How many of each mask row's most probable tokens :meth:`observe` reads (0: none); the
        decoder computes them with the pass's other reads from the device
        (``StepFeedback.mask_tops``)."""
        return 0

    def attach_memory(self, memory) -> None:
        """Share the decoder's drafting memory (:class:`probe_mtp.memory.DraftingMemory`), called
        before :meth:`start`; a drafter that learns across requests keeps its learning there."""

    def start(self, prompt_ids: np.ndarray) -> None:
        """Reset per-generation state for a new prompt."""

    @abstractmethod
    def propose(self, root_token: int, context: np.ndarray) -> TokenTree:
        """The tree to verify next; ``context`` holds every committed token (root last)."""

    def skip_proposal(self) -> None:
        """The next pass verifies the root alone and :meth:`propose` was not called for it (a batched
        step that skips drafting): forget the last proposal, so that :meth:`observe` does not
        score it against tokens it was not made for."""

    def mask_owners(self, tree: TokenTree) -> np.ndarray | None:
        """The nodes of ``tree`` (the last proposed tree) that carry the ``num_masks`` masks, in
        increasing order; None: every node.  ``StepFeedback.mask_logits`` is None after a pass whose
        deepest accepted node carried none."""
        return None

    def mask_free_nodes(self, tree: TokenTree) -> np.ndarray | None:
        """For the adaptive budget: which nodes of the proposed ``tree`` (a bool per node) came from
        sources that need no masks on the previous pass; None: none of them (every draft depends on
        the masks), which is also what a mask-free drafter never gets asked."""
        return None

    def observe(self, feedback: StepFeedback) -> None:
        """Learn from a verification pass (called after prefill too)."""

    def draw_children(self, generator: torch.Generator | None) -> bool:
        """For ``sampling_rule="rejection"``: switch to drawing each node's children i.i.d. from a
        distribution (with ``generator``) and return True, or return False when this drafter cannot
        (sampling then uses sample-and-match, exact for any tree)."""
        return False

    def draft_distributions(self):
        """After :meth:`draw_children`: ``(q, draws)`` of the last proposed tree, where ``q[node]``
        is the distribution the node's children were drawn from (i.i.d.) and ``draws[node]`` the
        draws in order; ``None`` when that tree was not drawn (a root-only tree)."""
        return None
