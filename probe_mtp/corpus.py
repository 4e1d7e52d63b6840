"""A bounded corpus of earlier token sequences with longest-match lookup of any length.

A suffix automaton (Blumer et al. 1985; SAM-Decoding, arXiv 2411.10666, drafts from one) over
every document of the corpus: each state stands for a set of substrings that end at the same
places, its transitions are the tokens that followed them anywhere in the corpus.  Reading a
sequence token by token (:meth:`SuffixAutomaton.advance`) keeps the longest suffix of it that occurs
in the corpus, in amortised constant time per token, so the decoder follows the committed text and
every draft path at the cost of a few dictionary lookups.  Documents are separated by a token that
never occurs in text, so a match never runs across two documents.

:class:`Corpus` bounds the automaton: documents are kept in order, and when the estimated size
passes ``max_bytes`` the oldest documents go first and the automaton is rebuilt from the rest
(down to ``REBUILD_SHARE`` of the cap, so rebuilds are rare: their cost spreads over many
requests).  Its size is estimated from what it holds (tokens, states, transitions), never from the
process's memory.
"""

from __future__ import annotations

import sys
from array import array
from collections import deque

import numpy as np

SEPARATOR = -1  # between documents: never a token, so no match crosses it
NO_TOKEN = -2  # an empty inline transition slot
REBUILD_SHARE = 0.75  # after eviction the corpus holds at most this share of its cap
# bytes per stored item, beyond the containers' own tables (CPython 3.11, 64-bit): a dict entry's
# key and value int objects; a state's arrays; a token
TRANSITION_BYTES = 64
STATE_BYTES = 4 * 5
TOKEN_BYTES = 4


