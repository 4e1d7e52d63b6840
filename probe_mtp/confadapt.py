"""ConfAdapt: an opt-in, LOSSY acceptance rule (Kirchenbauer et al., arXiv 2602.06019).

After the lossless verification of a pass (accepted draft tokens + the model's bonus token), the
masks of the deepest accepted node hold predictions for the tokens right after the bonus token:
mask 1 for the next, mask 2 for the one after, and so on.  ConfAdapt also emits the longest run of
those predictions, from mask 1 on, whose top-1 probability is at least ``threshold`` - without
verifying them.  The output is then no longer guaranteed to equal greedy decoding.

The unverified tokens are committed but their keys and values are not in the KV cache, and neither
is the bonus token.  The next pass therefore feeds them as a chain in front of the new tree: the
chain ``pending[0] -> ... -> pending[-1] -> root -> drafted subtree`` is one token tree whose first
nodes are forced (committed already) and whose subtree is verified as usual.  Such a pass holds the
chain nodes (and their masks) on top of the budget: ``len(pending) * (k + 1)`` more inputs.  The
masks already spent on emitted tokens cannot propose the next tree; the drafter gets the remaining
masks (none when every mask was emitted: the next tree is the root alone).
"""

from __future__ import annotations

import numpy as np
import torch

from .tree import TokenTree

ACCEPTANCE_RULES = ("verify", "confadapt")


def graft_chain(prefix: list[int] | np.ndarray, tree: TokenTree) -> TokenTree:
    """The tree ``prefix[0] -> ... -> prefix[-1] -> tree``: nodes ``0 .. m-1`` are the chain and
    node ``m + i`` is ``tree``'s node i (breadth-first order is kept)."""
    m = len(prefix)
    if m == 0:
        return tree
    parents = np.concatenate([np.arange(-1, m - 1), np.where(tree.parents < 0, m - 1, tree.parents + m)])
    tokens = np.concatenate([np.asarray(prefix, dtype=np.int64), tree.tokens])
    scores = np.concatenate([np.ones(m), tree.scores])
    return TokenTree(tokens, parents, scores)


def confident_run(mask_logits: torch.Tensor, threshold: float) -> int:
    """How many masks, from mask 1 on, predict their top-1 token with probability ``>= threshold``."""
    if mask_logits is None or mask_logits.shape[0] == 0:
        return 0
    top = torch.softmax(mask_logits.float(), dim=-1).max(dim=-1).values
    below = (top < threshold).nonzero()
    return int(below[0, 0]) if below.numel() else int(top.shape[0])


class ConfAdaptRule:
    """The state of ConfAdapt in one generation: which committed tokens still wait for the cache."""

    def __init__(self, threshold: float):
        self.threshold = float(threshold)
        self.pending: list[int] = []  # committed, not cached, before the root (the root is the last token)

    def extend(self, new_tokens: np.ndarray, token_scores: list[torch.Tensor] | None, mask_logits: torch.Tensor | None):
        """Append the confident run of ``mask_logits`` to the verified ``new_tokens``.

        Returns ``(tokens, scores, drafter_mask_logits, unverified)``: the tokens to commit, their
        ``[1, V]`` score rows (the masks' raw logits for the unverified ones), the masks left for
        proposing the next tree (None when none is left) and how many tokens are unverified."""
        run = confident_run(mask_logits, self.threshold)
        if run == 0:
            self.pending = []
            return new_tokens, token_scores, mask_logits, 0
        extra_logits = mask_logits[:run]
        extra = extra_logits.argmax(dim=-1).cpu().numpy()
        tokens = np.concatenate([np.asarray(new_tokens, dtype=np.int64), extra])
        if token_scores is not None:
            dtype = token_scores[0].dtype if token_scores else extra_logits.dtype
            token_scores = list(token_scores) + list(extra_logits.to(dtype).split(1))
        self.pending = [int(new_tokens[-1])] + [int(t) for t in extra[:-1]]
        rest = mask_logits[run:]
        return tokens, token_scores, (rest if rest.shape[0] else None), run
