"""The decoding loop: prefill, then one tree-verification pass per step until a stop."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import ProbeConfig
from .drafters import StepFeedback, make_drafter
from .kv import AttentionFormat, attention_inputs, keep_accepted, new_cache, start_recording
from .masks import EmbeddingStats, MaskVectors, embedding_stats, initial_mask_vectors
from .step import PassInputs, accept_greedy, assemble_inputs, forward_pass, node_targets
from .tree import TokenTree, TreeLayout, esp_layout, prefill_layout

LAYOUT_CACHE_SIZE = 256


@dataclass
class DecodeStats:
    """Counts of one generation.

    - ``forward_passes``: every pass of the model, the prefill included;
    - ``new_tokens``: generated tokens (returned, after truncation at EOS / the length limit);
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
    """Returned by ``generate(..., return_dict_in_generate=True)``."""

    sequences: torch.Tensor
    stats: DecodeStats


class ProbeDecoder:
    """Decoder state that lives across calls for one model: attention format, cached tree layouts,
    vocabulary embedding statistics.  Per-generation state (cache, masks, drafter) lives in
    :meth:`generate` only, so calls never leak into each other."""

    def __init__(self, model, tokenizer=None, config: ProbeConfig | None = None, **knobs):
        self.model = model
        self.tokenizer = tokenizer
        self.config = ProbeConfig.from_kwargs(config, **knobs)
        self.fmt = AttentionFormat.for_model(model)
        self.embed = model.get_input_embeddings()
        self._layouts: OrderedDict[tuple, TreeLayout] = OrderedDict()
        self._embedding_stats: EmbeddingStats | None = None
        new_cache(model)  # fail early, with a clear message, on models whose cache can't roll back

    # ------------------------------------------------------------------ helpers
    def layout(self, tree: TokenTree, num_masks: int) -> TreeLayout:
        """The tree's layout, built once per shape and reused (LRU)."""
        key = (tree.shape_key, num_masks)
        found = self._layouts.get(key)
        if found is not None:
            self._layouts.move_to_end(key)
            return found
        built = esp_layout(tree, num_masks)
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
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 20,
        eos_token_id: int | list[int] | None = None,
        return_dict_in_generate: bool = False,
        **knobs,
    ):
        """Greedy decoding, token-identical to ``model.generate(do_sample=False)`` in fp32.

        Returns the sequences ``[1, prompt + new]`` or, with ``return_dict_in_generate=True``, a
        :class:`GenerateOutput` with ``.sequences`` and ``.stats`` (see :class:`DecodeStats`).
        """
        config = ProbeConfig.from_kwargs(self.config, **knobs)
        eos = _eos_set(eos_token_id if eos_token_id is not None else self.model.generation_config.eos_token_id)
        _check_input_ids(input_ids)
        _check_max_new_tokens(max_new_tokens)
        _check_context(self.model, input_ids.shape[1], max_new_tokens)

        prompt = input_ids[0].to(self.model.device)
        drafter = make_drafter(config)
        stats = DecodeStats(method=drafter.name, budget=config.budget, num_masks=drafter.num_masks)
        if max_new_tokens == 0:
            return _finish(input_ids, [], stats, return_dict_in_generate)

        t0 = time.perf_counter()
        k = drafter.num_masks
        masks = self._mask_vectors(config, prompt, k) if k else None
        cache = new_cache(self.model)
        start_recording(cache)
        context = prompt.cpu().numpy().astype(np.int64)
        drafter.start(context)

        # prefill: prompt + k masks, owned by the last prompt token
        first, mask_logits, prefill_logits = self._prefill(prompt, masks, k, cache)
        stats.forward_passes += 1
        generated: list[int] = []
        done = _commit(generated, [first], eos, max_new_tokens)
        context = np.append(context, first)
        drafter.observe(
            StepFeedback(
                tree=TokenTree.root_only(int(prompt[-1])),
                accepted=np.zeros(1, dtype=np.int64),
                new_tokens=np.array([first]),
                node_logits=prefill_logits,
                mask_logits=mask_logits,
                context=context,
                is_prefill=True,
            )
        )
        if masks is not None:
            masks.update(self.embed(torch.tensor([first], device=prompt.device)))
        stats.prefill_seconds = time.perf_counter() - t0

        while not done:
            root = generated[-1]
            root_position = prompt.shape[0] + len(generated) - 1
            tree = drafter.propose(root, context)
            layout = self.layout(tree, k)
            inputs = assemble_inputs(self.embed, tree, layout, masks, root_position, cache, self.fmt)
            logits = forward_pass(self.model, cache, inputs)
            stats.forward_passes += 1
            targets = node_targets(logits[: tree.size])
            path = accept_greedy(tree, targets)
            new_tokens = np.append(tree.tokens[path[1:]], targets[path[-1]])
            keep_accepted(cache, layout.num_inputs, torch.from_numpy(path).to(prompt.device))
            before = len(generated)
            done = _commit(generated, new_tokens.tolist(), eos, max_new_tokens)
            stats.accepted_lengths.append(len(generated) - before)
            context = np.append(context, new_tokens)
            drafter.observe(
                StepFeedback(
                    tree=tree,
                    accepted=path,
                    new_tokens=new_tokens,
                    node_logits=logits[: tree.size],
                    mask_logits=logits[layout.mask_slots(int(path[-1]))] if k else None,
                    context=context,
                )
            )
            if masks is not None and not done:
                masks.update(self.embed(torch.from_numpy(new_tokens).to(prompt.device)))
        stats.seconds = time.perf_counter() - t0
        return _finish(input_ids, generated, stats, return_dict_in_generate)

    def _prefill(self, prompt: torch.Tensor, masks: MaskVectors | None, k: int, cache):
        """One pass over the prompt and k masks; returns the first token, the masks' logits
        ``[k, V]`` (None when k = 0) and the last prompt position's logits ``[1, V]``."""
        p = prompt.shape[0]
        layout = prefill_layout(p, k)
        embeds = self.embed(prompt)
        if k:
            embeds = torch.cat([embeds, masks.vectors.to(embeds.dtype)], dim=0)
        positions = torch.from_numpy(layout.position_offsets).to(prompt.device)
        attn = attention_inputs(cache, layout.visible, positions, self.fmt)
        logits = forward_pass(self.model, cache, PassInputs(embeds[None], attn, positions[None]), logits_to_keep=k + 1)
        keep_accepted(cache, p + k, torch.arange(p, device=prompt.device))
        first = int(logits[0].argmax())
        return first, (logits[1:] if k else None), logits[:1]


