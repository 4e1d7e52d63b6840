"""A successor table built from the logits the verifier computes anyway (Token Recycling).

Source: X. Luo, Y. Wang, Q. Zhu, Z. Zhang, X. Zhang, Q. Yang, D. Xu, W. Che, "Turning Trash into
Treasure: Accelerating Inference of Large Language Models with Token Recycling", arXiv 2408.08696.

After every pass, each verified tree node's top-k next tokens (with their softmax probabilities)
are stored under the node's token, replacing what was there: "the next time this token appears,
these are its likely successors".  Token Recycling keys on the token alone; the table here also
keys on the last 2..``order`` tokens of the node's path, which name the context more precisely,
and :meth:`SuccessorTable.lookup` returns the entries of every key length.
"""

from __future__ import annotations

import numpy as np
import torch

# an entry: (tokens, probabilities), most probable first
Entry = tuple[list[int], list[float]]


class SuccessorTable:
    """Latest top-``top_k`` successors per context of 1..``order`` tokens (one instance per
    generation).  ``order=1`` is Token Recycling's table; longer keys name the context more
    precisely and are found less often."""

    def __init__(self, top_k: int = 8, order: int = 2):
        if int(top_k) < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k!r}")
        if int(order) < 1:
            raise ValueError(f"order must be >= 1, got {order!r}")
        self.top_k = int(top_k)
        self.order = int(order)
        self.reset()

    def reset(self) -> None:
        # _tables[n - 1]: key = the last n tokens
        self._tables: list[dict[tuple[int, ...], Entry]] = [{} for _ in range(self.order)]

    def __len__(self) -> int:
        return len(self._tables[0])

    @torch.no_grad()
    def update(self, tails: list[tuple[int, ...]], logits: torch.Tensor) -> None:
        """Store row r of ``logits`` (the model's next-token logits after a sequence ending with
        ``tails[r]``, its last tokens) under each key formed by the last 1..``order`` tokens of
        ``tails[r]``.  Rows are written in order, so a later row wins over an earlier one."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        k = min(self.top_k, logits.shape[-1])
        top = torch.topk(logits, k, dim=-1)
        probs = torch.exp(top.values - torch.logsumexp(logits, dim=-1, keepdim=True))
        self.store(tails, top.indices.cpu().numpy(), probs.double().cpu().numpy())

    def store(self, tails: list[tuple[int, ...]], top_tokens: np.ndarray, top_probs: np.ndarray) -> None:
        """:meth:`update` with each row's successors given: ``top_tokens[r]`` (most probable first)
        with probabilities ``top_probs[r]``."""
        toks = np.asarray(top_tokens, dtype=np.int64)[:, : self.top_k].tolist()
        ps = np.asarray(top_probs, dtype=np.float64)[:, : self.top_k].tolist()
        for r, tail in enumerate(tails):
            entry = (toks[r], ps[r])
            for n in range(1, min(self.order, len(tail)) + 1):
                self._tables[n - 1][tuple(tail[-n:])] = entry

    def lookup(self, tail: tuple[int, ...]) -> list[Entry | None]:
        """The entries under the last 1, 2, ..., ``order`` tokens of ``tail`` (None where absent)."""
        return [self._tables[n - 1].get(tuple(tail[-n:])) if len(tail) >= n else None for n in range(1, self.order + 1)]
