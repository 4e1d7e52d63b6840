"""Attention masks for a verification pass, as torch tensors.

A mask row is one input of the pass, a column one key: the cached keys first, then the pass's own
inputs.  Boolean masks use True = may attend (what ``sdpa`` takes); :func:`additive_mask` turns
them into 0 / ``finfo(dtype).min`` floats (what ``eager`` attention needs).  Every row sees at
least one key, so no row is fully masked.
"""

from __future__ import annotations

import numpy as np
import torch


def _as_bool_tensor(block_visible, device) -> torch.Tensor:
    if isinstance(block_visible, np.ndarray):
        return torch.tensor(block_visible, dtype=torch.bool, device=device)
    return block_visible.to(device=device, dtype=torch.bool)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean (True = attend) to additive float: 0 where visible, ``finfo(dtype).min`` elsewhere."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)


def full_attention_mask(
    block_visible,
    past_len: int,
    past_visible: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``[1, 1, N, past_len + N]`` bool: every row sees the whole cache (or ``past_visible``, a bool
    ``[past_len]`` for padded caches) and, within the block, what ``block_visible`` allows."""
    block = _as_bool_tensor(block_visible, device)
    n = block.shape[0]
    out = torch.empty((n, past_len + n), dtype=torch.bool, device=device)
    if past_visible is None:
        out[:, :past_len] = True
    else:
        out[:, :past_len] = past_visible.to(device=device, dtype=torch.bool)[None, :]
    out[:, past_len:] = block
    return out[None, None]


def sliding_attention_mask(
    block_visible,
    block_positions: torch.Tensor,
    kv_offset: int,
    kv_length: int,
    window: int,
    past_visible: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``[1, 1, N, kv_length]`` bool for a sliding-window layer.

    The layer holds the cached keys of positions ``kv_offset .. kv_offset + kv_length - N - 1``
    (the committed sequence is contiguous), followed by the N new inputs at ``block_positions``.
    A query at position q sees a key at position p only if ``p > q - window`` (transformers'
    convention) and the tree rules allow it.  ``past_visible`` (bool, over the same cached keys)
    masks padding.
    """
    block = _as_bool_tensor(block_visible, device)
    n = block.shape[0]
    cached = kv_length - n
    q = block_positions.to(device=device, dtype=torch.long).view(n, 1)
    past_pos = torch.arange(kv_offset, kv_offset + cached, device=device).view(1, cached)
    out = torch.empty((n, kv_length), dtype=torch.bool, device=device)
    out[:, :cached] = past_pos > q - window
    if past_visible is not None:
        out[:, :cached] &= past_visible.to(device=device, dtype=torch.bool)[None, :]
    out[:, cached:] = block & (q.view(1, n) > q - window)
    return out[None, None]