class SuffixAutomaton:
    """The suffix automaton of a sequence of documents, built online (one token at a time).

    Per state: ``length`` (of its longest substring), ``link`` (suffix link), ``end`` (where its
    first occurrence ends, an index into ``tokens``) and its transitions: one inline
    (``one_token`` -> ``one_next``) and the rest, for the few states with several, in ``more``.
    """

    def __init__(self):
        self.tokens = array("i")
        self.length = array("i", [0])
        self.link = array("i", [-1])
        self.end = array("i", [-1])
        self.one_token = array("i", [NO_TOKEN])
        self.one_next = array("i", [0])
        self.more: dict[int, dict[int, int]] = {}
        self.last = 0

    @property
    def num_states(self) -> int:
        return len(self.length)

    def next_state(self, state: int, token: int) -> int:
        """The state reached from ``state`` by ``token``, or -1."""
        if self.one_token[state] == token:
            return self.one_next[state]
        extra = self.more.get(state)
        return -1 if extra is None else extra.get(token, -1)

    def successors(self, state: int) -> list[int]:
        """Every token that followed the substrings of ``state`` somewhere in the corpus."""
        first = self.one_token[state]
        if first == NO_TOKEN:
            return []
        extra = self.more.get(state)
        out = [first] if first != SEPARATOR else []
        if extra:
            out.extend(t for t in extra if t != SEPARATOR)
        return out

    def _set(self, state: int, token: int, target: int) -> None:
        if self.one_token[state] in (NO_TOKEN, token):
            self.one_token[state] = token
            self.one_next[state] = target
        else:
            self.more.setdefault(state, {})[token] = target

    def _new_state(self, length: int, link: int, end: int) -> int:
        self.length.append(length)
        self.link.append(link)
        self.end.append(end)
        self.one_token.append(NO_TOKEN)
        self.one_next.append(0)
        return len(self.length) - 1

    def extend(self, token: int) -> None:
        """Append one token (the standard online construction)."""
        self.tokens.append(token)
        cur = self._new_state(self.length[self.last] + 1, 0, len(self.tokens) - 1)
        p = self.last
        while p != -1 and self.next_state(p, token) == -1:
            self._set(p, token, cur)
            p = self.link[p]
        if p != -1:
            q = self.next_state(p, token)
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = self._new_state(self.length[p] + 1, self.link[q], self.end[q])
                self.one_token[clone] = self.one_token[q]
                self.one_next[clone] = self.one_next[q]
                if q in self.more:
                    self.more[clone] = dict(self.more[q])
                while p != -1 and self.next_state(p, token) == q:
                    self._set(p, token, clone)
                    p = self.link[p]
                self.link[q] = clone
                self.link[cur] = clone
        self.last = cur

    def add_document(self, tokens) -> None:
        for t in np.asarray(tokens, dtype=np.int64).tolist():
            self.extend(int(t))
        self.extend(SEPARATOR)

    def advance(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Read one more token: the state and length of the longest suffix (of what was read, then
        ``token``) that occurs in the corpus."""
        while True:
            nxt = self.next_state(state, token)
            if nxt != -1:
                return nxt, matched + 1
            if state == 0:
                return 0, 0
            state = self.link[state]
            matched = self.length[state]

    def match(self, tokens) -> tuple[int, int]:
        """:meth:`advance` over ``tokens`` from the empty match."""
        state, matched = 0, 0
        for t in tokens:
            state, matched = self.advance(state, matched, int(t))
        return state, matched

    def nbytes(self) -> int:
        """Estimated bytes held (tokens, state arrays, transitions and their dictionaries)."""
        extra = sum(len(d) for d in self.more.values())
        dicts = sys.getsizeof(self.more) + sum(sys.getsizeof(d) for d in self.more.values())
        return len(self.tokens) * TOKEN_BYTES + self.num_states * STATE_BYTES + extra * TRANSITION_BYTES + dicts


class Corpus:
    """Earlier documents (prompts with their outputs), oldest first, under ``max_bytes``; see the
    module docstring.  ``max_bytes=0`` keeps nothing."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.documents: deque[np.ndarray] = deque()
        self.automaton = SuffixAutomaton()
        self.rebuilds = 0

    def __len__(self) -> int:
        """Tokens held."""
        return sum(int(d.size) for d in self.documents)

    def nbytes(self) -> int:
        return self.automaton.nbytes() + sum(int(d.nbytes) for d in self.documents)

    def add(self, tokens) -> None:
        """Remember one document; the oldest ones go when the corpus would pass its cap."""
        doc = np.asarray(tokens, dtype=np.int32).reshape(-1).copy()
        if doc.size == 0 or self.max_bytes <= 0:
            return
        self.documents.append(doc)
        self.automaton.add_document(doc)
        if self.nbytes() > self.max_bytes:
            self._evict()

    def _evict(self) -> None:
        """Drop the oldest documents until the rest fits ``REBUILD_SHARE`` of the cap, and rebuild."""
        per_token = self.nbytes() / max(len(self), 1)
        keep, total = [], 0
        for doc in reversed(self.documents):
            total += doc.size
            if total * per_token > REBUILD_SHARE * self.max_bytes:
                break
            keep.append(doc)
        self.documents = deque(reversed(keep))
        self._rebuild()
        while self.documents and self.nbytes() > self.max_bytes:  # the estimate per token was low
            self.documents.popleft()
            self._rebuild()

    def _rebuild(self) -> None:
        self.automaton = SuffixAutomaton()
        for doc in self.documents:
            self.automaton.add_document(doc)
        self.rebuilds += 1

    def clear(self) -> None:
        self.documents.clear()
        self.automaton = SuffixAutomaton()

    # the corpus as two arrays (for saving) and back
    def to_arrays(self) -> dict[str, np.ndarray]:
        docs = list(self.documents)
        tokens = np.concatenate(docs).astype(np.int32) if docs else np.zeros(0, dtype=np.int32)
        return {"tokens": tokens, "lengths": np.array([d.size for d in docs], dtype=np.int64)}

    def load_arrays(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        if lengths.sum() != tokens.size or np.any(lengths <= 0):
            raise ValueError("corpus arrays are inconsistent")
        self.clear()
        start = 0
        for n in lengths.tolist():
            self.documents.append(np.asarray(tokens[start : start + n], dtype=np.int32).copy())
            start += n
        self._rebuild()
        if self.nbytes() > self.max_bytes:
            self._evict()
