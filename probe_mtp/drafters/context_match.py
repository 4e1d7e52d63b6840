"""Context lookup with every match: which tokens followed earlier occurrences of a suffix.

Prompt lookup (:mod:`probe_mtp.drafters.pld`) copies the continuation of one occurrence of the
longest matching n-gram.  The hybrid drafter wants all of them: for a token sequence ``suffix``
(the context, or the context followed by a draft path), every earlier position of the context
that holds ``suffix[-1]`` and has a next token is an occurrence; its *match length* is how many
trailing tokens of ``suffix`` agree with the context ending there (at most ``max_ngram``).  Each
distinct next token is then described by

- ``length``: the longest match among the occurrences it followed;
- ``share``: among all occurrences matching at least that long, the fraction it followed (1.0:
  every such occurrence agrees).

:class:`ContextIndex` answers this from n-gram tables grown as tokens are committed: a few dict
lookups per query, no scan of the context.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class ContextIndex:
    """n-gram tables of a growing context: for every n-gram (n = 1..``max_ngram``) that has
    occurred with a next token, how often each next token followed it and where last.

    :meth:`extend` indexes the tokens committed since the last call (the context only grows
    within one generation); :meth:`votes` answers a query."""

    def __init__(self, max_ngram: int):
        if int(max_ngram) < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram!r}")
        self.max_ngram = int(max_ngram)
        self.reset()

    def reset(self) -> None:
        # _tables[n - 1][ngram] = (occurrences, {next token: [count, last position]})
        self._tables: list[dict[tuple[int, ...], list]] = [{} for _ in range(self.max_ngram)]
        self._tokens: list[int] = []

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, context: np.ndarray) -> None:
        """Index ``context``, which must start with the tokens indexed so far."""
        new = np.asarray(context, dtype=np.int64).reshape(-1)[len(self._tokens) :].tolist()
        toks = self._tokens
        for nxt in new:
            end = len(toks) - 1  # the n-grams ending at `end` are now followed by `nxt`
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                key = tuple(toks[end - n + 1 : end + 1])
                entry = self._tables[n - 1].get(key)
                if entry is None:
                    entry = self._tables[n - 1][key] = [0, {}]
                entry[0] += 1
                seen = entry[1].get(nxt)
                if seen is None:
                    entry[1][nxt] = [1, end]
                else:
                    seen[0] += 1
                    seen[1] = end
            toks.append(nxt)

    def votes(self, suffix: Sequence[int]) -> tuple[list[int], list[int], list[float]]:
        """``(tokens, length, share)`` of the tokens that followed occurrences of ``suffix``'s
        tail in the indexed context (see the module docstring), best first: longest match, then
        largest share, then the most recent occurrence among those of the longest match.  Empty
        lists when ``suffix[-1]`` never occurred with a next token."""
        suffix = tuple(suffix)
        rows: list[tuple[int, float, int, int]] = []  # (-length, -share, -last position, token)
        found: set[int] = set()
        for n in range(min(self.max_ngram, len(suffix)), 0, -1):
            entry = self._tables[n - 1].get(suffix[len(suffix) - n :])
            if entry is None:
                continue
            total, nexts = entry
            for tok, (count, last) in nexts.items():
                if tok not in found:
                    found.add(tok)
                    rows.append((-n, -count / total, -last, tok))
        rows.sort()
        return [r[3] for r in rows], [-r[0] for r in rows], [-r[1] for r in rows]
