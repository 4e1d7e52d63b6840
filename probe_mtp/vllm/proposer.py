"""probe-mtp's drafting as a vLLM speculative proposer (``method="custom_class"``).

vLLM's ``custom_class`` method builds the class named in ``speculative_config["model"]`` from the
engine's ``VllmConfig`` and, after every step, calls

    propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)

with, per row of the running batch, the tokens that step committed (the accepted draft tokens and
the model's own next token; empty for a row still in prefill), the row's token count and the rows'
token buffer; it returns a list of draft tokens per row (a chain: vLLM verifies chains).  It is not
told which request a row holds, nor what was accepted, nor when a request ends, so this class:

- **follows requests by their tokens**: a row whose first tokens and length before this step's
  tokens match a request seen at the last step is that request (rows move within vLLM's batch);
- **learns what was accepted** from the committed tokens: the draft it proposed for that request
  was accepted up to the first token that differs (the last committed token is the model's own);
- **sees a request end** when it is no longer in the batch: its prompt and output then enter the
  cross-request corpus (:class:`probe_mtp.memory.DraftingMemory`'s, bounded in bytes, oldest first).

Drafts come from two sources, as in probe-mtp's hybrid drafter (whose cells and priors this
reuses): context lookup in the request's own tokens (:class:`~probe_mtp.drafters.context_match.
ContextIndex`: the tokens that followed earlier occurrences of the last 1..``max_ngram`` tokens) and
the corpus of earlier requests (:mod:`probe_mtp.corpus`: the longest match of any length).  The chain
is grown a token at a time from the better-rated of the two sources' next tokens.  Every proposal
falls into a cell (source, match length, vote share); acceptance counts per cell are kept twice: for
all requests (the memory's calibration, the prior) and for the request itself (smoothed towards the
former).  A chain ends where the estimated probability that every one of its tokens is accepted
falls below ``min_probability``; then the batch's chains are cut where a further token would not pay
for the time it adds to the engine step (:mod:`probe_mtp.vllm.step_cost`: the proposer times vLLM's
steps against the tokens they verify).  So a request whose drafts fail soon drafts nothing, and
costs what plain decoding costs.

Options (``LLM(..., additional_config={"probe_mtp": {...}})``): see :class:`ProposerSettings`.
This module does not import vLLM (the class only reads the config's attributes).
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, fields

import numpy as np

from ..drafters.calibration import AcceptanceCalibrator
from ..drafters.context_match import ContextIndex
from ..drafters.hybrid import CORPUS_LENGTH_EDGES, CORPUS_MIN_MATCH, CORPUS_WIDTH, default_priors
from ..memory import DEFAULT_MEMORY_MB, DraftingMemory
from .step_cost import StepCosts, cut_chains

CONFIG_KEY = "probe_mtp"  # the proposer's entry in VllmConfig.additional_config
SOURCES = ("ngram", "corpus", "mask")
PROB_EDGES = (0.1, 0.3, 0.6, 0.9)  # the mask cells' probability buckets (as the hybrid drafter's)
HEAD = 16  # a request is recognised by its first tokens and its length
CORPUS_WINDOW = 64  # after the corpus changed, a request's match is read again from its last tokens
DRIFT_PRIOR = 2.0  # the request's drift (right / estimated draft tokens) starts as this many tokens at 1


@dataclass(frozen=True)
class ProposerSettings:
    """The proposer's options (``additional_config={"probe_mtp": {name: value}}``).

    ``memory_mb``: the cross-request memory's cap (corpus and acceptance counts), 0 keeps no corpus;
    ``max_ngram``: the longest context n-gram looked up; ``min_probability``: a chain ends before the
    token at which the estimated probability that the whole chain up to it is accepted falls below
    this; ``step_cost``: cut the chains further where a token would not pay for the step time it
    adds (measured, :mod:`probe_mtp.vllm.step_cost`; False: ``min_probability`` alone);
    ``prior_strength``: the weight, in proposals, of the prior a request's own counts start from;
    ``max_requests``: requests followed at once (the oldest unseen ones are let go)."""

    memory_mb: float = DEFAULT_MEMORY_MB
    max_ngram: int = 4
    min_probability: float = 0.02
    step_cost: bool = True
    prior_strength: float = 4.0
    max_requests: int = 1024
    num_masks: int = 0
    mask_update: float = 0.1
    masks: str = "auto"
    placeholder_ids: tuple | list | None = None

    @classmethod
    def from_options(cls, options) -> "ProposerSettings":
        if options is None:
            return cls()
        if not isinstance(options, dict):
            raise ValueError(f"additional_config[{CONFIG_KEY!r}] must be a dict of proposer options, got {options!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown probe-mtp proposer options {unknown}; known: {sorted(known)}")
        settings = cls(**options)
        settings.check()
        return settings

    def check(self) -> None:
        def number(name, value, integer=False):
            kind = int if integer else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"{name} must be a {'whole ' if integer else ''}number, got {value!r}")

        number("memory_mb", self.memory_mb)
        if self.memory_mb < 0:
            raise ValueError(f"memory_mb must be >= 0, got {self.memory_mb!r}")
        number("max_ngram", self.max_ngram, integer=True)
        if self.max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {self.max_ngram!r}")
        number("min_probability", self.min_probability)
        if not 0 < self.min_probability <= 1:
            raise ValueError(f"min_probability must be in (0, 1], got {self.min_probability!r}")
        if not isinstance(self.step_cost, bool):
            raise ValueError(f"step_cost must be true or false, got {self.step_cost!r}")
        number("prior_strength", self.prior_strength)
        if not self.prior_strength > 0:
            raise ValueError(f"prior_strength must be > 0, got {self.prior_strength!r}")
        number("max_requests", self.max_requests, integer=True)
        if self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests!r}")
        number("num_masks", self.num_masks, integer=True)
        if self.num_masks < 0:
            raise ValueError(f"num_masks must be >= 0, got {self.num_masks!r}")
        number("mask_update", self.mask_update)
        if not 0 <= self.mask_update <= 1:
            raise ValueError(f"mask_update must be in [0, 1], got {self.mask_update!r}")
        if self.masks not in ("auto", "untuned"):
            raise ValueError(f"masks must be 'auto' or 'untuned', got {self.masks!r}")


def _share_bucket(share: float) -> int:
    return 0 if share >= 1.0 else (1 if share >= 0.5 else 2)


class _Request:
    """What the proposer knows of one running request."""

    __slots__ = ("context", "calibrator", "draft", "cells", "estimates", "corpus_match", "corpus_version", "drafted",
                 "accepted", "predicted", "masks", "mask_positions", "mask_candidates")

    def __init__(self, max_ngram: int, priors, strength: float):
        self.context = ContextIndex(max_ngram)  # also holds the request's tokens
        self.calibrator = AcceptanceCalibrator(priors, strength)
        self.draft: list[int] = []  # proposed at the last step
        self.cells: list[tuple[int, int]] = []  # (source, cell) of each draft token
        self.estimates: list[float] = []  # each draft token's estimated acceptance (given the ones before)
        self.corpus_match = (0, 0)
        self.corpus_version = None
        self.drafted = 0
        self.accepted = 0
        self.predicted = 0.0  # the estimates' sum over its tested draft tokens (``accepted`` of them were right)
        self.masks = None  # the request's probe mask vectors (probe_mtp.masks.MaskVectors), with masks on
        self.mask_positions: list[tuple[int, int]] = []  # (position, slot) of the masks sent last step
        self.mask_candidates: list[tuple[int, float]] = []  # per depth: a mask's top token, its probability

    @property
    def tokens(self) -> list[int]:
        return self.context._tokens


class Proposer:
    """probe-mtp's proposer for vLLM's ``custom_class`` speculative method (see the module docstring):
    ``speculative_config={"method": "custom_class", "model": "probe_mtp.vllm.Proposer",
    "num_speculative_tokens": K}``; K caps every chain."""

    def __init__(self, vllm_config):
        spec = getattr(vllm_config, "speculative_config", None)
        k = getattr(spec, "num_speculative_tokens", None)
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"probe_mtp.vllm.Proposer needs num_speculative_tokens >= 1, got {k!r}")
        extra = getattr(vllm_config, "additional_config", None) or {}
        self.settings = ProposerSettings.from_options(extra.get(CONFIG_KEY) if isinstance(extra, dict) else None)
        self.k = k
        model_config = getattr(vllm_config, "model_config", None)
        self.max_model_len = int(getattr(model_config, "max_model_len", 0) or 0) or None
        self.memory = DraftingMemory(int(self.settings.memory_mb * (1 << 20)))
        priors = default_priors(1, self.settings.max_ngram, max(self.settings.num_masks, 1))
        self._priors = {s: priors[s] for s in SOURCES}
        # the acceptance counts of all requests (a quarter of their weight carried into each new one)
        self.calibrator = self.memory.calibrator(f"vllm-chain/n{self.settings.max_ngram}", self._priors,
                                                 self.settings.prior_strength)
        self._requests: OrderedDict[tuple, _Request] = OrderedDict()
        self.stats = {"requests": 0, "finished": 0, "steps": 0, "drafted": 0, "accepted": 0, "mask_drafts": 0,
                      "placeholder_hits": 0, "timed_steps": 0}
        self.step_costs = StepCosts()
        self.clock = time.perf_counter  # the step timer (a replay or a test may set another)
        self._last_step: tuple[float, int, int] | None = None  # (start, rows, tokens verified) of the last call
        self.slots = None  # the model plugin's MaskSlots, with num_masks >= 1
        self._embed = None
        self._tuned = None

    def load_model(self, model=None, *args, **kwargs) -> None:
        """vLLM hands every proposer the target model after loading it.  With ``num_masks`` >= 1 it
        must be the model plugin's (:mod:`probe_mtp.vllm.plugin`): the masks go through it."""
        if not self.settings.num_masks:
            return
        slots = getattr(model, "probe_masks", None)
        if slots is None:
            raise ValueError("the probe-mtp proposer's num_masks needs the probe-mtp model plugin: serve the model "
                             "as its plugin architecture, e.g. LLM(..., hf_overrides={'architectures': "
                             "['ProbeMtpLlamaForCausalLM']}) (probe_mtp.vllm.plugin.architecture_for)")
        if slots.num_masks < self.settings.num_masks:
            raise ValueError(f"num_masks={self.settings.num_masks} but the model plugin has {slots.num_masks} "
                             "placeholder slot(s) (its own num_masks option)")
        from .masking import model_embedder, tuned_masks_for

        self.slots = slots
        self._embed = model_embedder(model)
        self._tuned = tuned_masks_for(self._embed, self.settings) if self.settings.masks == "auto" else None

    # ------------------------------------------------------------------ vLLM's call
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list[list[int]]:
        """Draft tokens for every row of the batch (see the module docstring)."""
        now = self.clock()
        rows = len(sampled_token_ids)
        lengths = np.asarray(num_tokens_no_spec[:rows], dtype=np.int64)
        predicted = self._mask_outputs()
        found: list[tuple[tuple, _Request] | None] = [None] * rows
        following: OrderedDict[tuple, _Request] = OrderedDict()
        decoding_only = True  # every row continued a request from the last step with its decoded tokens
        for i, sampled in enumerate(sampled_token_ids):
            length = int(lengths[i])
            row = token_ids_cpu[i]
            key = (tuple(row[: min(HEAD, length)].tolist()), length)
            if not sampled:  # a row in prefill (or discarded this step): nothing to draft
                decoding_only = False
                if key in self._requests:
                    following[key] = self._requests.pop(key)
                continue
            before = length - len(sampled)
            request = self._requests.pop((key[0][:before], before), None)
            committed = [int(t) for t in sampled]
            if request is not None:
                self._learn(request, committed)
                self._read_masks(request, committed, predicted)
            else:
                decoding_only = False
                request = _Request(self.settings.max_ngram, self._priors, self.settings.prior_strength)
                self.memory.begin_request()
                self.stats["requests"] += 1
            self._update_masks(request, row[:length], committed)
            request.context.extend(row[:length])
            following[key] = request
            found[i] = (key, request)
        decoding_only = decoding_only and not self._requests  # (a request that left ended this step)
        for request in self._requests.values():  # not in the batch any more: finished (or preempted)
            self._finish(request)
        self._requests = following
        while len(self._requests) > self.settings.max_requests:
            self._finish(self._requests.popitem(last=False)[1])
        self.stats["steps"] += 1
        if decoding_only and self._last_step is not None and self._last_step[1] == rows:
            self.step_costs.record(self._last_step[2], now - self._last_step[0])
            self.stats["timed_steps"] += 1
        drafts = self._drafts(found, lengths)
        self._last_step = (now, rows, sum(1 + len(d) for d, f in zip(drafts, found) if f is not None))
        return drafts

    def _drafts(self, found, lengths) -> list[list[int]]:
        """Every row's chain (then its mask placeholders), the chains cut by the step's cost."""
        live = [(i, row[1]) for i, row in enumerate(found) if row is not None]
        masks, probabilities = [], []
        for i, request in live:
            room = self.k if self.max_model_len is None else min(self.k, self.max_model_len - int(lengths[i]) - 1)
            masks.append(self.settings.num_masks if self.slots is not None and room > self.settings.num_masks else 0)
            probabilities.append(self._draft(request, room - masks[-1]))
        line = self.step_costs.line() if self.settings.step_cost else None
        if line is not None:
            keep = cut_chains(probabilities, *line, base=len(live) + sum(masks))
        else:
            keep = [len(p) for p in probabilities]
        drafts: list[list[int]] = [[] for _ in found]
        for (i, request), kept, mask_count in zip(live, keep, masks):
            del request.draft[kept:], request.cells[kept:], request.estimates[kept:]
            self.stats["mask_drafts"] += sum(source == 2 for source, _ in request.cells)
            chain = list(request.draft)
            drafts[i] = chain + self._arm_masks(request, int(lengths[i]), len(chain), mask_count)
        return drafts

    # ------------------------------------------------------------------ the probe (model plugin)
    def _mask_outputs(self) -> dict[tuple[int, int], list]:
        """What the last pass predicted at the mask positions, by (position, slot), in row order."""
        if self.slots is None:
            return {}
        out: dict[tuple[int, int], list] = {}
        for found in self.slots.outputs:
            out.setdefault((found.position, found.slot), []).append(found)
        self.slots.outputs = []
        return out

    def _update_masks(self, request: _Request, tokens, committed: list[int]) -> None:
        """The request's mask vectors: made from its tokens the first time, then moved by the
        committed tokens (the EMA update of probe_mtp.masks)."""
        if self.slots is None:
            return
        import torch

        from .masking import request_masks

        with torch.no_grad():
            if request.masks is None:
                request.masks = request_masks(self._embed, self._tuned, np.asarray(tokens), self.settings)
            elif committed:
                ids = torch.as_tensor(committed, dtype=torch.long, device=self._embed.weight.device)
                request.masks.update(self._embed(ids))

    def _arm_masks(self, request: _Request, length: int, chain: int, masks: int) -> list[int]:
        """Placeholders after the chain, their vectors armed in the model for the next pass."""
        request.mask_positions = []
        if not masks:
            return []
        for slot in range(masks):
            position = length + chain + slot  # the request's next pass: [last token, chain, masks]
            self.slots.arm(position, slot, request.masks.vectors[slot])
            request.mask_positions.append((position, slot))
        return list(self.slots.placeholder_ids[:masks])

    def _read_masks(self, request: _Request, committed: list[int], predicted: dict) -> None:
        """Mask i's top token drafts depth i at this step, when the whole chain before the masks was
        accepted (the masks then saw exactly the committed context)."""
        request.mask_candidates = []
        if not request.mask_positions:
            return
        found = [predicted.get(key, []) for key in request.mask_positions]
        outputs = [queue.pop(0) if queue else None for queue in found]
        chain = len(request.draft)
        if len(committed) != chain + 1:
            return
        if committed[-1] in self.slots.placeholder_ids:  # the model's own token was a placeholder id
            self.stats["placeholder_hits"] += 1
        if all(o is not None for o in outputs):
            request.mask_candidates = [(o.tokens[0], o.probs[0]) for o in outputs]

    # ------------------------------------------------------------------ drafting
    def _corpus_state(self, request: _Request) -> tuple[int, int] | None:
        """The request's longest match in the corpus, read on from the last step while the corpus is
        unchanged, read again from the request's last tokens when it changed."""
        corpus = self.memory.corpus
        if not len(corpus):
            return None
        automaton = corpus.automaton
        version = (id(automaton), len(automaton.tokens))
        tokens = request.tokens
        if request.corpus_version is not None and request.corpus_version[:2] == version:
            state, matched = request.corpus_match
            for token in tokens[request.corpus_version[2]:]:
                state, matched = automaton.advance(state, matched, token)
        else:
            state, matched = automaton.match(tokens[-CORPUS_WINDOW:])
        request.corpus_match = (state, matched)
        request.corpus_version = version + (len(tokens),)
        return state, matched

    def _estimates(self, request: _Request, source: str) -> list[float]:
        """Per cell of ``source``: the request's acceptance estimate, smoothed towards all requests'."""
        prior = self.calibrator.all_cells(source)
        cells = np.arange(prior.size)
        return request.calibrator.estimate(source, cells, prior=prior).tolist()

    def _draft(self, request: _Request, room: int) -> list[float]:
        """The request's chain (in ``request.draft``, each token's cell in ``request.cells``) and,
        per token, the estimated probability that the chain up to it is accepted."""
        request.draft, request.cells, request.estimates = [], [], []
        path = []
        # the request's own drift: where its tested drafts were right less often than estimated (text
        # that repeats and is not followed), every estimate is scaled down by as much
        drift = min(1.0, (request.accepted + DRIFT_PRIOR) / (request.predicted + DRIFT_PRIOR))
        if room < 1:
            return path
        ngram_p = self._estimates(request, "ngram")
        corpus_p = self._estimates(request, "corpus")
        mask_p = self._estimates(request, "mask")
        match = self._corpus_state(request)
        automaton = self.memory.corpus.automaton
        tail = request.tokens[-self.settings.max_ngram:]
        path_p = 1.0
        while len(request.draft) < room:
            best = None  # (estimate, token, source index, cell)
            tokens, length, share = request.context.votes(tail)
            if tokens:
                cell = (length[0] - 1) * 3 + _share_bucket(share[0])
                best = (ngram_p[cell], tokens[0], 0, cell)
            if match is not None and match[1] >= CORPUS_MIN_MATCH:
                state, matched = match
                following = automaton.successors(state)
                if 0 < len(following) <= CORPUS_WIDTH:
                    first = automaton.tokens[automaton.end[state] + 1]  # after the first occurrence
                    token = first if first in following else following[0]
                    cell = 2 * bisect_right(CORPUS_LENGTH_EDGES, matched) + (len(following) > 1)
                    if best is None or corpus_p[cell] > best[0]:
                        best = (corpus_p[cell], int(token), 1, cell)
            depth = len(request.draft)
            if depth < len(request.mask_candidates):
                token, prob = request.mask_candidates[depth]
                cell = depth * (len(PROB_EDGES) + 1) + bisect_right(PROB_EDGES, prob)
                if cell < len(mask_p) and (best is None or mask_p[cell] > best[0]):
                    best = (mask_p[cell], int(token), 2, cell)
            if best is None or path_p * best[0] * drift < self.settings.min_probability:
                break
            p, token, source, cell = best
            path_p *= p * drift
            path.append(path_p)
            request.estimates.append(p)
            request.draft.append(token)
            request.cells.append((source, cell))
            tail = (tail + [token])[-self.settings.max_ngram:]
            if match is not None:
                match = automaton.advance(match[0], match[1], token)
        return path

    # ------------------------------------------------------------------ learning
    def _learn(self, request: _Request, committed: list[int]) -> None:
        """Score last step's draft against what the step committed: draft token j was tested when
        every token before it was accepted, and was right when the committed token there is it (the
        last committed token is the model's own choice there: it scores a draft token that vLLM did
        not schedule, or rejected, as the model would have)."""
        draft = request.draft
        if not draft:
            return
        tested = min(len(draft), len(committed))
        hits = []
        for j in range(tested):
            hits.append(committed[j] == draft[j])
            if not hits[-1]:
                break
        accepted = sum(hits)
        request.predicted += sum(request.estimates[: len(hits)])
        request.drafted += len(draft)
        request.accepted += accepted
        self.stats["drafted"] += len(draft)
        self.stats["accepted"] += accepted
        outcome = np.asarray(hits, dtype=np.float64)
        for s, name in enumerate(SOURCES):
            picked = [j for j in range(len(hits)) if request.cells[j][0] == s]
            if picked:
                cells = np.asarray([request.cells[j][1] for j in picked], dtype=np.int64)
                request.calibrator.record(name, cells, outcome[picked])
                self.calibrator.record(name, cells, outcome[picked])

    def _finish(self, request: _Request) -> None:
        """A request left the batch: its prompt and output enter the corpus."""
        self.stats["finished"] += 1
        self.memory.remember(np.asarray(request.tokens, dtype=np.int32))
