"""STAND-style drafting from an n-gram memory of the model's own logits.

Source: W. Song, S. Dingliwal, S. M. Jayanthi, B. Ganesh, J. Shin, A. Galstyan, S. B. Bodapati,
"Accelerated Test-Time Scaling with Model-Free Speculative Sampling" (STAND: STochastic Adaptive
N-gram Drafting), arXiv 2506.04708.  No code is public; this is our implementation of its idea.

The idea kept: an n-gram table whose entries are not single next tokens but the model's own
next-token *distributions* (top-k tokens with probabilities), learnt for free from the logits the
verification pass computes anyway, and a draft *tree* grown from that table.

This implementation:

- **Memory.**  After every pass, for each tree node the pass verified, the top-``top_k`` tokens of
  its logits and their softmax probabilities are stored under two keys: the node's last token and
  its last two tokens (the context ending at that node).  Every node's logits are the model's
  exact next-token distribution after that node's path, so rejected branches teach the memory too
  (``learn_from="all"``, default; ``"accepted"`` keeps only the accepted path, i.e. committed
  text).  Accepted nodes are written last.  An entry seen again is replaced
  (``merge="latest"``, default: the most recent context is the best guess for greedy decoding) or
  averaged (``merge="mean"``: running mean over the union of tokens, cut back to top-k).  The
  prefill's last-position logits are stored the same way.
- **Prompt seeding** (``seed_from_prompt``, default on): before generation every bigram/trigram
  of the prompt enters the memory as an empirical (count-normalised) distribution, so copying
  from the prompt works from the first step; the model's own distributions later replace these
  entries (``merge="mean"``: merge into them).
- **Drafting.**  Best-first expansion: a node's children are the stored top-k of the key formed by
  its last two tokens (falling back to its last token alone); a candidate's score is the product
  of stored probabilities along its path; the ``budget - 1`` best candidates are kept (a child
  never outscores its parent, so the kept set is a tree).  ``BC = 1 + draft nodes <= budget``.

Differences from the paper:

- *Deterministic drafting.*  STAND samples children with Gumbel-Top-K (stochastic drafting that
  raises acceptance under speculative *sampling*); for greedy decoding we take the deterministic
  top-k, so runs are reproducible.
- *Tree shape.*  STAND builds its tree from a shape tuned offline on data ("data-driven tree
  construction"); we grow a dynamic best-first tree under the block-complexity budget, as every
  drafter in this package does.
- *Keys.*  We key on the last one and two tokens (two first, one as fall-back); the paper's module
  covers several n-gram orders; exact orders, top-k size and how repeated entries are merged are
  our choices (``top_k=10``, latest entry wins, rejected nodes' logits stored too).
- *Prompt seeding* with text n-grams is our addition (the paper's memory is built from logits of
  generated trajectories; the prompt's positions have no logits here, because the prefill keeps
  only the last one).
- No cross-request memory: the table is reset in :meth:`start`; the paper shares it across the
  trajectories of one test-time-scaling run.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from ..tree import TokenTree, node_budget
from ..vocab import RowTops
from .base import Drafter, StepFeedback

MERGE_MODES = ("mean", "latest")
LEARN_FROM = ("accepted", "all")

# an entry: (tokens int64[k'], probs float64[k'], count)
Entry = tuple[np.ndarray, np.ndarray, int]


class StandDrafter(Drafter):
    """Best-first trees from an n-gram memory of the model's own top-k distributions; see the
    module docstring."""

    name = "stand"

    def __init__(
        self,
        budget: int,
        top_k: int = 10,
        merge: str = "latest",
        learn_from: str = "all",
        seed_from_prompt: bool = True,
    ):
        super().__init__(budget)
        node_budget(self.budget, 0)
        if int(top_k) < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k!r}")
        if merge not in MERGE_MODES:
            raise ValueError(f"merge must be one of {MERGE_MODES}, got {merge!r}")
        if learn_from not in LEARN_FROM:
            raise ValueError(f"learn_from must be one of {LEARN_FROM}, got {learn_from!r}")
        self.top_k = int(top_k)
        self.merge = merge
        self.learn_from = learn_from
        self.seed_from_prompt = bool(seed_from_prompt)
        self._memory: dict[tuple[int, ...], Entry] = {}
        self._before_root: int | None = None  # the token before the root of the last pass

    # ------------------------------------------------------------------ memory
    def start(self, prompt_ids: np.ndarray) -> None:
        self._memory = {}
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        self._before_root = int(prompt[-2]) if prompt.size >= 2 else None  # the prefill's root is prompt[-1]
        if self.seed_from_prompt:
            self._seed(prompt.tolist())

    def _seed(self, toks: list[int]) -> None:
        counts: dict[tuple[int, ...], dict[int, int]] = {}
        for i in range(1, len(toks)):
            nxt = toks[i]
            for key in ((toks[i - 1],), tuple(toks[i - 2 : i]) if i >= 2 else None):
                if key is None:
                    continue
                c = counts.setdefault(key, {})
                c[nxt] = c.get(nxt, 0) + 1
        k = self.top_k
        for key, c in counts.items():
            items = sorted(c.items(), key=lambda kv: -kv[1])[:k]
            total = sum(c.values())
            self._memory[key] = (
                np.array([t for t, _ in items], dtype=np.int64),
                np.array([n for _, n in items], dtype=np.float64) / total,
                total,
            )

    def store(self, key: tuple[int, ...], tokens: np.ndarray, probs: np.ndarray) -> None:
        """Merge a top-k distribution into the entry of ``key``."""
        old = self._memory.get(key)
        if old is None or self.merge == "latest":
            self._memory[key] = (tokens, probs, 1)
            return
        ot, op, n = old
        acc = dict(zip(ot.tolist(), (op * n).tolist()))
        for t, p in zip(tokens.tolist(), probs.tolist()):
            acc[t] = acc.get(t, 0.0) + p
        items = sorted(acc.items(), key=lambda kv: -kv[1])[: self.top_k]
        self._memory[key] = (
            np.array([t for t, _ in items], dtype=np.int64),
            np.array([p for _, p in items], dtype=np.float64) / (n + 1),
            n + 1,
        )

    def lookup(self, prev: int | None, last: int) -> Entry | None:
        """The stored distribution after ``(prev, last)``, else after ``last`` alone."""
        if prev is not None:
            hit = self._memory.get((prev, last))
            if hit is not None:
                return hit
        return self._memory.get((last,))

    # ------------------------------------------------------------------ drafting
    def propose(self, root_token: int, context: np.ndarray) -> TokenTree:
        root = int(root_token)
        prev = int(context[-2]) if len(context) >= 2 else None
        self._before_root = prev
        tokens, parents, scores = [root], [-1], [1.0]
        heap: list[tuple[float, int, int, int]] = []  # (-score, tiebreak, parent, token)
        counter = 0

        def push_children(node: int, before: int | None, last: int, score: float) -> None:
            nonlocal counter
            hit = self.lookup(before, last)
            if hit is None:
                return
            for t, p in zip(hit[0].tolist(), hit[1].tolist()):
                if p > 0.0:
                    heapq.heappush(heap, (-score * p, counter, node, t))
                    counter += 1

        push_children(0, prev, root, 1.0)
        budget = self.node_limit
        while heap and len(tokens) - 1 < budget:
            neg, _, parent, tok = heapq.heappop(heap)
            node = len(tokens)
            tokens.append(tok)
            parents.append(parent)
            scores.append(-neg)
            push_children(node, tokens[parent], tok, -neg)
        if len(tokens) == 1:
            return TokenTree.root_only(root)
        return _tree_from_parents(tokens, parents, scores)

    # ------------------------------------------------------------------ learning
    @property
    def node_top_k(self) -> int:
        """Learning from every verified row: the decoder computes each row's top ``top_k`` once
        (``StepFeedback.node_tops``) and its greedy walk shares them."""
        return self.top_k if self.learn_from == "all" else 0

    @torch.no_grad()
    def observe(self, feedback: StepFeedback) -> None:
        tree = feedback.tree
        before_root = self._before_root
        accepted = np.asarray(feedback.accepted, dtype=np.int64)
        if self.learn_from == "all":
            # rejected nodes are written first, so that the accepted path's (real-text)
            # distributions win under merge="latest"
            rows = np.concatenate([np.setdiff1d(np.arange(tree.size), accepted), accepted])
        else:
            rows = accepted
        k = min(self.top_k, feedback.node_logits.shape[-1])
        tops = feedback.node_tops
        if tops is not None and tops.width >= k:
            toks_all, probs_all = tops.tokens[rows, :k], tops.probs[rows, :k]
        else:  # only the rows it stores
            picked = feedback.node_logits.index_select(0, torch.from_numpy(rows).to(feedback.node_logits.device))
            tops = RowTops.of(picked, k)
            toks_all, probs_all = tops.tokens, tops.probs
        tree_tokens = tree.tokens
        tree_parents = tree.parents
        for r, node in enumerate(rows.tolist()):
            last = int(tree_tokens[node])
            par = int(tree_parents[node])
            before = int(tree_tokens[par]) if par >= 0 else before_root
            self.store((last,), toks_all[r], probs_all[r])
            if before is not None:
                self.store((before, last), toks_all[r], probs_all[r])


def _tree_from_parents(tokens: list[int], parents: list[int], scores: list[float]) -> TokenTree:
    """A breadth-first :class:`TokenTree` from nodes listed parents-first (any depth order)."""
    toks = np.asarray(tokens, dtype=np.int64)
    par = np.asarray(parents, dtype=np.int64)
    n = toks.size
    depth = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        depth[i] = depth[par[i]] + 1
    order = np.lexsort((np.arange(n), depth))
    new_index = np.empty(n, dtype=np.int64)
    new_index[order] = np.arange(n)
    new_par = np.where(par[order] >= 0, new_index[np.maximum(par[order], 0)], -1)
    return TokenTree(toks[order], new_par, np.asarray(scores, dtype=np.float64)[order])
