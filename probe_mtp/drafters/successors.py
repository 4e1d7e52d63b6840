"""A successor table built from the logits the verifier computes anyway (Token Recycling).

Source: X. Luo, Y. Wang, Q. Zhu, Z. Zhang, X. Zhang, Q. Yang, D. Xu, W. Che, "Turning Trash into
Treasure: Accelerating Inference of Large Language Models with Token Recycling", arXiv 2408.08696.

After every pass, each verified tree node's top-k next tokens (with their softmax probabilities)
are stored under the node's token, replacing what was there: "the next time this token appears,
these are its likely successors".  Token Recycling keys on the token alone; the table here also
keys on the last 2..``order`` tokens of the node's path, which name the context more precisely,
and :meth:`SuccessorTable.lookup` returns the entries of every key length.

Memory is fixed when the table is first written and never grows: like Token Recycling's
adjacency matrix, the one-token table is a ``[vocab, top_k]`` array, and each longer key length
has a direct-mapped table of ``slots`` rows (a key lives in the row its hash names, so a newer
key that hashes to the same row replaces an older one: the table forgets, it never grows).
"""

from __future__ import annotations

import numpy as np
import torch

from ..vocab import RowTops

# an entry: (tokens, probabilities), most probable first
Entry = tuple[list[int], list[float]]
DEFAULT_SLOTS = 1 << 16


def _last_occurrences(keys: np.ndarray) -> np.ndarray:
    """Positions of the last occurrence of every distinct value of ``keys`` (so that, as in a
    sequence of writes, the later row wins)."""
    reversed_first = np.unique(keys[::-1], return_index=True)[1]
    return keys.size - 1 - reversed_first


class _Rows:
    """``count`` rows of ``top_k`` (token, probability) pairs and, for hashed tables, the key each
    row holds."""

    def __init__(self, count: int, top_k: int, key_length: int):
        # np.full writes every page now, so the process's memory does not creep up as rows fill
        self.tokens = np.full((count, top_k), 0, dtype=np.int32)
        self.probs = np.full((count, top_k), 0.0, dtype=np.float32)
        self.width = np.full(count, 0, dtype=np.int16)  # stored successors; 0 = empty row
        self.keys = np.full((count, key_length), -1, dtype=np.int64) if key_length > 1 else None

    def entry(self, row: int) -> Entry:
        w = int(self.width[row])
        return self.tokens[row, :w].tolist(), self.probs[row, :w].tolist()


