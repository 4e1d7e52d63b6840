"""Prompt lookup decoding (PLD): draft by copying what followed an earlier occurrence of the last
n-gram.

Source: A. Saxena, "Prompt Lookup Decoding" (github.com/apoorvumang/prompt-lookup-decoding, 2023),
in transformers as ``generate(prompt_lookup_num_tokens=..., max_matching_ngram_size=...)``
(``PromptLookupCandidateGenerator``).

Rule: for n = ``max_ngram`` (3), then 2, then 1, look for an earlier occurrence of the last n
tokens of the context (prompt + generated text, root last); at the first n with a match, propose
the tokens that followed that occurrence as a chain of up to ``budget - 1`` tokens (``BC = chain
length + 1``, no masks).  No match at any n: a root-only tree (one plain decoding step).

Where this differs from transformers' ``PromptLookupCandidateGenerator``:

- which occurrence: by default (``match="recent"``) the *most recent* earlier occurrence is used
  (the one nearest to the end of the context); transformers takes the *first* (leftmost) one.
  ``match="first"`` reproduces transformers' choice exactly.
- length: up to ``budget - 1`` tokens (the same block-complexity budget as every drafter here)
  instead of ``prompt_lookup_num_tokens`` (10 in the ESP paper and Spec-Bench).  ``budget=11``
  gives transformers' default chain length.
- transformers crops a draft at the first EOS token and checks drafts against logits processors;
  the greedy tree verifier here needs neither (EOS is handled by the decoder when committed).
- like transformers, a continuation that runs into the end of the context is simply shorter.
"""

from __future__ import annotations

import numpy as np

from ..tree import TokenTree, chain, node_budget
from .base import Drafter

MATCH_MODES = ("recent", "first")


def lookup_continuation(context: np.ndarray, max_ngram: int, max_tokens: int, match: str = "recent") -> np.ndarray:
    """The tokens that followed an earlier occurrence of the longest matching suffix n-gram
    (n = ``max_ngram`` .. 1) of ``context``; empty when nothing matches.

    Vectorised: candidate occurrences are the earlier positions holding the last token; each
    longer n filters them by one more comparison."""
    ctx = np.asarray(context, dtype=np.int64).reshape(-1)
    length = ctx.size
    if length < 2 or max_tokens <= 0:
        return ctx[:0]
    # ends[i]: index of the last token of a candidate occurrence (strictly before the suffix)
    ends = np.flatnonzero(ctx[: length - 1] == ctx[-1])
    if ends.size == 0:
        return ctx[:0]
    # matched[n-1]: occurrences matching the last n tokens
    matched = [ends]
    for n in range(2, min(max_ngram, length - 1) + 1):
        prev = matched[-1]
        prev = prev[prev >= n - 1]
        matched.append(prev[ctx[prev - (n - 1)] == ctx[length - n]])
    for occ in reversed(matched):  # longest n first
        if occ.size:
            end = int(occ[-1] if match == "recent" else occ[0])
            return ctx[end + 1 : end + 1 + max_tokens]
    return ctx[:0]


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding: a chain copied from the context after the last n-gram's earlier
    occurrence (n = 3, 2, 1)."""

    name = "pld"

    def __init__(self, budget: int, max_ngram: int = 3, match: str = "recent"):
        super().__init__(budget)
        node_budget(self.budget, 0)  # clear error when not even one draft node fits
        if int(max_ngram) < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram!r}")
        if match not in MATCH_MODES:
            raise ValueError(f"match must be one of {MATCH_MODES}, got {match!r}")
        self.max_ngram = int(max_ngram)
        self.match = match

    def propose(self, root_token: int, context: np.ndarray) -> TokenTree:
        draft = lookup_continuation(context, self.max_ngram, self.node_limit, self.match)
        if draft.size == 0:
            return TokenTree.root_only(root_token)
        return chain(root_token, draft)
