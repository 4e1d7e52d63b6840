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

from .acceptance import Verdict
from .generation import Generation
from .kv import keep_accepted
from .passes import assemble_inputs
from .step import Strategy, commit, feed_back, finish_prefill, node_tops, prefill_pass, propose, verify_pass
from .tree import TokenTree


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


def extend_confident(tokens: np.ndarray, token_scores, mask_logits: torch.Tensor | None, threshold: float):
    """Append the confident run of ``mask_logits`` to the verified ``tokens``.

    Returns ``(tokens, scores, masks left, run)``: the tokens to commit, their ``[1, V]`` score rows
    (the masks' raw logits for the unverified ones), the masks left for proposing the next tree
    (None when none is left) and how many tokens are unverified."""
    run = confident_run(mask_logits, threshold)
    if run == 0:
        return tokens, token_scores, mask_logits, 0
    extra_logits = mask_logits[:run]
    extra = extra_logits.argmax(dim=-1).cpu().numpy()
    out = np.concatenate([np.asarray(tokens, dtype=np.int64), extra])
    if token_scores is not None:
        dtype = token_scores[0].dtype if len(token_scores) else extra_logits.dtype
        token_scores = list(token_scores) + list(extra_logits.to(dtype).split(1))
    rest = mask_logits[run:]
    return out, token_scores, (rest if rest.shape[0] else None), run


class ConfAdapt:
    """The ConfAdapt strategy of one generation (:class:`probe_mtp.step.Strategy`): the lossless
    stages, then the confident run of the deepest accepted node's masks, emitted unverified.
    ``pending``: committed tokens not yet in the KV cache (the root excluded), which the next pass
    feeds as a chain in front of the drafted tree."""

    def __init__(self, threshold: float):
        self.threshold = float(threshold)
        self.pending: list[int] = []

    def strategy(self) -> Strategy:
        return Strategy(self.prefill, self.step)

    def prefill(self, gen: Generation) -> None:
        result = prefill_pass(gen)
        result.verdict, result.mask_logits = self.extend(gen, result.verdict, result.mask_logits)
        finish_prefill(gen, result)

    def step(self, gen: Generation) -> None:
        tree = propose(gen)
        plan = gen.policy.plan(tree, gen.cached)
        m = len(self.pending)
        full = graft_chain(self.pending, plan.tree)
        owners = None if plan.owners is None else plan.owners + m
        layout = gen.layout(full, plan.num_masks, 0 if m else plan.pad_to, owners)
        masks = gen.masks if plan.num_masks else None
        inputs = assemble_inputs(gen.parts.embed, full, layout, masks, gen.cached - m, gen.cache, gen.parts.fmt)
        logits = verify_pass(gen, full, layout, inputs)
        node_logits = logits.nodes[m:]
        tops = node_tops(gen, node_logits)
        verdict = gen.accept(plan.tree, node_logits, gen.sequence[0], tops)
        gen.policy.observe(plan.tree, verdict.path)
        keep = np.concatenate([np.arange(m), verdict.path + m])
        keep_accepted(gen.cache, layout.num_inputs, keep)
        mask_logits = logits.masks_of(verdict.last + m) if plan.num_masks else None
        verdict, mask_logits = self.extend(gen, verdict, mask_logits)
        gen.stats.accepted_lengths.append(commit(gen, verdict.tokens, verdict.scores))
        feed_back(gen, plan.tree, verdict, node_logits, mask_logits, tops)

    def extend(self, gen: Generation, verdict: Verdict, mask_logits: torch.Tensor | None):
        """The verdict with the confident run appended, and the masks left for the next tree."""
        tokens, scores, rest, run = extend_confident(verdict.tokens, verdict.scores, mask_logits, self.threshold)
        # the bonus token and all emitted tokens but the last (the next root) wait for the cache
        self.pending = [int(t) for t in tokens[len(verdict.tokens) - 1 : -1]] if run else []
        gen.stats.unverified_tokens += run
        return Verdict(verdict.path, tokens, scores), rest