def _eos_set(eos) -> frozenset[int]:
    if eos is None:
        return frozenset()
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    if isinstance(eos, int):
        return frozenset([eos])
    return frozenset(int(e) for e in eos)


def _commit(generated: list[int], tokens: list[int], eos: frozenset[int], max_new_tokens: int) -> bool:
    """Append tokens one by one, stopping exactly at an EOS token or the length limit.
    Returns True when generation is finished."""
    for tok in tokens:
        generated.append(int(tok))
        if int(tok) in eos or len(generated) >= max_new_tokens:
            return True
    return False


def _finish(input_ids: torch.Tensor, generated: list[int], stats: DecodeStats, as_dict: bool):
    new = torch.tensor([generated], dtype=input_ids.dtype, device=input_ids.device)
    sequences = torch.cat([input_ids, new.view(1, -1)], dim=1)
    stats.new_tokens = len(generated)
    return GenerateOutput(sequences, stats) if as_dict else sequences


def _check_input_ids(input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids with shape [1, length], got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2D [batch, length], got shape {tuple(input_ids.shape)}; use ids[None] for one prompt")
    if input_ids.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"batch size {input_ids.shape[0]} is not supported yet: probe-mtp decodes one sequence at a time; "
            "call generate once per prompt"
        )
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt token (for example the BOS token)")


def _check_max_new_tokens(max_new_tokens) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool):
        raise TypeError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")


def _check_context(model, prompt_len: int, max_new_tokens: int) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's maximum "
            f"of {limit} positions (config.max_position_embeddings); shorten the prompt or lower max_new_tokens"
        )
