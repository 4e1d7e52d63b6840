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

from .config import ProbeConfig
from .drafters import Drafter, StepFeedback, make_drafter
from .kv import AttentionFormat, attention_inputs, keep_accepted, new_cache, start_recording
from .masks import EmbeddingStats, MaskVectors, embedding_stats, initial_mask_vectors
from .step import PassInputs, assemble_inputs, forward_pass
from .tree import TokenTree, TreeLayout, esp_layout, prefill_layout
from .verify import accept_greedy, accept_recursive_rejection, accept_sample_and_match, process_node_logits

LAYOUT_CACHE_SIZE = 256


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
    method: str = "esp"
    budget: int = 0
    num_masks: int = 0

    @property
    def mean_accepted_length(self) -> float:
        if not self.accepted_lengths:
            return 1.0
        return float(sum(self.accepted_lengths)) / len(self.accepted_lengths)

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
        new_cache(model)  # fail early, with a clear message, on models whose cache can't roll back

    def generate(self, input_ids: torch.Tensor | None = None, **kwargs):
        """Same arguments and result as ``model.generate``, plus probe knobs (:class:`ProbeConfig`
        fields, ``drafter`` as a name or a :class:`Drafter`).  See :func:`probe_mtp.generate`."""
        from .generate import generate

        kwargs.setdefault("tokenizer", self.tokenizer)
        return generate(self.model, input_ids, decoder=self, **kwargs)

    # ------------------------------------------------------------------ helpers
    def layout(self, tree: TokenTree, num_masks: int, owners: np.ndarray | None = None) -> TreeLayout:
        """The tree's layout (masks on every node, or on ``owners``), built once per shape and
        reused (LRU)."""
        key = (tree.shape_key, num_masks, None if owners is None else tuple(owners.tolist()))
        found = self._layouts.get(key)
        if found is not None:
            self._layouts.move_to_end(key)
            return found
        built = esp_layout(tree, num_masks, owners)
        self._layouts[key] = built
        if len(self._layouts) > LAYOUT_CACHE_SIZE:
            self._layouts.popitem(last=False)
        return built

    def embedding_stats(self) -> EmbeddingStats:
        if self._embedding_stats is None:
            self._embedding_stats = embedding_stats(self.embed, self.embed.num_embeddings)
        return self._embedding_stats

    def _mask_vectors(self, config: ProbeConfig, prompt: torch.Tensor, num_masks: int) -> MaskVectors:
        stats = self.embedding_stats() if config.mask_init == "sample" else None
        return initial_mask_vectors(
            config.mask_init,
            self.embed,
            prompt,
            num_masks,
            config.mask_update,
            stats=stats,
            token=config.mask_token,
            seed=config.mask_seed,
        )

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
        self.cache = new_cache(decoder.model)
        start_recording(self.cache)

    # ---------------------------------------------------------------- pieces
    @property
    def sequence(self) -> torch.Tensor:
        return self.buffer[:, : self.length]

    def commit(self, tokens: list[int], token_scores: torch.Tensor | None) -> int:
        """Append tokens one at a time, checking the stopping criteria after each.
        Returns how many were committed; sets ``self.done``."""
        committed = 0
        for i, tok in enumerate(tokens):
            if self.length >= self.buffer.shape[1]:
                self.done = True
                break
            self.buffer[0, self.length] = int(tok)
            self.length += 1
            committed += 1
            row = token_scores[i : i + 1] if token_scores is not None else None
            if self.req.output_scores and row is not None:
                self.scores.append(row.clone())
            stop = self.req.criteria(self.sequence, row) if self.req.criteria else False
            if bool(torch.as_tensor(stop).any()) or self.length >= self.req.max_length:
                self.done = True
                break
        if committed and self.req.streamer is not None:
            self.req.streamer.put(self.buffer[0, self.length - committed : self.length].cpu())
        return committed

    def choose(self, tree: TokenTree, node_logits: torch.Tensor, context: torch.Tensor):
        """Verify: returns (accepted path, new tokens, processed scores of the new tokens or None)."""
        req = self.req
        scores = process_node_logits(req.processors, context, tree, node_logits)
        if not req.do_sample:
            targets = scores.argmax(dim=-1).cpu().numpy()
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
        return path, new_tokens, scores[torch.from_numpy(path).to(scores.device)]

    def feedback(self, tree, path, new_tokens, node_logits, mask_logits, is_prefill=False):
        self.drafter.observe(
            StepFeedback(
                tree=tree,
                accepted=path,
                new_tokens=new_tokens,
                node_logits=node_logits,
                mask_logits=mask_logits,
                context=self.sequence[0].cpu().numpy(),
                is_prefill=is_prefill,
            )
        )

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
        if self.req.streamer is not None:
            self.req.streamer.put(prompt.cpu())
        self.commit(new_tokens.tolist(), token_scores)
        self.feedback(root, path, new_tokens, logits[:1], logits[1:] if k else None, is_prefill=True)
        if self.masks is not None:
            self.masks.update(dec.embed(torch.tensor(new_tokens, device=self.device)))

    def step(self) -> None:
        dec, k = self.dec, self.k
        context = self.sequence[0]
        root = int(context[-1])
        tree = self.drafter.propose(root, context.cpu().numpy())
        layout = dec.layout(tree, k, self.drafter.mask_owners(tree) if k else None)
        inputs = assemble_inputs(dec.embed, tree, layout, self.masks, self.length - 1, self.cache, dec.fmt)
        logits = forward_pass(dec.model, self.cache, inputs)
        self.stats.forward_passes += 1
        node_logits = logits[: tree.size]
        path, new_tokens, token_scores = self.choose(tree, node_logits, context)
        keep_accepted(self.cache, layout.num_inputs, torch.from_numpy(path).to(self.device))
        self.stats.accepted_lengths.append(self.commit(new_tokens.tolist(), token_scores))
        slots = layout.mask_slots(int(path[-1]))
        mask_logits = logits[torch.from_numpy(slots).to(logits.device)] if slots.size else None
        self.feedback(tree, path, new_tokens, node_logits, mask_logits)
        if self.masks is not None and not self.done:
            self.masks.update(dec.embed(torch.from_numpy(new_tokens).to(self.device)))

    def execute(self) -> GenerateOutput:
        t0 = time.perf_counter()
        self.done = self.length >= self.req.max_length
        self.drafter.start(self.sequence[0].cpu().numpy())
        if not self.done:
            self.prefill()
            self.stats.prefill_seconds = time.perf_counter() - t0
        while not self.done:
            self.step()
        if self.req.streamer is not None:
            self.req.streamer.end()
        self.stats.seconds = time.perf_counter() - t0
        self.stats.new_tokens = self.length - self.prompt_len
        scores = tuple(self.scores) if self.req.output_scores else None
        return GenerateOutput(self.sequence.clone(), self.stats, scores)
