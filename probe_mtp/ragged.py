"""The KV cache of a batch whose rows hold different numbers of tokens.

Every layer is one reserved buffer ``[rows, heads, capacity, dim]`` (sliding-window layers too: the
window is applied by the attention mask, on positions) and the rows share its slots: a pass
appends N slots to every row; afterwards each row keeps the entries of its accepted path, moved
to the front of its new slots, so the cache grows by the longest accepted path and the other rows
are left with a few empty slots.  ``positions[r, s]`` is the position id of row ``r``'s token in
slot ``s``, -1 for a slot that holds none of its tokens (left padding, a hole); the attention mask
hides those.  When holes pass a share of the cache, every row's entries are moved together to the
end (as left padding would place them) and the cache shrinks back.  Rows that finish are dropped
from the batch, so they cost nothing in later passes.
"""

from __future__ import annotations

import numpy as np
import torch

from .kv import ReservedLayer, select_batch_rows

# the cache is compacted when its slots exceed the longest row's tokens by this share (and slack)
HOLE_SHARE = 0.25
HOLE_SLACK = 32


class RaggedCache:
    """``cache`` (a DynamicCache whose layers are all :class:`~probe_mtp.kv.ReservedLayer`) with the
    per-row slot positions; see the module docstring."""

    def __init__(self, cache, rows: int, capacity: int, device: torch.device):
        if not all(isinstance(layer, ReservedLayer) for layer in cache.layers):
            raise ValueError("a ragged cache needs every layer reserved (new_cache(..., every_layer=True))")
        self.cache = cache
        self.positions = torch.full((rows, capacity), -1, dtype=torch.long, device=device)
        self.length = 0  # slots in use
        self.held = np.zeros(rows, dtype=np.int64)  # tokens held per row, on the host

    @property
    def rows(self) -> int:
        return self.positions.shape[0]

    def _room(self, needed: int) -> None:
        if needed > self.positions.shape[1]:
            extra = torch.full((self.rows, needed - self.positions.shape[1] + 256), -1, dtype=torch.long,
                               device=self.positions.device)
            self.positions = torch.cat([self.positions, extra], dim=1)

    def tokens(self) -> torch.Tensor:
        """Tokens held per row."""
        return (self.positions[:, : self.length] >= 0).sum(dim=1)

    # ---------------------------------------------------------------- attention masks
    def masks(self, block_visible: torch.Tensor, query_positions: torch.Tensor, window: int | None) -> dict[str, torch.Tensor]:
        """Boolean ``[rows, 1, N, length + N]`` masks for a pass of N inputs per row:
        ``{"full_attention": ..., "sliding_attention": ...}`` (the second when ``window``).
        ``block_visible[r]``: what the row's inputs may see of each other; ``query_positions[r]``:
        their position ids."""
        past = self.positions[:, : self.length]  # [B, T]
        valid = past >= 0
        n = query_positions.shape[1]
        full = torch.cat([valid[:, None, :].expand(-1, n, -1), block_visible], dim=2)
        out = {"full_attention": full[:, None]}
        if window is not None:
            q = query_positions[:, :, None]
            near_past = valid[:, None, :] & (past[:, None, :] > q - window)
            near_block = block_visible & (query_positions[:, None, :] > q - window)
            out["sliding_attention"] = torch.cat([near_past, near_block], dim=2)[:, None]
        return out

    # ---------------------------------------------------------------- after a pass
    def prefill(self, pads: list[int], written: int, kept: int) -> None:
        """After a prefill pass that wrote ``written`` slots of left-padded prompts: keep the first
        ``kept`` (the prompts; the masks after them go); row r's prompt starts at slot ``pads[r]``."""
        self._cut(kept)
        self._room(kept)
        slots = torch.arange(kept, device=self.positions.device)
        for r, pad in enumerate(pads):
            self.positions[r, :kept] = torch.where(slots >= pad, slots - pad, -1)
        self.held = np.array([kept - pad for pad in pads], dtype=np.int64)
        self.length = kept

    def write_row(self, row: int, start: int, source, count: int) -> None:
        """Copy the first ``count`` entries of every layer of ``source`` (a cache of the same model
        holding one row, e.g. that row's own prefill) into row ``row``'s slots from ``start`` on.
        The buffers are allocated for every row at the first write; :meth:`prefill` then sets the
        slots' positions."""
        for into, layer in zip(self.cache.layers, source.layers):
            if not into.is_initialized:
                heads, _, dim = layer.keys.shape[1:]
                into.lazy_initialization(layer.keys.new_zeros((self.rows, heads, 0, dim)),
                                         layer.values.new_zeros((self.rows, heads, 0, layer.values.shape[3])))
            into._key_buffer[row, :, start : start + count] = layer.keys[0, :, :count]
            into._value_buffer[row, :, start : start + count] = layer.values[0, :, :count]

    def keep(self, written: int, kept: list[np.ndarray], positions: list[np.ndarray]) -> None:
        """After a pass that appended ``written`` slots to every row: row r keeps its inputs
        ``kept[r]`` (indices into the pass, increasing), whose position ids are ``positions[r]``."""
        start = self.length
        longest = max(k.size for k in kept)
        index = np.empty((self.rows, longest), dtype=np.int64)
        new_positions = np.full((self.rows, longest), -1, dtype=np.int64)  # -1: a hole
        is_prefix = True
        for r, (k, pos) in enumerate(zip(kept, positions)):
            index[r, : k.size] = k
            index[r, k.size :] = k[-1]  # repeated, then hidden
            new_positions[r, : k.size] = pos
            is_prefix = is_prefix and int(k[-1]) == k.size - 1  # increasing from 0: the first k.size inputs
        if not is_prefix:
            index_t = torch.from_numpy(index + start).to(self.positions.device)
            for layer in self.cache.layers:
                for buffer in (layer._key_buffer, layer._value_buffer):
                    picked = buffer.gather(2, index_t[:, None, :, None].expand(-1, buffer.shape[1], -1, buffer.shape[3]))
                    buffer[:, :, start : start + longest] = picked
        self._cut(start + longest)
        self._room(start + longest)
        self.positions[:, start : start + longest] = torch.from_numpy(new_positions).to(self.positions.device)
        self.length = start + longest
        self.held += np.array([k.size for k in kept], dtype=np.int64)
        if self.length > (1 + HOLE_SHARE) * int(self.held.max()) + HOLE_SLACK:
            self.compact()

    def compact(self) -> None:
        """Move every row's entries to the end of the cache (in order), dropping the holes."""
        longest = int(self.held.max())
        index = torch.zeros((self.rows, longest), dtype=torch.long, device=self.positions.device)
        new_positions = torch.full((self.rows, longest), -1, dtype=torch.long, device=self.positions.device)
        for r in range(self.rows):
            slots = torch.nonzero(self.positions[r, : self.length] >= 0).reshape(-1)
            index[r, longest - slots.numel() :] = slots
            new_positions[r, longest - slots.numel() :] = self.positions[r, slots]
        for layer in self.cache.layers:
            for buffer in (layer._key_buffer, layer._value_buffer):
                picked = buffer.gather(2, index[:, None, :, None].expand(-1, buffer.shape[1], -1, buffer.shape[3]))
                buffer[:, :, :longest] = picked
        self._cut(longest)
        self.positions[:, :longest] = new_positions
        self.positions[:, longest:] = -1
        self.length = longest

    def select(self, rows: list[int]) -> None:
        """Keep only the batch rows ``rows`` (the finished ones leave)."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.positions.device)
        select_batch_rows(self.cache, index)
        self.positions = self.positions.index_select(0, index)
        self.held = self.held[np.asarray(rows, dtype=np.int64)]

    def _cut(self, length: int) -> None:
        for layer in self.cache.layers:
            layer.keys = layer._key_buffer[:, :, :length]
            layer.values = layer._value_buffer[:, :, :length]
