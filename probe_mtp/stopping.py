"""Stopping criteria decided on the host where transformers' own criteria allow it.

transformers' criteria return a bool tensor on the sequence's device, so reading one makes the
host wait for the device.  The three that ``model.generate`` builds from a generation config
depend only on what the host already knows: :class:`MaxLengthCriteria` on the sequence's length,
:class:`EosTokenCriteria` on its last token, :class:`MaxTimeCriteria` on the clock.  When a
request's criteria are only these (exactly these classes: a subclass may read more),
:class:`HostCriteria` answers them from the committed tokens on the host, with the same result;
any other criterion (a stop string, a user's own) is run as transformers runs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria


@dataclass(frozen=True)
class HostCriteria:
    """``max_lengths``: the length limits; ``eos``: the end-of-sequence ids; ``deadlines``:
    ``(start, seconds)`` of each time limit (``time.time()`` based, as transformers')."""

    max_lengths: tuple[int, ...]
    eos: np.ndarray
    deadlines: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, criteria) -> HostCriteria | None:
        """The host form of ``criteria`` (a ``StoppingCriteriaList``), or None when one of them
        is not a plain length, end-of-sequence or time limit."""
        lengths, eos, deadlines = [], [], []
        for c in criteria or ():
            kind = type(c)
            if kind is MaxLengthCriteria:
                lengths.append(int(c.max_length))
            elif kind is EosTokenCriteria:
                ids = c.eos_token_id
                eos.extend(ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else list(np.atleast_1d(ids)))
            elif kind is MaxTimeCriteria:
                deadlines.append((float(c.initial_timestamp), float(c.max_time)))
            else:
                return None
        return cls(tuple(lengths), np.asarray(eos, dtype=np.int64), tuple(deadlines))

    def stops(self, tokens: np.ndarray, length_before: int) -> np.ndarray:
        """Whether the criteria hold after each of ``tokens``, appended to a sequence of
        ``length_before`` tokens (padding included, as the criteria see it)."""
        lengths = length_before + 1 + np.arange(tokens.size)
        out = np.isin(tokens, self.eos)
        for limit in self.max_lengths:
            out |= lengths >= limit
        if self.deadlines:
            now = time.time()
            out |= any(now - start > seconds for start, seconds in self.deadlines)
        return out
