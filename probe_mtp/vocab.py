"""Reductions over the vocabulary axis of logits, fast on a CPU.

On a CPU, torch's ``argmax`` and ``topk`` over a row of a large vocabulary run several times
slower than a plain ``amax`` (Gemma 3, 262k tokens: ~0.35 ms per row each against ~0.03 ms), and a
decoding step calls them on every verified node.  Both functions below view a row as blocks of
``BLOCK`` logits, reduce each block to its maximum with the fast kernel, and finish the exact
answer inside the few blocks that can hold it:

- :func:`vocab_argmax`: the first block whose maximum is the row's maximum holds the first
  maximal index, so the result is exactly ``torch.argmax`` (first occurrence on ties);
- :func:`vocab_topk`: the ``k`` largest logits lie in the ``k`` blocks with the largest maxima
  (a block outside them has a maximum below all ``k`` of theirs), so the values are exactly
  ``torch.topk``'s; among equal values the indices may differ, as ``torch.topk`` leaves open.

Elsewhere (an accelerator, a vocabulary that is not a whole number of blocks, or too few blocks
for the block pass to pay), they call torch directly.
"""

from __future__ import annotations

import torch

BLOCK = 64
LSE_ROWS = 4  # rows per logsumexp call


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
    inside = grid[torch.arange(grid.shape[0]), first].argmax(dim=-1)
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


def logsumexp_rows(logits: torch.Tensor, rows_per_call: int = LSE_ROWS) -> torch.Tensor:
    """``torch.logsumexp(logits, -1, keepdim=True)``, a few rows at a time: the kernel writes a
    temporary as large as its input (67 MB for a 64-node tree on Gemma 3), which would add to the
    peak memory of a step."""
    if logits.shape[0] <= rows_per_call:
        return torch.logsumexp(logits, dim=-1, keepdim=True)
    return torch.cat([torch.logsumexp(part, dim=-1, keepdim=True) for part in logits.split(rows_per_call)])


def top_probabilities(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits``: the ``k`` most probable tokens (most probable first) and their
    softmax probabilities, without writing a probability for every token."""
    logits = logits.float()
    values, indices = vocab_topk(logits, k)
    return indices, torch.exp(values - logsumexp_rows(logits))
