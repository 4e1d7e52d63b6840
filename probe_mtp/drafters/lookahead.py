"""Lookahead decoding (LADE) as a drafter of the tree verifier.

Source: Y. Fu, P. Bailis, I. Stoica, H. Zhang, "Break the Sequential Dependency of LLM Inference
Using Lookahead Decoding", arXiv 2402.02057 (ICML 2024); reference code hao-ai-lab/LookaheadDecoding
(``lade/decoding.py``, greedy path) and llama.cpp's ``examples/lookahead``.

The method, in the terms of this package.  Three numbers: N (n-gram size), W (window columns),
G (verification candidates).

- **Jacobi window**: N-1 levels x W columns of guessed tokens.  The token at level l, column i
  guesses the token at position ``p0 + i + l`` (p0: the root's position); level 0, column 0 *is*
  the root.  Level 0 forms a chain (the "spine") ``root -> L0[1] -> ... -> L0[W-1]``; column i
  continues from spine node i (the root for i = 0) downwards: ``L1[i] -> ... -> L_{N-2}[i]``.
  So the lookahead branch is W tree paths, path i = ``L0[1..i] + L1[i] .. L_{N-2}[i]``, which all
  share the spine.  The logits at the tail of column i (position ``i + N - 2``) are the next Jacobi
  guess for position ``i + N - 1``.
- **Window update** (every step, after the pass; LADE's ``ALWAYS_FWD_ONE``): the new guesses
  become the last level and every level moves up one (``level l <- level l+1``), which keeps each
  token's position right when one token is committed.  When a step commits more than one token the
  window is still shifted by one only, as in LADE: the Jacobi trajectories then run a little behind
  the text, and keep producing n-grams.
- **n-gram pool**: after each step, column i yields the N-gram ``(L0[i] (the root for i = 0),
  L1[i], ..., L_{N-2}[i], new guess i)``, stored under its first token.  With ``pool_from_context``
  (default, LADE's ``POOL_FROM_PROMPT=True`` as used in its examples and in Spec-Bench) every
  N-gram of the prompt and of the committed text is stored too.  Each key keeps at most G distinct
  (N-1)-token continuations, least recently seen evicted first (LADE's LRU list).
- **Verification branch**: the pool's continuations for the root token, at most G paths of N-1
  tokens each, merged with the lookahead paths by :meth:`TokenTree.from_paths`.

Block complexity: ``1 + (W - 1) + (N - 2) W = (N - 1) W`` lookahead inputs (the root included)
plus ``G (N - 1)`` verification inputs, ``BC = (N - 1)(W + G) <= budget``.  The paper's settings
(N, W, G) = (3, 4, 1), (4, 5, 5), (5, 8, 7) are used for BC = 10, 30, 60; other budgets use
:func:`lookahead_shape` (same rule: N from the budget, ``W + G = budget // (N - 1)``, G about half of
it once there is room, a single candidate below that).

Where this differs from LADE's own 2D attention pattern and loop:

1. *Same attention, expressed as a tree.*  In LADE a level-0 token attends causally to the root
   and the level-0 tokens before it; a token at level l >= 1, column i attends to the root, to
   level-0 columns 1..i and to levels 1..l of its own column; position ids are ``p0 + i + l``.
   That is exactly the ancestor relation and the depth-based positions of the tree above, so each
   lookahead and verification token sees the same keys at the same positions as in LADE and its
   logits are the same.  Verification candidates attend to the root and their own earlier tokens,
   as in LADE.
2. *Every node is a candidate.*  LADE verifies only the G pool n-grams; here the verifier walks the
   whole tree, so a lookahead path (spine or column) that happens to agree with the model is
   accepted too.  Lossless either way; it can only raise the accepted length.
3. *Shared prefixes are computed once.*  ``from_paths`` merges equal prefixes (a verification
   candidate that starts like the spine, two candidates with a common first token); LADE feeds
   duplicates as separate inputs.  A pass can therefore be smaller than ``(N - 1)(W + G)``; the
   freed inputs are not refilled.  Likewise the verification branch is smaller while the pool
   holds fewer than G continuations for the root (as in LADE).
4. *Window start.*  LADE fills the window from random prompt tokens (``random.choice``, unseeded)
   and grows it one level per step during a warm-up.  Here all N-1 levels start as prompt tokens
   drawn by a seeded generator (deterministic per prompt) and the full window is fed from the
   first step; n-grams are only harvested once levels 1..N-2 hold model guesses (after N-2
   steps).
5. *Column 0's n-gram* starts with the root (LADE's greedy code does the same; llama.cpp uses the
   stale level-0 guess there).
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import torch

from ..tree import TokenTree, node_budget
from .base import Drafter, StepFeedback

# the paper's (N, W, G) at its three block complexities
PAPER_SHAPES = MappingProxyType({10: (3, 4, 1), 30: (4, 5, 5), 60: (5, 8, 7)})


def lookahead_shape(budget: int) -> tuple[int, int, int]:
    """``(N, W, G)`` with ``(N - 1)(W + G) <= budget`` for a block-complexity budget.

    The paper's settings at BC = 10 / 30 / 60; otherwise N = 2 below 6 inputs, 3 below 30, 4
    below 60 and 5 from 60 on; ``W + G = budget // (N - 1)``, G = half of that (rounded down)
    from 10 columns on, else one candidate per quarter of it (at least one).
    """
    budget = int(budget)
    node_budget(budget, 0)  # at least a root and one draft node
    if budget in PAPER_SHAPES:
        return PAPER_SHAPES[budget]
    if budget < 6:
        n = 2
    elif budget < 30:
        n = 3
    elif budget < 60:
        n = 4
    else:
        n = 5
    total = budget // (n - 1)
    g = total // 2 if total >= 10 else max(1, (total - 1) // 4)
    w = total - g
    return n, w, g


class LookaheadDrafter(Drafter):
    """Lookahead decoding (Jacobi window + n-gram pool) in one verification tree; see the module
    docstring."""

    name = "lookahead"

    def __init__(
        self,
        budget: int,
        ngram: int | None = None,
        window: int | None = None,
        guesses: int | None = None,
        pool_from_context: bool = True,
        seed: int = 0,
    ):
        super().__init__(budget)
        n, w, g = lookahead_shape(self.budget)
        n = n if ngram is None else int(ngram)
        w = w if window is None else int(window)
        g = g if guesses is None else int(guesses)
        if n < 2 or w < 1 or g < 0:
            raise ValueError(f"lookahead needs N >= 2, W >= 1, G >= 0; got N={n}, W={w}, G={g}")
        if (n - 1) * (w + g) > self.budget:
            raise ValueError(
                f"lookahead (N={n}, W={w}, G={g}) needs (N-1)(W+G) = {(n - 1) * (w + g)} inputs per pass, "
                f"more than budget={self.budget}"
            )
        self.ngram, self.window, self.guesses = n, w, g
        self.pool_from_context = bool(pool_from_context)
        self.seed = int(seed)
        self._reset()

    @property
    def block_complexity(self) -> int:
        """Inputs of a full pass: ``(N - 1)(W + G)``."""
        return (self.ngram - 1) * (self.window + self.guesses)

    # ------------------------------------------------------------------ state
    def _reset(self) -> None:
        self._levels = np.zeros((self.ngram - 1, self.window), dtype=np.int64)
        self._pool: dict[int, list[tuple[int, ...]]] = {}
        self._look: list[list[int]] = []  # the window columns' paths of the last proposal
        self._tails = np.zeros(self.window, dtype=np.int64)
        self._updates = 0
        self._root = -1

    def start(self, prompt_ids: np.ndarray) -> None:
        self._reset()
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        rng = np.random.default_rng(self.seed)
        self._levels = rng.choice(prompt, size=(self.ngram - 1, self.window)).astype(np.int64)
        if self.pool_from_context:
            toks = prompt.tolist()
            n = self.ngram
            for s in range(len(toks) - n + 1):
                self._remember(toks[s], tuple(toks[s + 1 : s + n]))

    def _remember(self, key: int, cont: tuple[int, ...]) -> None:
        """Store an n-gram continuation under its first token (LRU, at most G per key)."""
        if self.guesses == 0:
            return
        lst = self._pool.setdefault(key, [])
        if cont in lst:
            lst.remove(cont)
        elif len(lst) >= self.guesses:
            del lst[0]
        lst.append(cont)

    # ------------------------------------------------------------------ drafting
    def lookahead_paths(self) -> list[list[int]]:
        """Path of each window column below the root (column 0's is empty when N = 2)."""
        lv = self._levels
        spine = lv[0, 1:].tolist()
        lower = lv[1:].T.tolist()  # [W][N-2]: column i's levels 1..N-2
        return [spine[:i] + lower[i] for i in range(self.window)]

    def candidates(self, root_token: int) -> list[tuple[int, ...]]:
        """The verification branch: the pool's continuations of the root, most recent first."""
        return list(reversed(self._pool.get(int(root_token), ())))

    def propose(self, root_token: int, context: np.ndarray) -> TokenTree:
        root = int(root_token)
        look = self.lookahead_paths()
        paths = [p for p in look if p] + [list(c) for c in self.candidates(root)]
        tree = TokenTree.from_paths(root, paths) if paths else TokenTree.root_only(root)
        self._look = look
        self._tails = _locate(tree, look)  # tree index of each column's tail in the proposal
        self._root = root
        return tree

    # ------------------------------------------------------------------ learning
    def observe(self, feedback: StepFeedback) -> None:
        if not feedback.is_prefill:
            logits = feedback.node_logits
            # each column's tail in the tree as verified (the budget may have cut a column short:
            # its deepest verified node stands in, a guess like any other)
            tails = torch.from_numpy(_locate(feedback.tree, self._look)).to(logits.device)
            new = logits.index_select(0, tails).argmax(dim=-1).cpu().numpy().astype(np.int64)
            self._updates += 1
            lv = self._levels
            if self._updates >= self.ngram - 1:  # levels 1..N-2 hold model guesses
                keys = lv[0].copy()
                keys[0] = self._root
                body = np.concatenate([lv[1:], new[None]], axis=0).T.tolist()  # [W][N-1]
                for key, cont in zip(keys.tolist(), body):
                    self._remember(key, tuple(cont))
            lv[:-1] = lv[1:].copy()
            lv[-1] = new
        if self.pool_from_context:
            ctx = feedback.context
            n = self.ngram
            m = len(feedback.new_tokens)
            tail = ctx[max(0, ctx.size - m - n + 1) :].tolist()
            for s in range(len(tail) - n + 1):
                self._remember(tail[s], tuple(tail[s + 1 : s + n]))


def _locate(tree: TokenTree, paths: list[list[int]]) -> np.ndarray:
    """Tree index of the last node of each path (the root for an empty path; the deepest node
    present where the tree holds only the start of the path)."""
    child: dict[tuple[int, int], int] = {}
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    for i in range(1, tree.size):
        child[(parents[i], tokens[i])] = i
    out = np.zeros(len(paths), dtype=np.int64)
    for j, path in enumerate(paths):
        node = 0
        for tok in path:
            if (node, tok) not in child:
                break
            node = child[(node, tok)]
        out[j] = node
    return out
