"""Reductions over the vocabulary axis of logits, fast on a CPU.

On a CPU, torch's ``argmax`` and ``topk`` over a row of a large vocabulary run several times
slower than a plain ``amax`` (on a 262k-token vocabulary about ten times slower), and a
decoding step calls them on every verified node.  Both functions below view a row as blocks of
``BLOCK`` logits, reduce each block to its maximum with the fast kernel, and finish the exact
answer inside the few blocks that can hold it:

- :func:`vocab_argmax`: the first block whose maximum is the row's maximum holds the first
  maximal index, so the result is exactly ``torch.argmax`` (first occurrence on ties);
- :func:`vocab_topk`: the ``k`` largest logits lie in the ``k`` blocks with the largest maxima
  (a block outside them has a maximum below all ``k`` of theirs), so the values are exactly
  ``torch.topk``'s; among equal values the indices may differ, as ``torch.topk`` leaves open.

- :func:`top_probabilities`: the top ``k`` with their softmax probabilities, from torch's fused
  softmax kernel a few rows at a time (two rows per thread: about twice as fast as ``logsumexp``
  on several rows, whose kernel makes two passes and a temporary as large as its input).

Elsewhere (an accelerator, a vocabulary that is not a whole number of blocks, or too few blocks
for the block pass to pay), they call torch directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 64
# rows per softmax call in top_probabilities: each call writes a [rows, V] temporary (4 MB on Gemma 3)
SOFTMAX_ROWS = 4


def _blocks(logits: torch.Tensor, needed: int) -> torch.Tensor | None:
    """``logits`` ``[rows, V]`` viewed as ``[rows, V / BLOCK, BLOCK]``, or None where torch's own
    kernel is the better choice."""
    if logits.device.type != "cpu" or logits.dim() != 2:
        return None
    vocab = logits.shape[-1]
    if vocab % BLOCK or vocab // BLOCK < 8 * max(needed, 1):
        return None
    return logits.contiguous().view(logits.shape[0], vocab // BLOCK, BLOCK)


def vocab_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``[rows, V]`` logits (int64 ``[rows]``)."""
    grid = _blocks(logits, 1)
    if grid is None:
        return logits.argmax(dim=-1)
    block_max = grid.amax(dim=-1)
    row_max = block_max.amax(dim=-1, keepdim=True)
    if torch.isnan(row_max).any():  # argmax's NaN convention, kept by its own kernel
        return logits.argmax(dim=-1)
    first = (block_max == row_max).to(torch.uint8).argmax(dim=-1)  # first block holding the maximum
    inside = grid[torch.arange(grid.shape[0], device=grid.device), first].argmax(dim=-1)
    return first * BLOCK + inside


def vocab_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(logits, k, dim=-1)`` (sorted, descending) for ``[rows, V]`` logits: values and
    int64 indices, each ``[rows, k]``."""
    k = min(int(k), logits.shape[-1])
    grid = _blocks(logits, k)
    if grid is None:
        top = torch.topk(logits, k, dim=-1)
        return top.values, top.indices
    rows = grid.shape[0]
    best = torch.topk(grid.amax(dim=-1), k, dim=-1).indices  # [rows, k] blocks holding the top k
    inside = grid.gather(1, best.unsqueeze(-1).expand(-1, -1, BLOCK)).view(rows, k * BLOCK)
    top = torch.topk(inside, k, dim=-1)
    block = best.gather(1, top.indices // BLOCK)
    return top.values, block * BLOCK + top.indices % BLOCK


def top_probabilities(logits: torch.Tensor, k: int, rows_per_call: int = SOFTMAX_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits``: the ``k`` most probable tokens (most probable first) and their
    softmax probabilities.  The softmax runs ``rows_per_call`` rows at a time, so its temporary
    stays small (a 64-node tree's would be 67 MB on Gemma 3)."""
    logits = logits.float()
    _, indices = vocab_topk(logits, k)
    if logits.shape[0] <= rows_per_call:
        return indices, torch.softmax(logits, dim=-1).gather(1, indices)
    parts = zip(logits.split(rows_per_call), indices.split(rows_per_call))
    return indices, torch.cat([torch.softmax(rows, dim=-1).gather(1, top) for rows, top in parts])


@dataclass(frozen=True)
class RowTops:
    """The ``k`` most probable tokens of every row of a logits matrix (most probable first) with
    their probabilities (:func:`top_probabilities`), on the host.  Computed once per verification
    pass, it serves both the greedy walk (a row's argmax) and a drafter that learns from every
    verified row, so the vocabulary-wide reductions run once."""

    tokens: np.ndarray  # [rows, k] int64
    probs: np.ndarray  # [rows, k] float64

    @classmethod
    def of(cls, logits: torch.Tensor, k: int) -> RowTops:
        """From ``[rows, V]`` logits, in one transfer to the host (token ids, below 2**53, ride
        exactly in float64 beside the probabilities)."""
        tokens, probs = top_probabilities(logits, k)
        width = tokens.shape[1]
        both = torch.cat([tokens.double(), probs.double()], dim=1).cpu().numpy()
        return cls(both[:, :width].astype(np.int64), both[:, width:])

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def split(self, counts) -> list[RowTops]:
        """The tops of consecutive blocks of ``counts[i]`` rows each (views)."""
        ends = np.cumsum([0, *counts])
        return [RowTops(self.tokens[a:b], self.probs[a:b]) for a, b in zip(ends[:-1], ends[1:])]

    def argmax(self, row: int) -> int | None:
        """``argmax`` of row ``row`` when its most probable token is the only one with the largest
        logit, else None (a tie, NaN, or fewer than two tokens kept: ask the logits).  The
        probabilities of a row share one normaliser, so ``p0 > p1`` means the logits differ."""
        if self.width < 2 or not self.probs[row, 0] > self.probs[row, 1]:
            return None
        return int(self.tokens[row, 0])


def top_candidates(mask_logits: torch.Tensor, width: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per row j of ``mask_logits`` (mask j), the ``width`` most probable tokens and their
    probabilities (descending), on the host."""
    tops = RowTops.of(mask_logits, width)
    return list(tops.tokens), list(tops.probs)
