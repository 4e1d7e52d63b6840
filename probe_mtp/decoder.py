"""The decoding loop: prefill, then one tree-verification pass per step until a stopping criterion.

Arguments arrive prepared by transformers (``GenerationConfig``, the ``LogitsProcessorList`` and the
``StoppingCriteriaList`` that ``model.generate`` builds; see :mod:`probe_mtp.generate`), so every
generation option behaves exactly as in ``model.generate``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from .adaptive import AdaptiveBudget, FixedBudget
from .config import ProbeConfig
from .confadapt import ConfAdaptRule, graft_chain
from .cost import CostCurve, cost_curve_for
from .heap import heap_trimmer
from .drafters import Drafter, StepFeedback, make_drafter
from .head import SplitHead
from .kv import AttentionFormat, attention_inputs, keep_accepted, new_cache, start_recording
from .masks import EmbeddingStats, MaskVectors, config_mask_vectors, embedding_stats
from .step import PassInputs, assemble_inputs, backbone_pass, forward_pass, node_targets
from .tree import TokenTree, TreeLayout, esp_layout, min_block_complexity, pad_layout, prefill_layout
from .tuned_masks import TunedMaskStore
from .verify import (
    accept_greedy,
    accept_greedy_lazily,
    accept_recursive_rejection,
    accept_sample_and_match,
    process_node_logits,
    NodeRows,
    process_node_row,
)
from .vocab import RowTops, vocab_argmax

LAYOUT_CACHE_SIZE = 256
# the KV cache is reserved for the prompt plus at most this many new tokens (then it grows)
RESERVE_AHEAD = 4096
# mask inputs whose logits are computed in the same output-layer call as the nodes' (the output
# layer costs a read of its whole weight per call, a few rows more cost little)
EAGER_MASK_ROWS = 8


@dataclass
class DecodeStats:
    """Counts of one generation.

    - ``forward_passes``: every pass of the model, the prefill included;
    - ``new_tokens``: generated tokens (returned, after truncation at a stop);
    - ``accepted_lengths``: tokens committed by each decoding step after the prefill (accepted
      draft tokens + the bonus token, after truncation);
    - ``mean_accepted_length`` (tau): ``sum(accepted_lengths) / len(accepted_lengths)``.  The
      prefill pass and the first token it yields are *not* counted in tau, for every method alike
      (they are the same for all methods); ``forward_passes`` counts the prefill.
    """

    forward_passes: int = 0
    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    forward_seconds: float = 0.0
    inputs_per_pass: list[int] = field(default_factory=list)
    method: str = "esp"
    budget: int | str = 0
    num_masks: int = 0
    choices: dict = field(default_factory=dict)
    unverified_tokens: int = 0  # committed by acceptance="confadapt" without verification

    @property
    def mean_accepted_length(self) -> float:
        if not self.accepted_lengths:
            return 1.0
        return float(sum(self.accepted_lengths)) / len(self.accepted_lengths)

    @property
    def overhead_fraction(self) -> float:
        """Share of the decoding steps' time spent outside the model's forward pass (drafting,
        masks, verification, cache rollback, stopping checks); the prefill is left out."""
        steps = self.seconds - self.prefill_seconds
        if steps <= 0 or not self.accepted_lengths:
            return float("nan")
        return max(0.0, 1.0 - self.forward_seconds / steps)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "budget": self.budget,
            "num_masks": self.num_masks,
            "forward_passes": self.forward_passes,
            "new_tokens": self.new_tokens,
            "accepted_lengths": list(self.accepted_lengths),
            "mean_accepted_length": self.mean_accepted_length,
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "forward_seconds": self.forward_seconds,
            "inputs_per_pass": list(self.inputs_per_pass),
            "choices": dict(self.choices),
            "unverified_tokens": self.unverified_tokens,
        }


@dataclass
class GenerateOutput:
    """Returned with ``return_dict_in_generate=True``: ``sequences`` as ``model.generate`` returns
    them, ``stats`` (:class:`DecodeStats`), and ``scores`` (a tuple of ``[1, V]`` processed scores,
    one per generated token) when ``output_scores=True``."""

    sequences: torch.Tensor
    stats: DecodeStats
    scores: tuple[torch.Tensor, ...] | None = None


@dataclass
class DecodeRequest:
    """Everything one generation needs, prepared and checked."""

    prompt: torch.Tensor  # [1, P], padding removed
    max_length: int  # total length limit (prompt + new), from the generation config
    processors: object | None  # LogitsProcessorList or None
    criteria: object  # StoppingCriteriaList
    do_sample: bool
    config: ProbeConfig
    drafter: Drafter | None = None
    generator: torch.Generator | None = None
    streamer: object | None = None
    output_scores: bool = False


class ProbeDecoder:
    """Decoder state that lives across calls for one model: attention format, cached tree layouts,
    vocabulary embedding statistics.  Per-generation state (cache, masks, drafter) lives in one
    call only, so calls never leak into each other."""

    def __init__(self, model, tokenizer=None, config: ProbeConfig | None = None, **knobs):
        self.model = model
        self.tokenizer = tokenizer
        self.config = ProbeConfig.from_kwargs(config, **knobs)
        self.fmt = AttentionFormat.for_model(model)
        self.embed = model.get_input_embeddings()
        self._layouts: OrderedDict[tuple, TreeLayout] = OrderedDict()
        self._embedding_stats: EmbeddingStats | None = None
        self._split_head: SplitHead | None = None
        self._cost_curves: dict[bool, CostCurve] = {}
        self._weight_bytes: int | None = None
        self._tuned = TunedMaskStore(model)
        new_cache(model)  # fail early, with a clear message, on models whose cache can't roll back

    def generate(self, input_ids: torch.Tensor | None = None, **kwargs):
        """Same arguments and result as ``model.generate``, plus probe knobs (:class:`ProbeConfig`
        fields, ``drafter`` as a name or a :class:`Drafter`).  See :func:`probe_mtp.generate`."""
        from .generate import generate

        kwargs.setdefault("tokenizer", self.tokenizer)
        return generate(self.model, input_ids, decoder=self, **kwargs)

    # ------------------------------------------------------------------ helpers
    def layout(self, tree: TokenTree, num_masks: int, pad_to: int = 0, owners: np.ndarray | None = None) -> TreeLayout:
        """The tree's layout (masks on every node, or on ``owners``; padded to ``pad_to`` inputs),
        built once per shape and reused (LRU)."""
        key = (tree.shape_key, num_masks, pad_to, None if owners is None else tuple(owners.tolist()))
        found = self._layouts.get(key)
        if found is not None:
            self._layouts.move_to_end(key)
            return found
        built = esp_layout(tree, num_masks, owners)
        if pad_to:
            built = pad_layout(built, pad_to)
        self._layouts[key] = built
        if len(self._layouts) > LAYOUT_CACHE_SIZE:
            self._layouts.popitem(last=False)
        return built

    @property
    def split_head(self) -> SplitHead:
        """The backbone / output-layer split (checked once against the model's own logits)."""
        if self._split_head is None:
            self._split_head = SplitHead(self.model)
        return self._split_head

    def cost_curve(self, config: ProbeConfig) -> CostCurve:
        """The curve ``budget="auto"`` sizes trees with: supplied, cached on disk, or measured."""
        if config.cost_curve is not None:
            supplied = config.cost_curve
            return supplied if isinstance(supplied, CostCurve) else CostCurve.from_mapping(dict(supplied))
        key = bool(config.cost_cache)
        if key not in self._cost_curves:
            head = self.split_head if self.split_head.usable else None
            self._cost_curves[key] = cost_curve_for(self.model, use_disk=key, head=head)
        return self._cost_curves[key]

    def budget_policy(self, config: ProbeConfig, drafter: Drafter):
        if not config.adaptive or config.acceptance == "confadapt":
            # ConfAdapt reads every step's masks: it keeps the drafter's full tree and masks
            return FixedBudget(drafter.num_masks, drafter.mask_owners)
        return AdaptiveBudget(
            self.cost_curve(config),
            drafter.num_masks,
            self.widest_pass(config),
            mask_free=getattr(drafter, "mask_free_nodes", None),
            mask_owners=drafter.mask_owners,
            mask_nodes=getattr(drafter, "mask_nodes", None),
        )

    def widest_pass(self, config: ProbeConfig) -> int:
        """The most inputs ``budget="auto"`` may verify at once: ``max_budget``, lowered so that
        one pass's logits stay under ``pass_memory`` times the weights' bytes (never below the
        smallest tree with masks on its root)."""
        if not config.pass_memory:
            return config.max_budget
        if self._weight_bytes is None:
            self._weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        row_bytes = 4 * self.embed.num_embeddings  # a float32 logits row
        rows = int(config.pass_memory * self._weight_bytes // row_bytes)
        return max(min(config.max_budget, rows), min_block_complexity(config.num_masks))

    def embedding_stats(self) -> EmbeddingStats:
        if self._embedding_stats is None:
            self._embedding_stats = embedding_stats(self.embed, self.embed.num_embeddings)
        return self._embedding_stats

    def _mask_vectors(self, config: ProbeConfig, prompt: torch.Tensor, num_masks: int) -> MaskVectors:
        if config.masks is not None:
            return self._tuned.get(config.masks, num_masks).mask_vectors(self.embed, prompt, num_masks, config.mask_update)
        stats = self.embedding_stats() if config.mask_init == "sample" else None
        return config_mask_vectors(config, self.embed, prompt, num_masks, stats)

    # ------------------------------------------------------------------ the loop
    @torch.no_grad()
    def decode(self, req: DecodeRequest) -> GenerateOutput:
        """Run one generation; ``req.prompt`` is ``[1, P]`` without padding."""
        config = req.config
        drafter = req.drafter if req.drafter is not None else make_drafter(config)
        stats = DecodeStats(method=drafter.name, budget=config.budget, num_masks=drafter.num_masks)
        run = _Run(self, req, drafter, stats)
        return run.execute()


class _Run:
    """The state of one generation (never outlives it)."""

    def __init__(self, decoder: ProbeDecoder, req: DecodeRequest, drafter: Drafter, stats: DecodeStats):
        self.dec = decoder
        self.req = req
        self.drafter = drafter
        self.stats = stats
        self.device = decoder.model.device
        prompt = req.prompt.to(self.device)
        self.prompt_len = prompt.shape[1]
        # every committed token, in a buffer that stopping criteria and processors read as a view
        self.buffer = torch.empty((1, max(req.max_length, self.prompt_len + 1)), dtype=torch.long, device=self.device)
        self.buffer[:, : self.prompt_len] = prompt
        self.length = self.prompt_len
        self.scores: list[torch.Tensor] = []
        self.k = drafter.num_masks
        if req.do_sample and req.config.sampling_rule == "rejection" and hasattr(drafter, "use_draws"):
            drafter.use_draws(req.generator)
        self.masks = decoder._mask_vectors(req.config, prompt[0], self.k) if self.k else None
        self.confadapt = ConfAdaptRule(req.config.threshold) if req.config.acceptance == "confadapt" else None
        if self.confadapt is not None and req.do_sample:
            raise ValueError("acceptance='confadapt' is a greedy rule; use do_sample=False (or acceptance='verify')")
        # room for the whole generation and one more pass (a longer one grows the buffer once)
        reserve = min(req.max_length, self.prompt_len + RESERVE_AHEAD) + req.config.max_budget
        self.cache = new_cache(decoder.model, capacity=reserve)
        start_recording(self.cache)
        self.policy = decoder.budget_policy(req.config, drafter)
        self.head = decoder.split_head if decoder.split_head.usable else None
        # rows to run the output layer on, per rows wanted: the cheapest measured count (auto budget)
        curve = getattr(self.policy, "curve", None)
        self.head_padding = curve.head_padding(decoder.widest_pass(req.config)) if self.head is not None and curve is not None else None

    # ---------------------------------------------------------------- pieces
    @property
    def sequence(self) -> torch.Tensor:
        return self.buffer[:, : self.length]

    def commit(self, tokens: list[int], token_scores: list[torch.Tensor] | None) -> int:
        """Append tokens one at a time, checking the stopping criteria after each; ``token_scores``
        holds each token's ``[1, V]`` score row.  Returns how many were committed; sets ``self.done``."""
        committed = 0
        for i, tok in enumerate(tokens):
            if self.length >= self.buffer.shape[1]:
                self.done = True
                break
            self.buffer[0, self.length] = int(tok)
            self.length += 1
            committed += 1
            row = token_scores[i] if token_scores is not None else None
            if self.req.output_scores and row is not None:
                self.scores.append(row.clone())
            stop = self.req.criteria(self.sequence, row) if self.req.criteria else False
            if bool(torch.as_tensor(stop).any()) or self.length >= self.req.max_length:
                self.done = True
                break
        if committed and self.req.streamer is not None:
            self.req.streamer.put(self.buffer[0, self.length - committed : self.length].cpu())
        return committed

    def choose(self, tree: TokenTree, node_logits: torch.Tensor, context: torch.Tensor, tops: RowTops | None = None):
        """Verify: returns (accepted path, new tokens, the ``[1, V]`` processed score row of each new
        token).  ``tops``: the nodes' top tokens when already computed (their unique maxima are the
        greedy targets when no processor changes the logits)."""
        req = self.req
        if not req.do_sample and node_logits.device.type == "cpu":
            # processors and argmax only at the nodes the walk reaches (about tau rows, not the
            # tree); processed rows are made again when commit reads them rather than all kept
            def row(node: int) -> torch.Tensor:
                return process_node_row(req.processors, context, tree, node_logits, node)

            known = tops if tops is not None and not req.processors else None

            def target_of(node: int) -> int:
                target = known.argmax(node) if known is not None else None
                return int(vocab_argmax(row(node))[0]) if target is None else target

            path, bonus = accept_greedy_lazily(tree, target_of)
            new_tokens = np.append(tree.tokens[path[1:]], bonus)
            nodes = path.tolist()
            return path, new_tokens, NodeRows(row, nodes) if req.processors else [row(j) for j in nodes]
        scores = process_node_logits(req.processors, context, tree, node_logits)
        if not req.do_sample:
            targets = node_targets(scores)  # one transfer beats a sync per node
            path = accept_greedy(tree, targets)
            bonus = int(targets[path[-1]])
        else:
            probs = torch.softmax(scores, dim=-1)
            draft = self.drafter.draft_distributions() if req.config.sampling_rule == "rejection" else None
            if draft is not None:
                path, bonus = accept_recursive_rejection(tree, probs, draft[0], draft[1], req.generator)
            else:
                path, bonus = accept_sample_and_match(tree, probs, req.generator)
        new_tokens = np.append(tree.tokens[path[1:]], bonus)
        return path, new_tokens, [scores[j : j + 1] for j in path.tolist()]  # views: no [path, vocab] copy

    def feedback(self, tree, path, new_tokens, node_logits, mask_logits, is_prefill=False, node_tops=None):
        self.drafter.observe(
            StepFeedback(
                tree=tree,
                accepted=path,
                new_tokens=new_tokens,
                node_logits=node_logits,
                mask_logits=mask_logits,
                context=self.sequence[0].cpu().numpy(),
                is_prefill=is_prefill,
                node_tops=node_tops,
            )
        )

    def extend(self, new_tokens, token_scores, mask_logits):
        """ConfAdapt (lossy, opt-in): append the confident run of unverified mask predictions."""
        if self.confadapt is None:
            return new_tokens, token_scores, mask_logits
        new_tokens, token_scores, mask_logits, unverified = self.confadapt.extend(new_tokens, token_scores, mask_logits)
        self.stats.unverified_tokens += unverified
        return new_tokens, token_scores, mask_logits

    # ---------------------------------------------------------------- passes
    def prefill(self) -> None:
        """One pass over the prompt and k masks owned by its last token."""
        dec, k = self.dec, self.k
        prompt = self.sequence[0]
        layout = prefill_layout(self.prompt_len, k)
        embeds = dec.embed(prompt)
        if k:
            embeds = torch.cat([embeds, self.masks.vectors.to(embeds.dtype)], dim=0)
        positions = torch.tensor(layout.position_offsets, device=self.device)
        attn = attention_inputs(self.cache, layout.visible, positions, dec.fmt)
        logits = forward_pass(dec.model, self.cache, PassInputs(embeds[None], attn, positions[None]), logits_to_keep=k + 1)
        self.stats.forward_passes += 1
        keep_accepted(self.cache, self.prompt_len + k, torch.arange(self.prompt_len, device=self.device))
        root = TokenTree.root_only(int(prompt[-1]))
        path, new_tokens, token_scores = self.choose(root, logits[:1], prompt)
        new_tokens, token_scores, mask_logits = self.extend(new_tokens, token_scores, logits[1:] if k else None)
        if self.req.streamer is not None:
            self.req.streamer.put(prompt.cpu())
        self.commit(new_tokens.tolist(), token_scores)
        self.feedback(root, path, new_tokens, logits[:1], mask_logits, is_prefill=True)
        if self.masks is not None:
            self.masks.update(dec.embed(torch.tensor(new_tokens, device=self.device)))

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer on ``hidden``'s rows, run on the padded row count the curve found
        cheapest (when it timed the layer)."""
        count = hidden.shape[0]
        padding = self.head_padding
        rows = int(padding[count]) if padding is not None and count < padding.shape[0] else None
        return self.head.logits(hidden, rows=rows)

    def verify_pass(self, tree: TokenTree, layout: TreeLayout, inputs: PassInputs):
        """One forward pass: node logits ``[tree.size, V]`` and a function giving the logits of a
        node's masks.  With the split head the output layer runs only on the nodes (and on the
        masks when there are at most ``EAGER_MASK_ROWS``), and later on the one owner's masks whose
        logits are used."""
        t0 = time.perf_counter()
        if self.head is not None:
            hidden = backbone_pass(self.head, self.cache, inputs)
            end = layout.num_inputs - layout.num_pad
            if end - tree.size <= EAGER_MASK_ROWS:
                # few mask inputs (masks on the root only, say): their rows ride along with the
                # nodes', since a second call would read the whole output layer again
                logits = self.head_logits(hidden[:end])
                node_logits = logits[: tree.size]
                rows_of = lambda slots: logits[torch.from_numpy(slots)]  # noqa: E731
            else:
                node_logits = self.head_logits(hidden[: tree.size])
                rows_of = lambda slots: self.head_logits(hidden[torch.from_numpy(slots)])  # noqa: E731
        else:
            logits = forward_pass(self.dec.model, self.cache, inputs)
            node_logits = logits[: tree.size]
            rows_of = lambda slots: logits[torch.from_numpy(slots).to(logits.device)]  # noqa: E731
        self.stats.forward_seconds += time.perf_counter() - t0
        self.stats.forward_passes += 1
        self.stats.inputs_per_pass.append(layout.num_inputs)

        def masks_of(owner: int):
            """Logits of ``owner``'s masks, None when it carried none."""
            slots = layout.mask_slots(owner)
            return rows_of(slots) if slots.size else None

        return node_logits, masks_of

    def step(self) -> None:
        dec = self.dec
        context = self.sequence[0]
        root = int(context[-1])
        self.drafter.min_score = self.policy.score_floor()
        plan = self.policy.plan(self.drafter.propose(root, context.cpu().numpy()), self.length - 1)
        tree, k = plan.tree, plan.num_masks
        pending = self.confadapt.pending if self.confadapt is not None else []  # committed, not cached
        m = len(pending)
        full = graft_chain(pending, tree) if m else tree
        owners = None if plan.owners is None else plan.owners + m
        layout = dec.layout(full, k, 0 if m else plan.pad_to, owners)
        inputs = assemble_inputs(dec.embed, full, layout, self.masks if k else None, self.length - 1 - m, self.cache, dec.fmt)
        full_logits, masks_of = self.verify_pass(full, layout, inputs)
        node_logits = full_logits[m:]
        # the nodes' top tokens, once, for the drafter's learning and the greedy walk
        tops = RowTops.of(node_logits, max(self.drafter.node_top_k, 2)) if self.drafter.node_top_k else None
        path, new_tokens, token_scores = self.choose(tree, node_logits, context, tops)
        self.policy.observe(tree, path)
        keep = np.concatenate([np.arange(m), path + m]) if m else path
        keep_accepted(self.cache, layout.num_inputs, torch.from_numpy(keep).to(self.device))
        mask_logits = masks_of(int(path[-1]) + m) if k else None
        new_tokens, token_scores, mask_logits = self.extend(new_tokens, token_scores, mask_logits)
        self.stats.accepted_lengths.append(self.commit(new_tokens.tolist(), token_scores))
        self.feedback(tree, path, new_tokens, node_logits, mask_logits, node_tops=tops)
        if self.masks is not None and not self.done:
            self.masks.update(dec.embed(torch.from_numpy(new_tokens).to(self.device)))

    def execute(self) -> GenerateOutput:
        t0 = time.perf_counter()
        self.done = self.length >= self.req.max_length
        self.drafter.start(self.sequence[0].cpu().numpy())
        if not self.done:
            self.prefill()
            self.stats.prefill_seconds = time.perf_counter() - t0
        trim_heap = heap_trimmer(self.device)
        while not self.done:
            started, forward_before, context = time.perf_counter(), self.stats.forward_seconds, self.length - 1
            self.step()
            if trim_heap is not None:
                trim_heap()
            self.policy.observe_timing(self.stats.inputs_per_pass[-1], context,
                                       self.stats.forward_seconds - forward_before, time.perf_counter() - started)
        if self.req.streamer is not None:
            self.req.streamer.end()
        self.stats.seconds = time.perf_counter() - t0
        self.stats.new_tokens = self.length - self.prompt_len
        self.stats.choices = dict(getattr(self.policy, "choices", {}))
        scores = tuple(self.scores) if self.req.output_scores else None
        return GenerateOutput(self.sequence.clone(), self.stats, scores)
