"""The ESP input layout of one verification pass.

Inputs, in order: ``[root | draft nodes, breadth-first | k masks of node 0 | k masks of node 1 | ...]``
(or, when only some nodes carry masks, the k masks of each of those *owners* in node order).

- A node at depth d has position offset d (position id ``p0 + d``, p0 the root's position) and
  attends to the cache, its ancestors and itself.
- Mask j (1..k) of owner b has position offset ``depth(b) + j`` and attends to everything b attends
  to, plus b, plus b's masks 1..j.  It never sees other owners' masks.

A layout depends only on the tree's shape, k and the owners, so callers may cache it by
``TokenTree.shape_key``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .token_tree import TokenTree


@dataclass(frozen=True, eq=False)
class TreeLayout:
    """Where each input of the pass sits and what it may attend to (within the new block).

    - ``visible[q, kv]``: bool ``[N, N]``, the block part of the attention mask (the cache part is
      all-visible for every row, subject to sliding windows);
    - ``position_offsets[q]``: position id minus the root's position id;
    - ``owner[q]``: the tree node an input belongs to (itself for nodes);
    - ``mask_index[q]``: 0 for nodes, j (1..k) for mask j;
    - ``num_pad``: padding inputs at the end (see :func:`pad_layout`); owner -1, mask index 0.

    ``num_masks`` is k, the masks of each owner; ``mask_slots`` is empty for a node without masks.
    """

    tree_size: int
    num_masks: int
    visible: np.ndarray
    position_offsets: np.ndarray
    owner: np.ndarray
    mask_index: np.ndarray
    num_pad: int = 0

    @property
    def num_inputs(self) -> int:
        return int(self.position_offsets.shape[0])

    @property
    def is_mask(self) -> np.ndarray:
        return self.mask_index > 0

    def mask_slots(self, owner: int) -> np.ndarray:
        """Input indices of owner's masks 1..k, in order of j."""
        return np.flatnonzero((self.owner == owner) & (self.mask_index > 0))


def esp_layout(tree: TokenTree, num_masks: int, owners: np.ndarray | None = None) -> TreeLayout:
    """The layout of ``tree`` with ``num_masks`` masks on every node (``num_masks=0``: nodes only),
    or on the nodes listed in ``owners`` only (increasing node indices; the others carry none)."""
    if num_masks < 0:
        raise ValueError(f"num_masks must be >= 0, got {num_masks!r}")
    n, k = tree.size, num_masks
    if owners is None:
        owners = np.arange(n)
    else:
        owners = np.asarray(owners, dtype=np.int64).reshape(-1)
        if owners.size and (owners[0] < 0 or owners[-1] >= n or np.any(np.diff(owners) <= 0)):
            raise ValueError(f"owners must be increasing node indices below {n}, got {owners.tolist()}")
    m = owners.size
    total = n + m * k
    anc = tree.ancestor_matrix()  # [n, n]

    visible = np.zeros((total, total), dtype=bool)
    visible[:n, :n] = anc
    owner = np.concatenate([np.arange(n), np.repeat(owners, k)])
    mask_index = np.concatenate([np.zeros(n, dtype=np.int64), np.tile(np.arange(1, k + 1), m)])
    if k and m:
        mask_rows = np.arange(n, total)
        # what the owner sees (its ancestors and itself) ...
        visible[mask_rows, :n] = anc[owner[n:]]
        # ... plus the owner's own masks 1..j: block lower-triangular per owner
        tri = np.tril(np.ones((k, k), dtype=bool))
        blocks = visible[n:, n:].reshape(m, k, m, k)
        blocks[np.arange(m), :, np.arange(m), :] = tri
        visible[n:, n:] = blocks.reshape(m * k, m * k)
    position_offsets = (tree.depths[owner] + mask_index).astype(np.int64)
    for arr in (visible, position_offsets, owner, mask_index):
        arr.setflags(write=False)
    return TreeLayout(n, k, visible, position_offsets, owner, mask_index)


