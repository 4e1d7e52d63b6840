"""One training pass of self-distilled mask vectors, as plain index arithmetic.

For a teacher sequence ``x`` (prompt + greedy continuation) every continuation position t (and the
last prompt token, which owns the masks at prefill) is an *owner*: exactly as in a decoding pass of
a chain, its k masks sit at positions ``t + 1 .. t + k``, see ``x[0..t]`` (from the KV cache) and
their own owner's masks ``1..j``, and mask j is trained to predict ``x[t + 1 + j]`` (the owner's
own logits predict ``x[t + 1]``; mask j looks j tokens further).  The real tokens never see a mask,
so their keys and values are computed once per sequence and kept in a cache; one pass then feeds
only the masks of every owner at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE = -100


@dataclass(frozen=True)
class OwnerBatch:
    """The mask inputs of one training pass over one sequence.

    - ``owner[q]`` / ``slot[q]``: the owner position and the mask slot (0-based: slot 0 is mask 1)
      of input q; inputs are grouped by owner, slots in order;
    - ``positions[q] = owner + slot + 1``;
    - ``targets[q] = x[owner + slot + 2]`` (``IGNORE`` past the end of the sequence);
    - ``past_visible[q, c]``: input q sees cached position c (``c <= owner``);
    - ``block_visible[q, r]``: input q sees input r (same owner, ``slot_r <= slot_q``).
    """

    owner: np.ndarray
    slot: np.ndarray
    positions: np.ndarray
    targets: np.ndarray
    past_visible: np.ndarray
    block_visible: np.ndarray

    @property
    def size(self) -> int:
        return int(self.owner.shape[0])


def default_owners(seq_len: int, prompt_len: int) -> np.ndarray:
    """The last prompt token (the prefill's owner) and every continuation position whose mask 1
    still has a target: ``prompt_len - 1 .. seq_len - 3``."""
    return np.arange(prompt_len - 1, seq_len - 2, dtype=np.int64)


def owner_batch(ids: np.ndarray, owners: np.ndarray, num_masks: int, past_len: int) -> OwnerBatch:
    """The batch for ``owners`` (positions in ``ids``, each ``< past_len``) with ``num_masks`` masks each."""
    ids = np.asarray(ids, dtype=np.int64)
    owners = np.asarray(owners, dtype=np.int64)
    if owners.size == 0:
        raise ValueError("a training pass needs at least one owner position")
    if owners.max() >= past_len or owners.min() < 0:
        raise ValueError(f"owner positions must lie in [0, {past_len}) (the cached prefix)")
    k = int(num_masks)
    owner = np.repeat(owners, k)
    slot = np.tile(np.arange(k, dtype=np.int64), owners.size)
    positions = owner + slot + 1
    target_pos = owner + slot + 2
    targets = np.full(owner.shape, IGNORE, dtype=np.int64)
    inside = target_pos < ids.shape[0]
    targets[inside] = ids[target_pos[inside]]
    past_visible = np.arange(past_len)[None, :] <= owner[:, None]
    same_owner = owner[:, None] == owner[None, :]
    block_visible = same_owner & (slot[None, :] <= slot[:, None])
    return OwnerBatch(owner, slot, positions, targets, past_visible, block_visible)


def attention_mask(batch: OwnerBatch, fmt, sliding: bool):
    """The ``attention_mask`` argument of the pass: ``[1, 1, N, past + N]`` (bool for sdpa,
    additive for eager); for sliding-window models the same mask for both layer kinds (the
    sequence fits the window, see :func:`probe_mtp.distill.teacher.context_limit`)."""
    full = np.concatenate([batch.past_visible, batch.block_visible], axis=1)
    mask = fmt.finish(torch.from_numpy(full).to(fmt.device)[None, None])
    if sliding:
        return {"full_attention": mask, "sliding_attention": mask}
    return mask


def ema_anchors(token_embeds: torch.Tensor, prompt_len: int, ema: float) -> torch.Tensor:
    """The untuned mask vector the decoder holds when position t owns the masks, for every t
    ``>= prompt_len - 1``: the prompt's mean embedding, then the EMA update with each token after
    the prompt up to t (``m <- m + ema (E[x_t] - m)``).  ``token_embeds``: ``[L, H]``.  Returns
    ``[L, H]`` float64 (rows before ``prompt_len - 1`` repeat the prompt mean)."""
    e = token_embeds.double()
    out = torch.empty_like(e)
    m = e[:prompt_len].mean(0)
    out[:prompt_len] = m
    for t in range(prompt_len, e.shape[0]):
        m = m + ema * (e[t] - m)
        out[t] = m
    return out
