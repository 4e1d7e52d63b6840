"""Acceptance rules: which drafted tokens a verification pass accepts, chosen once per request.

Every rule walks the tree from the root and returns a :class:`Verdict`: the accepted path, the
tokens it commits (the accepted draft tokens and one bonus token from the last accepted node) and
the processed score row of each token.  All three are lossless:

- :class:`Greedy`: the model's argmax at each node; move to the child carrying it.  The output is
  exactly greedy decoding's.
- :class:`SampleAndMatch`: draw ``x ~ p`` at each node (p: the processed target distribution);
  move to the child carrying x, else x is the bonus.  Every token is drawn from exactly the
  distribution plain sampling would use.
- :class:`RecursiveRejection`: for children drawn i.i.d. from q, accept child c with probability
  ``min(1, p(c) / q(c))``; on rejection ``p <- norm(max(p - q, 0))``; the bonus comes from the
  last p.  Exact too, with higher acceptance, for drafters that draw their children.

The lossy ConfAdapt rule is not here: it runs after a lossless verdict (:mod:`probe_mtp.confadapt`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .drafters import Drafter
from .tree import TokenTree
from .verify import (
    NodeRows,
    accept_greedy,
    accept_greedy_lazily,
    accept_recursive_rejection,
    accept_sample_and_match,
    accept_sample_and_match_at_once,
    node_targets,
    process_node_logits,
    process_node_row,
)
from .vocab import RowTops, vocab_argmax


@dataclass
class Verdict:
    """What a pass accepted: ``path`` (node indices, root first), ``tokens`` (the accepted draft
    tokens then the bonus token) and ``scores`` (the ``[1, V]`` processed score row of each token)."""

    path: np.ndarray
    tokens: np.ndarray
    scores: Sequence[torch.Tensor]

    @property
    def last(self) -> int:
        """The deepest accepted node (whose masks seed the next tree)."""
        return int(self.path[-1])


class AcceptanceRule(ABC):
    """``rule(tree, node_logits, context, tops)`` -> :class:`Verdict`.  ``node_logits``:
    ``[tree.size, V]`` raw logits; ``context``: every committed token (1D, root last), which the
    logits processors read together with each node's own path; ``tops``: every node's most
    probable tokens when the pass computed them (None otherwise)."""

    # True: the rule needs the drafter's tree as proposed (a budget policy must not cut it)
    needs_whole_tree = False

    def __init__(self, processors):
        self.processors = processors or None

    @abstractmethod
    def __call__(self, tree: TokenTree, node_logits: torch.Tensor, context: torch.Tensor,
                 tops: RowTops | None = None) -> Verdict:
        ...

    def _verdict(self, tree: TokenTree, path: np.ndarray, bonus: int, scores) -> Verdict:
        return Verdict(path, np.append(tree.tokens[path[1:]], bonus), scores)


class Greedy(AcceptanceRule):
    """The greedy walk.  It reads the argmax from ``tops`` (on the host already) where no processor
    changes the logits.  Otherwise, on a CPU, it asks only the nodes it reaches (about tau rows,
    not the tree) for their processed row and argmax, and processed rows are made again when the
    stopping criteria read them rather than all kept; on an accelerator it processes every row and
    moves the targets to the host in one transfer."""

    def __init__(self, processors, lazy: bool):
        super().__init__(processors)
        self.lazy = lazy

    def __call__(self, tree, node_logits, context, tops=None) -> Verdict:
        processors = self.processors
        # off the CPU the walk reads the tops when they answer (no processor changes the logits);
        # else it moves every node's target to the host at once: one transfer, not one per node
        if not self.lazy and (tops is None or processors):
            scores = process_node_logits(processors, context, tree, node_logits)
            targets = node_targets(scores)  # one transfer beats a sync per node
            path = accept_greedy(tree, targets)
            return self._verdict(tree, path, int(targets[path[-1]]), [scores[j : j + 1] for j in path.tolist()])

        def row(node: int) -> torch.Tensor:
            return process_node_row(processors, context, tree, node_logits, node)

        known = tops if tops is not None and not processors else None

        def target_of(node: int) -> int:
            target = known.argmax(node) if known is not None else None
            return int(vocab_argmax(row(node))[0]) if target is None else target

        path, bonus = accept_greedy_lazily(tree, target_of)
        nodes = path.tolist()
        return self._verdict(tree, path, bonus, NodeRows(row, nodes) if processors else [row(j) for j in nodes])


class SampleAndMatch(AcceptanceRule):
    """Sample-and-match.  On a CPU each draw is made when the walk reaches its node; on an
    accelerator every node's draw is made up front and read back at once, drawing the same tokens
    (:func:`~probe_mtp.verify.accept_sample_and_match_at_once`)."""

    def __init__(self, processors, generator: torch.Generator | None, lazy: bool = True):
        super().__init__(processors)
        self.generator = generator
        self.lazy = lazy

    def __call__(self, tree, node_logits, context, tops=None) -> Verdict:
        scores = process_node_logits(self.processors, context, tree, node_logits)
        path, bonus = self.walk(tree, torch.softmax(scores, dim=-1))
        return self._verdict(tree, path, bonus, [scores[j : j + 1] for j in path.tolist()])  # views

    def walk(self, tree: TokenTree, probs: torch.Tensor):
        if not self.lazy and tree.size > 1:
            walked = accept_sample_and_match_at_once(tree, probs, self.generator)
            if walked is not None:
                return walked
        return accept_sample_and_match(tree, probs, self.generator)


class RecursiveRejection(SampleAndMatch):
    """Recursive rejection over the children the drafter drew (``drafter.draft_distributions()``);
    a tree that was not drawn (the root alone after the prefill) is walked by sample-and-match.
    The draws must be verified as drawn: cutting some (as the adaptive budget would) would leave
    draws that are no longer i.i.d. from q."""

    needs_whole_tree = True

    def __init__(self, processors, generator: torch.Generator | None, drafter: Drafter):
        super().__init__(processors, generator)  # the drawn tree's walk reads as it goes
        self.drafter = drafter

    def walk(self, tree: TokenTree, probs: torch.Tensor):
        draft = self.drafter.draft_distributions()
        if draft is None:
            return super().walk(tree, probs)
        return accept_recursive_rejection(tree, probs, draft[0], draft[1], self.generator)


def acceptance_rule(do_sample: bool, sampling_rule: str, processors, generator, drafter: Drafter,
                    device: torch.device) -> AcceptanceRule:
    """The rule for one request (asks the drafter to draw its children for recursive rejection)."""
    if not do_sample:
        return Greedy(processors, lazy=device.type == "cpu")
    if sampling_rule == "rejection" and drafter.draw_children(generator):
        return RecursiveRejection(processors, generator, drafter)
    return SampleAndMatch(processors, generator, lazy=device.type == "cpu")