def prefill_layout(prompt_len: int, num_masks: int) -> TreeLayout:
    """Prefill: the prompt (causal) followed by k masks owned by the last prompt token.

    Position offsets are relative to the first prompt token (absolute positions for an empty
    cache).  ``owner`` of the masks is ``prompt_len - 1``.
    """
    if prompt_len < 1:
        raise ValueError("prompt_len must be >= 1")
    if num_masks < 0:
        raise ValueError(f"num_masks must be >= 0, got {num_masks}")
    p, k = prompt_len, num_masks
    total = p + k
    visible = np.tril(np.ones((total, total), dtype=bool))  # masks see the prompt and masks 1..j
    position_offsets = np.concatenate([np.arange(p), p - 1 + np.arange(1, k + 1)])
    owner = np.concatenate([np.arange(p), np.full(k, p - 1)])
    mask_index = np.concatenate([np.zeros(p, dtype=np.int64), np.arange(1, k + 1)])
    position_offsets = position_offsets.astype(np.int64)
    for arr in (visible, position_offsets, owner, mask_index):
        arr.setflags(write=False)
    return TreeLayout(p, k, visible, position_offsets, owner, mask_index)


def pad_layout(layout: TreeLayout, total: int) -> TreeLayout:
    """``layout`` with padding inputs appended up to ``total`` inputs.

    On a CPU a pass over 2-3 inputs can cost more than over 4-8 (BLAS handles 2-3 rows as separate
    vector products), so a small pass is cheaper padded.  A padding input repeats the root (position
    offset 0), sees the cache and itself only and is seen by nobody; its outputs are never read and
    its cache entries are dropped with the rest of the rejected inputs.
    """
    extra = int(total) - layout.num_inputs
    if extra < 0:
        raise ValueError(f"cannot pad {layout.num_inputs} inputs down to {total}")
    if extra == 0:
        return layout
    n = layout.num_inputs
    visible = np.zeros((total, total), dtype=bool)
    visible[:n, :n] = layout.visible
    visible[np.arange(n, total), np.arange(n, total)] = True
    position_offsets = np.concatenate([layout.position_offsets, np.zeros(extra, dtype=np.int64)])
    owner = np.concatenate([layout.owner, np.full(extra, -1, dtype=np.int64)])
    mask_index = np.concatenate([layout.mask_index, np.zeros(extra, dtype=np.int64)])
    for arr in (visible, position_offsets, owner, mask_index):
        arr.setflags(write=False)
    return TreeLayout(layout.tree_size, layout.num_masks, visible, position_offsets, owner, mask_index, layout.num_pad + extra)


class LayoutCache:
    """Layouts built once per (tree shape, k, padding, owners) and reused, least recently used
    dropped first beyond ``size`` entries (the paper's "cached mask": a step's attention mask and
    position offsets depend only on the tree's shape)."""

    def __init__(self, size: int = 256):
        self.size = int(size)
        self._layouts: OrderedDict[tuple, TreeLayout] = OrderedDict()

    def __len__(self) -> int:
        return len(self._layouts)

    def layout(self, tree: TokenTree, num_masks: int, pad_to: int = 0, owners: np.ndarray | None = None) -> TreeLayout:
        """``tree``'s layout with ``num_masks`` masks on every node (or on ``owners``), padded to
        ``pad_to`` inputs (0: none)."""
        key = (tree.shape_key, num_masks, pad_to, None if owners is None else tuple(owners.tolist()))
        found = self._layouts.get(key)
        if found is not None:
            self._layouts.move_to_end(key)
            return found
        built = esp_layout(tree, num_masks, owners)
        if pad_to:
            built = pad_layout(built, pad_to)
        self._layouts[key] = built
        if len(self._layouts) > self.size:
            self._layouts.popitem(last=False)
        return built