class SuccessorTable:
    """Latest top-``top_k`` successors per context of 1..``order`` tokens (one instance per
    generation).  ``order=1`` is Token Recycling's table; longer keys name the context more
    precisely and are found less often.  Keys of 2..``order`` tokens share ``slots`` rows per
    length (a power of two)."""

    def __init__(self, top_k: int = 8, order: int = 2, slots: int = DEFAULT_SLOTS):
        if int(top_k) < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k!r}")
        if int(top_k) > 1024:
            raise ValueError(f"top_k must be <= 1024, got {top_k!r}")
        if int(order) < 1:
            raise ValueError(f"order must be >= 1, got {order!r}")
        if int(slots) < 1 or int(slots) & (int(slots) - 1):
            raise ValueError(f"slots must be a power of two, got {slots!r}")
        self.top_k = int(top_k)
        self.order = int(order)
        self.slots = int(slots)
        self.reset()

    def reset(self) -> None:
        # _tables[n - 1]: keys of n tokens; allocated on the first write, once the vocabulary is known
        self._tables: list[_Rows] | None = None
        self._vocab = 0

    def __len__(self) -> int:
        """Tokens that have a one-token entry."""
        return 0 if self._tables is None else int(np.count_nonzero(self._tables[0].width))

    def _allocate(self, vocab: int) -> None:
        self._vocab = int(vocab)
        self._tables = [_Rows(self._vocab, self.top_k, 1)]
        self._tables += [_Rows(self.slots, self.top_k, n) for n in range(2, self.order + 1)]

    def _row(self, key: tuple[int, ...]) -> int:
        return key[0] if len(key) == 1 else hash(key) & (self.slots - 1)

    @torch.no_grad()
    def update(self, tails: list[tuple[int, ...]], logits: torch.Tensor) -> None:
        """Store row r of ``logits`` (the model's next-token logits after a sequence ending with
        ``tails[r]``, its last tokens) under each key formed by the last 1..``order`` tokens of
        ``tails[r]``.  Rows are written in order, so a later row wins over an earlier one."""
        self.store(tails, *self.candidates(logits), vocab=logits.shape[-1])

    def candidates(self, logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Per row of ``logits``: the ``top_k`` most probable tokens and their probabilities."""
        tops = RowTops.of(logits, self.top_k)
        return tops.tokens, tops.probs

    def store(self, tails: list[tuple[int, ...]], top_tokens: np.ndarray, top_probs: np.ndarray, vocab: int | None = None) -> None:
        """:meth:`update` with each row's successors given: ``top_tokens[r]`` (most probable first)
        with probabilities ``top_probs[r]``.  ``vocab`` sizes the one-token table on the first
        write (default: one past the largest token seen)."""
        toks = np.asarray(top_tokens, dtype=np.int64)[:, : self.top_k]
        ps = np.asarray(top_probs, dtype=np.float64)[:, : self.top_k]
        if self._tables is None:
            largest = max([max(t) for t in tails if t] + [int(toks.max(initial=0))])
            self._allocate(vocab if vocab is not None else largest + 1)
        width = toks.shape[1]
        for n, table in enumerate(self._tables, start=1):
            rows = [r for r, tail in enumerate(tails) if len(tail) >= n]
            if not rows:
                continue
            keys = [tuple(tails[r][-n:]) for r in rows]
            where = np.fromiter((self._row(key) for key in keys), dtype=np.int64, count=len(keys))
            if n == 1 and where.max() >= self._vocab:
                raise ValueError(f"token {int(where.max())} is outside the table's vocabulary of {self._vocab}")
            last = _last_occurrences(where)
            src = np.asarray(rows, dtype=np.int64)[last]
            at = where[last]
            table.tokens[at, :width] = toks[src]
            table.probs[at, :width] = ps[src]
            table.width[at] = width
            if table.keys is not None:
                table.keys[at] = np.asarray(keys, dtype=np.int64)[last]

    def nbytes(self) -> int:
        """Bytes of the tables (fixed once the first write has sized them)."""
        if self._tables is None:
            return 0
        return sum(t.tokens.nbytes + t.probs.nbytes + t.width.nbytes + (0 if t.keys is None else t.keys.nbytes)
                   for t in self._tables)

    def as_arrays(self) -> dict[str, np.ndarray]:
        """The tables as arrays (for saving); empty before the first write."""
        if self._tables is None:
            return {}
        out = {"vocab": np.array([self._vocab], dtype=np.int64)}
        for n, t in enumerate(self._tables, start=1):
            out.update({f"{n}/tokens": t.tokens, f"{n}/probs": t.probs, f"{n}/width": t.width})
            if t.keys is not None:
                out[f"{n}/keys"] = t.keys
        return out

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Tables saved by :meth:`as_arrays` (a ``ValueError`` when they do not fit this table's
        ``top_k``, ``order`` and ``slots``)."""
        self.reset()
        if not arrays:
            return
        self._allocate(int(np.asarray(arrays["vocab"]).reshape(-1)[0]))
        for n, t in enumerate(self._tables, start=1):
            for name in ("tokens", "probs", "width") + (("keys",) if t.keys is not None else ()):
                value = np.asarray(arrays[f"{n}/{name}"])
                target = getattr(t, name)
                if value.shape != target.shape:
                    raise ValueError(f"successor table {n}/{name} has shape {value.shape}, expected {target.shape}")
                target[...] = value
            if np.any(t.width < 0) or np.any(t.width > self.top_k) or np.any((t.tokens < 0) | (t.tokens >= self._vocab)):
                raise ValueError(f"successor table {n} holds entries outside its vocabulary or width")

    def lookup(self, tail: tuple[int, ...]) -> list[Entry | None]:
        """The entries under the last 1, 2, ..., ``order`` tokens of ``tail`` (None where absent)."""
        out: list[Entry | None] = [None] * self.order
        if self._tables is None:
            return out
        for n in range(1, min(self.order, len(tail)) + 1):
            key = tuple(tail[-n:])
            table = self._tables[n - 1]
            if n == 1:
                if not 0 <= key[0] < self._vocab or not table.width[key[0]]:
                    continue
                out[0] = table.entry(key[0])
                continue
            row = self._row(key)
            if table.width[row] and tuple(table.keys[row].tolist()) == key:
                out[n - 1] = table.entry(row)
        return out
