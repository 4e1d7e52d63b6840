"""The hybrid drafter: one token tree fed by every training-free source, under one budget.

Sources of candidate children for a tree node (its path = the committed context + the draft tokens
from the root down to it):

- ``succ``: the successor table (:mod:`~probe_mtp.drafters.successors`, Token Recycling): the
  model's own top-k next tokens after the node's last 1..``successor_order`` tokens, stored from
  the latest pass that verified a node ending that way.  Every verified node, accepted or not,
  refreshes the table; chains of lookups reach any depth.
- ``ngram``: context lookup (:class:`~probe_mtp.drafters.context_match.ContextIndex`): the tokens
  that followed every earlier occurrence of the path's last 1..``max_ngram`` tokens in prompt +
  generated text, each with its longest match and its share of the votes.  Along a copied
  passage the match grows with the depth, so this source proposes long chains.
- ``mask``: the probe (ESP), when ``num_masks`` >= 1: mask j of the previous pass's deepest
  accepted node proposes the nodes at depth j.  Only that node's masks are ever read, so they are
  put on ``mask_nodes`` nodes (by default one: the root), not on every node; each mask costs one
  input of the budget.
- ``corpus``: with the decoder's drafting memory (:mod:`probe_mtp.memory`), the tokens that followed
  the longest match of the path (any length) in earlier requests' prompts and outputs, when that
  match is at least ``CORPUS_MIN_MATCH`` tokens and few tokens ever followed it.

With a drafting memory attached (:meth:`HybridDrafter.attach_memory`), the successor table and the
calibration are the memory's and outlive the request; without one, each request starts afresh.

Each proposal falls into a *cell* of its source (successor: key length x stored probability;
context: match length x vote share; mask: depth x mask probability; corpus: match length x one or
several continuations).  An online
:class:`~probe_mtp.drafters.calibration.AcceptanceCalibrator` estimates, per cell, how often such
proposals were accepted once their parent was: after every pass, all proposals made at the nodes
of the accepted path are scored against the token the verifier chose there (also those that did
not make it into the tree).  A token proposed by several sources takes the highest of their
estimates (the sources are strongly correlated, so the estimates are not combined as if
independent).  The tree is grown best-first (:func:`~probe_mtp.tree.grow_best_first`): the
candidate with the highest estimated path probability is taken next, until
``budget - 1 - num_masks * mask_nodes`` draft nodes are taken.  Candidates are merged per token, so
shared prefixes are one node.  The sum of a tree's node scores estimates how many of its draft
tokens will be accepted (a budget controller can read it).

The tree is not drawn at random, so sampling uses sample-and-match (exact for any tree).
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np
import torch

from ..tree import TokenTree, grow_best_first
from .base import Drafter, StepFeedback
from .calibration import AcceptanceCalibrator
from .context_match import ContextIndex
from .successors import SuccessorTable

SOURCES = ("succ", "ngram", "mask", "corpus")
SUCC, NGRAM, MASK, CORPUS = range(len(SOURCES))
# which verified nodes refresh the successor table: every node (Token Recycling) or the accepted path
LEARN_FROM = ("all", "accepted")
# probability buckets of the successor and mask cells: [0, .1), [.1, .3), [.3, .6), [.6, .9), [.9, 1]
PROB_EDGES = (0.1, 0.3, 0.6, 0.9)
NUM_PROB_BUCKETS = len(PROB_EDGES) + 1
# vote-share buckets of the context cells: 0 unanimous, 1 at least half, 2 less than half
NUM_SHARE_BUCKETS = 3
# corpus cells: match length buckets [2, 4), [4, 8), [8, 16), [16, 32), [32, ...) x (one continuation, several)
CORPUS_LENGTH_EDGES = (4, 8, 16, 32)
CORPUS_MIN_MATCH = 2  # shorter matches in a corpus of many documents say little
CORPUS_WIDTH = 4  # a state followed by more distinct tokens than this proposes none of them


def _share_bucket(share: float) -> int:
    return 0 if share >= 1.0 else (1 if share >= 0.5 else 2)


def default_priors(successor_order: int, max_ngram: int, num_masks: int) -> dict[str, np.ndarray]:
    """Prior acceptance rates of every cell before any evidence (worth a few proposals; the
    observed rates take over within a few passes)."""
    prob_mid = np.array([0.05, 0.2, 0.45, 0.75, 0.95])
    succ = np.concatenate([min(0.6 + 0.2 * n, 0.9) * prob_mid for n in range(successor_order)])
    by_length = np.minimum(0.2 + 0.15 * np.arange(max_ngram), 0.8)
    ngram = (by_length[:, None] * np.array([1.0, 0.6, 0.3])[None, :]).reshape(-1)
    mask = np.tile(0.6 * prob_mid, max(num_masks, 1))
    by_match = np.array([0.3, 0.45, 0.6, 0.7, 0.8])
    corpus = (by_match[:, None] * np.array([1.0, 0.5])[None, :]).reshape(-1)
    return {"succ": succ, "ngram": ngram, "mask": mask, "corpus": corpus}


class HybridDrafter(Drafter):
    """Best-first trees over the merged proposals of the successor table, context lookup and (with
    ``num_masks`` >= 1) the probe masks; see the module docstring.

    Knobs: ``mask_nodes``: how many nodes carry the ``num_masks`` masks (None: every node, the
    ESP layout); ``top_k`` successors stored per key; keys of 1..``successor_order`` tokens;
    context matches of 1..``max_ngram`` tokens, at most ``context_width`` tokens proposed per
    node; ``prior_strength`` (in proposals) of the calibration priors; ``learn_from``: which
    verified nodes refresh the successor table (``"all"`` or ``"accepted"``)."""

    name = "hybrid"
    mask_use = "optional"

    @classmethod
    def from_config(cls, config) -> "HybridDrafter":
        return cls(config.tree_budget, config.num_masks, prune_repeats=config.prune_repeats)

    def __init__(
        self,
        budget: int,
        num_masks: int = 0,
        mask_nodes: int | None = 1,
        top_k: int = 8,
        successor_order: int = 2,
        max_ngram: int = 4,
        context_width: int = 8,
        prior_strength: float = 4.0,
        learn_from: str = "all",
        prune_repeats: bool = True,
    ):
        super().__init__(budget)
        if not isinstance(num_masks, int) or num_masks < 0:
            raise ValueError(f"num_masks must be an integer >= 0, got {num_masks!r}")
        self.num_masks = num_masks
        if mask_nodes is not None and (not isinstance(mask_nodes, int) or mask_nodes < 1):
            raise ValueError(f"mask_nodes must be None (every node) or an integer >= 1, got {mask_nodes!r}")
        self.mask_nodes = mask_nodes
        if self.max_nodes < 1:
            raise ValueError(
                f"budget={self.budget} is too small for the hybrid drafter with num_masks={num_masks} on "
                f"{'every node' if mask_nodes is None else f'{mask_nodes} node(s)'}: not even one draft node fits"
            )
        if int(context_width) < 1:
            raise ValueError(f"context_width must be >= 1, got {context_width!r}")
        if learn_from not in LEARN_FROM:
            raise ValueError(f"learn_from must be one of {LEARN_FROM}, got {learn_from!r}")
        self.successors = SuccessorTable(top_k, successor_order)
        self.context = ContextIndex(max_ngram)
        self.context_width = int(context_width)
        self.learn_from = learn_from
        self.prune_repeats = bool(prune_repeats)
        self._priors = default_priors(self.successors.order, self.context.max_ngram, self.num_masks)
        self._prior_strength = float(prior_strength)
        self.calibrator = AcceptanceCalibrator(self._priors, prior_strength)
        self._tail_length = max(self.context.max_ngram, self.successors.order)
        self.memory = None  # the decoder's drafting memory, once attached
        self._automaton = None  # the corpus's suffix automaton for this request (None: no corpus)
        self._reset()

    def attach_memory(self, memory) -> None:
        """Share the decoder's drafting memory: its successor table, its calibration of this
        configuration and its corpus of earlier requests (kept across requests)."""
        self.memory = memory
        self.successors = memory.successor_table(self.successors.top_k, self.successors.order)
        key = f"hybrid/k{self.num_masks}/m{self.mask_nodes}/top{self.successors.top_k}/o{self.successors.order}/n{self.context.max_ngram}"
        self.calibrator = memory.calibrator(key, self._priors, self._prior_strength)

    @property
    def node_top_k(self) -> int:
        """Every verified node's top ``top_k`` feed the successor table."""
        return self.successors.top_k

    @property
    def mask_top_k(self) -> int:
        """The seeding masks' top ``top_k + 1`` are the probe's candidates."""
        return self.successors.top_k + 1 if self.num_masks else 0

    @property
    def max_nodes(self) -> int:
        """Draft nodes that fit the budget: ``budget - 1 - num_masks * mask_nodes``, or
        ``budget // (num_masks + 1) - 1`` with masks on every node (``mask_nodes=None``)."""
        if self.mask_nodes is None or not self.num_masks:
            return self.budget // (self.num_masks + 1) - 1
        return self.budget - 1 - self.num_masks * self.mask_nodes

    def mask_owners(self, tree: TokenTree) -> np.ndarray | None:
        """The root, then the ``mask_nodes - 1`` other nodes most likely to be the deepest accepted
        one (whose masks seed the next tree): node i is with probability ``score(i) - sum of its
        children's scores`` under the calibrated estimates (ties: the earlier node).  The root
        always carries masks: when even the first level fails the next root is usually a token
        the other sources know least about, which is where the probe helps most."""
        if self.mask_nodes is None:
            return None
        if self.mask_nodes >= tree.size:
            return np.arange(tree.size)
        last = tree.scores.copy()
        np.subtract.at(last, tree.parents[1:], tree.scores[1:])
        last[0] = np.inf
        return np.sort(np.argsort(-last, kind="stable")[: self.mask_nodes])

    # ------------------------------------------------------------------ state
    def _reset(self) -> None:
        """Per-request state; without a drafting memory also the successor table and calibration."""
        if self.memory is None:
            self.successors.reset()
            self.calibrator.reset()
        self.context.reset()
        self._mask_candidates: list[tuple[list[int], list[int]]] = []  # per depth: tokens, cells
        self.skip_proposal()
        self._root_tail: tuple[int, ...] = ()  # the last tokens of the context, root last
        self._corpus_match = (0, 0)  # the corpus state and match length after the committed context
        self._corpus_read = 0  # committed tokens read into it

    def start(self, prompt_ids: np.ndarray) -> None:
        self._reset()
        prompt = np.asarray(prompt_ids).reshape(-1)
        self._root_tail = tuple(prompt[-self._tail_length :].tolist())  # the prefill's root
        corpus = None if self.memory is None else self.memory.corpus
        self._automaton = corpus.automaton if corpus is not None and len(corpus) else None
        if self._automaton is not None:
            self._corpus_match = self._automaton.match(prompt.tolist())
            self._corpus_read = prompt.size

    # ------------------------------------------------------------------ proposals
    def propose(self, root_token: int, context: np.ndarray) -> TokenTree:
        context = np.asarray(context, dtype=np.int64)
        self.context.extend(context)
        # per source, the estimate of each cell, with a trailing 0.0 that cell -1 (not proposed) reads
        succ, ngram, mask, corpus = (self.calibrator.all_cells(s).tolist() + [0.0] for s in SOURCES)
        n = self._tail_length
        # per taken node: its depth and the last n tokens of its path
        depth = [0]
        tail = [tuple(context[-n:].tolist())]
        self._root_tail = tail[0]
        proposals: dict[int, dict[int, list[int]]] = {}
        automaton = self._automaton
        matches = [self._follow_context(context)] if automaton is not None else None

        def expand(node: int, parent: int, token: int) -> tuple[list[int], list[float]]:
            if node:
                depth.append(depth[parent] + 1)
                tail.append((tail[parent] + (token,))[-n:])
                if matches is not None:
                    matches.append(automaton.advance(*matches[parent], token))
            found = proposals[node] = self._proposals_at(token, depth[node], tail[node],
                                                         None if matches is None else matches[node])
            return list(found), [max(succ[a], ngram[b], mask[c], corpus[d]) for a, b, c, d in found.values()]

        tree, index = grow_best_first(int(root_token), expand, self.node_limit, self.min_score)
        self._proposals = proposals
        self._grown_index = index
        self._tree = tree
        return tree

    def skip_proposal(self) -> None:
        """No proposal is pending: the next feedback scores none."""
        self._proposals: dict[int, dict[int, list[int]]] = {}
        self._grown_index = np.zeros(1, dtype=np.int64)
        self._tree: TokenTree | None = None  # the last proposed tree

    def _follow_context(self, context: np.ndarray) -> tuple[int, int]:
        """The corpus match after the committed context (read on from where it was left)."""
        state, matched = self._corpus_match
        for token in context[self._corpus_read :].tolist():
            state, matched = self._automaton.advance(state, matched, token)
        self._corpus_match, self._corpus_read = (state, matched), len(context)
        return state, matched

    def mask_free_nodes(self, tree: TokenTree) -> np.ndarray:
        """For the adaptive budget: which nodes of the proposed ``tree`` the successor table, the
        context lookup or the corpus proposed (they need no masks on the previous pass)."""
        grown_of = np.empty(self._grown_index.size, dtype=np.int64)
        grown_of[self._grown_index] = np.arange(self._grown_index.size)
        free = np.zeros(tree.size, dtype=bool)
        for i in range(1, tree.size):
            cells = self._proposals.get(int(grown_of[tree.parents[i]]), {}).get(int(tree.tokens[i]))
            free[i] = cells is not None and (cells[SUCC] >= 0 or cells[NGRAM] >= 0 or cells[CORPUS] >= 0)
        return free

    def _to_proposed(self, tree: TokenTree, path: np.ndarray) -> np.ndarray:
        """An accepted path of the verified ``tree`` as indices of the proposed tree (the adaptive
        budget may have cut and renumbered it)."""
        proposed = self._tree
        if proposed is None or tree is proposed:
            return path
        out, cur = [0], 0
        for node in path[1:].tolist():
            kids = np.flatnonzero((proposed.parents == cur) & (proposed.tokens == tree.tokens[node]))
            cur = int(kids[0])
            out.append(cur)
        return np.asarray(out, dtype=np.int64)

    def _proposals_at(self, token: int, depth: int, tail: tuple[int, ...],
                      corpus_match: tuple[int, int] | None = None) -> dict[int, list[int]]:
        """The children proposed for one node: ``{token: [cell of each source, -1 if none]}``."""
        found: dict[int, list[int]] = {}
        # successors: the longest key's entry first; shorter keys add the tokens it lacks
        previous = None
        for n, entry in reversed(list(enumerate(self.successors.lookup(tail)))):
            if entry is None or entry == previous:  # one row is stored under several keys
                continue
            previous = entry
            base = n * NUM_PROB_BUCKETS
            for tok, p in zip(*entry):
                if tok not in found:
                    found[tok] = [base + bisect_right(PROB_EDGES, p), -1, -1, -1]
        # context matches
        tokens, length, share = self.context.votes(tail)
        for tok, ln, sh in zip(tokens[: self.context_width], length, share):
            cell = (ln - 1) * NUM_SHARE_BUCKETS + _share_bucket(sh)
            cells = found.get(tok)
            if cells is None:
                found[tok] = [-1, cell, -1, -1]
            else:
                cells[NGRAM] = cell
        # the probe: mask j of the last pass's deepest accepted node proposes depth j
        if depth < len(self._mask_candidates):
            for tok, cell in zip(*self._mask_candidates[depth]):
                if self.prune_repeats and tok == token:
                    continue
                cells = found.get(tok)
                if cells is None:
                    found[tok] = [-1, -1, cell, -1]
                else:
                    cells[MASK] = cell
        # the corpus of earlier requests: what followed the longest match of the node's path
        if corpus_match is not None and corpus_match[1] >= CORPUS_MIN_MATCH:
            state, matched = corpus_match
            following = self._automaton.successors(state)
            if 0 < len(following) <= CORPUS_WIDTH:
                cell = 2 * bisect_right(CORPUS_LENGTH_EDGES, matched) + (len(following) > 1)
                for tok in following:
                    cells = found.get(tok)
                    if cells is None:
                        found[tok] = [-1, -1, -1, cell]
                    else:
                        cells[CORPUS] = cell
        return found

    # ------------------------------------------------------------------ learning
    def observe(self, feedback: StepFeedback) -> None:
        tree = feedback.tree
        accepted = np.asarray(feedback.accepted, dtype=np.int64)
        truth = np.asarray(feedback.new_tokens, dtype=np.int64)
        if not feedback.is_prefill:
            self._calibrate(self._to_proposed(tree, accepted), truth.tolist())
        # successor table: every verified node; rejected nodes first, so the accepted path's
        # (real-text) distributions win where both wrote the same key
        if self.learn_from == "all":
            rows = np.concatenate([np.setdiff1d(np.arange(tree.size), accepted), accepted])
        else:
            rows = accepted
        tails = self._node_tails(tree)
        logits = feedback.node_logits
        tops = feedback.node_tops
        if tops is not None and tops.width >= self.successors.top_k:
            top_tokens, top_probs = tops.tokens[rows], tops.probs[rows]
        elif rows.size == logits.shape[0]:
            # every node: top-k over the logits as they are, then reorder the small result (a
            # reordered copy of the logits would move rows x vocab floats: 31 MB on Gemma 3)
            top_tokens, top_probs = self.successors.candidates(logits)
            top_tokens, top_probs = top_tokens[rows], top_probs[rows]
        else:
            top_tokens, top_probs = self.successors.candidates(
                logits.index_select(0, torch.from_numpy(rows).to(logits.device)))
        self.successors.store([tails[r] for r in rows.tolist()], top_tokens, top_probs, vocab=logits.shape[-1])
        self._mask_candidates = []
        if feedback.mask_logits is not None and self.num_masks:
            toks, probs = feedback.mask_candidates(self.mask_top_k)
            for j, (t, p) in enumerate(zip(toks, probs)):
                cells = j * NUM_PROB_BUCKETS + np.searchsorted(PROB_EDGES, p, side="right")
                self._mask_candidates.append((t.tolist(), cells.tolist()))

    def _node_tails(self, tree: TokenTree) -> list[tuple[int, ...]]:
        """The last tokens of every node's path (context + draft tokens)."""
        n = self._tail_length
        tails = [self._root_tail]
        for parent, token in zip(tree.parents[1:].tolist(), tree.tokens[1:].tolist()):
            tails.append((tails[parent] + (token,))[-n:])
        return tails

    def _calibrate(self, accepted: np.ndarray, truth: list[int]) -> None:
        """Score the proposals made at every accepted node against the verifier's token there."""
        grown_of = np.empty(self._grown_index.size, dtype=np.int64)
        grown_of[self._grown_index] = np.arange(self._grown_index.size)
        for i, node in enumerate(accepted.tolist()):
            found = self._proposals.get(int(grown_of[node])) if node < grown_of.size else None
            if not found or i >= len(truth):
                continue
            cells = np.array(list(found.values()), dtype=np.int64)  # [candidates, cell of each source]
            hit = np.fromiter(found.keys(), dtype=np.int64, count=len(found)) == truth[i]
            for s, source in enumerate(SOURCES):
                has = cells[:, s] >= 0
                if has.any():
                    self.calibrator.record(source, cells[has, s], hit[has])
