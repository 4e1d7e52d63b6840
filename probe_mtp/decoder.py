"""The decoder: a model made ready for probe-mtp decoding, and what it keeps across requests.

:class:`ProbeDecoder` checks the model once (its attention implementation, its cache), keeps what
does not change between requests (tree layouts, the machine's cost curve, the split output layer,
embedding statistics, tuned mask vectors) and turns each request into a
:class:`~probe_mtp.generation.Generation` run by :func:`probe_mtp.step.run`.  Its ``generate``
goes through ``model.generate``'s own preparation, so every generation option means exactly what
it means in transformers.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import torch

from .architectures import attention_format
from .acceptance import acceptance_rule
from .attention import grouped_query_attention
from .adaptive import AdaptiveBudget, BatchWidthCosts, BudgetPolicy, FixedBudget
from .batch import Batch, run_batch
from .confadapt import ConfAdapt
from .config import UNTUNED_MASKS, ProbeConfig
from .cost import CostCurve, cost_curve_for
from .drafters import Drafter, make_drafter
from .generation import Generation, Parts
from .head import SplitHead
from .kv import new_cache, start_recording
from .masks import EmbeddingStats, MaskVectors, config_mask_vectors, embedding_stats
from .optimize import weight_bytes
from .passes import OutputLayer
from .precision import exactness_warning
from .ragged import RaggedCache
from .request import (
    DecodeRequest,
    build_requests,
    check_input_ids,
    check_max_new_tokens,
    move_stop_strings_to_criteria,
    split_probe_knobs,
    with_probe_knobs,
)
from .stats import DecodeStats, GenerateOutput
from .step import LOSSLESS, Strategy, run
from .tree import LayoutCache, min_block_complexity
from .memory import DEFAULT_MEMORY_MB, DraftingMemory, MemoryFileError
from .tuned_masks import AUTO_MASKS, TunedMasks, TunedMaskStore, masks_label

LAYOUT_CACHE_SIZE = 256
# the KV cache is reserved for the prompt plus at most this many new tokens (then it grows)
RESERVE_AHEAD = 4096


class MemoryFileWarning(UserWarning):
    """A memory file given to ``ProbeDecoder(memory=PATH)`` could not be used: the decoder starts cold."""


class InexactPrecisionWarning(UserWarning):
    """The model computes in a precision where probe-mtp's output can differ from ``model.generate``
    at near-ties (fp16 / bf16 with stock kernels, float32 with TF32 on CUDA); said once per decoder,
    with how to stay exact (:func:`probe_mtp.precision.exactness_warning`)."""


class ProbeDecoder:
    """probe-mtp decoding for one model.  ``config`` / ``knobs``: the default
    :class:`~probe_mtp.config.ProbeConfig` of its requests (each ``generate`` call may override
    any knob).  Per-generation state (cache, mask vectors) lives in one request only.

    ``memory``: the drafting memory shared by every request (:mod:`probe_mtp.memory`): ``True``
    (default: start empty and learn), ``False`` (every request starts cold) or the path of a file
    written by :meth:`save_memory` (a file that does not fit this model is refused with a warning
    and the decoder starts cold).  ``memory_mb`` caps it.

    Thread safety: requests on one decoder run one at a time (a lock), so two threads may share a
    decoder; for parallel decoding give each thread its own decoder (and model copy)."""

    def __init__(self, model, tokenizer=None, config: ProbeConfig | None = None, *, memory: bool | str | Path = True,
                 memory_mb: float = DEFAULT_MEMORY_MB, **knobs):
        self.model = model
        self.tokenizer = tokenizer
        self.config = ProbeConfig.from_kwargs(config, **knobs)
        self._lock = threading.RLock()
        self.memory_mb = memory_mb
        self.memory = self._initial_memory(memory)
        self.fmt = attention_format(model)
        self.embed = model.get_input_embeddings()
        self.layouts = LayoutCache(LAYOUT_CACHE_SIZE)
        self._embedding_stats: EmbeddingStats | None = None
        self._split_head: SplitHead | None = None
        self._cost_curves: dict[bool, CostCurve] = {}
        # what batched passes cost by width on this machine, measured by the batches decoded so far
        self._batch_widths = BatchWidthCosts()
        self._weight_bytes: int | None = None
        self._tuned = TunedMaskStore(model)
        self._auto_tuned: dict[int, TunedMasks | None] = {}
        self._precision_checked = False
        new_cache(model)  # fail early, with a clear message, on models whose cache can't roll back

    def __getstate__(self) -> dict:
        """Copies and pickles (of the decoder, or of a model that holds one) leave the lock out."""
        state = dict(self.__dict__)
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_precision_checked", False)
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ drafting memory
    def _initial_memory(self, memory) -> DraftingMemory | None:
        if isinstance(memory, bool):
            return DraftingMemory.for_model(self.model, self.tokenizer, self.memory_mb) if memory else None
        if not isinstance(memory, (str, Path)):
            raise TypeError(f"memory must be True, False or the path of a saved memory, got {type(memory).__name__}")
        fresh = DraftingMemory.for_model(self.model, self.tokenizer, self.memory_mb)
        try:
            return self._read_memory(memory, fresh)
        except MemoryFileError as exc:
            warnings.warn(f"{exc}; starting with an empty drafting memory", MemoryFileWarning, stacklevel=3)
            return fresh

    def _read_memory(self, path, fresh: DraftingMemory) -> DraftingMemory:
        return DraftingMemory.load(path, fresh.identity, fresh.tokenizer, max_bytes=fresh.max_bytes)

    def load_memory(self, path: str | Path) -> None:
        """Replace the drafting memory by one saved with :meth:`save_memory`.  A file that is not a
        memory of this model (another model or tokenizer, damaged, another format) raises
        :class:`~probe_mtp.memory.MemoryFileError` and leaves the decoder as it was."""
        fresh = DraftingMemory.for_model(self.model, self.tokenizer, self.memory_mb)
        loaded = self._read_memory(path, fresh)
        with self._lock:
            self.memory = loaded

    def save_memory(self, path: str | Path) -> Path:
        """Write the drafting memory to ``path`` (safetensors; see :mod:`probe_mtp.memory`)."""
        if self.memory is None:
            raise ValueError("this decoder keeps no drafting memory (memory=False)")
        with self._lock:
            return self.memory.save(path)

    def reset_memory(self) -> None:
        """Forget what earlier requests taught the drafters (the next request starts cold)."""
        with self._lock:
            if self.memory is not None:
                self.memory.reset()

    # ------------------------------------------------------------------ entry points
    def generate(self, input_ids: torch.Tensor | None = None, *, streamer=None, **kwargs):
        """Same arguments and result as ``model.generate``, plus probe knobs (:class:`ProbeConfig`
        fields, ``drafter`` as a name or a :class:`Drafter`, ``config=``) and ``generator``.
        See :func:`probe_mtp.generate`."""
        check_input_ids(input_ids, kwargs.get("attention_mask"))
        check_max_new_tokens(kwargs.get("max_new_tokens"))
        if kwargs.get("max_new_tokens") == 0:
            return self._nothing_to_generate(input_ids, kwargs)
        tokenizer = kwargs.pop("tokenizer", None) or self.tokenizer
        move_stop_strings_to_criteria(self.model, tokenizer, kwargs)
        return self.model.generate(input_ids, custom_generate=self.handle_prepared, probe_streamer=streamer,
                                   probe_tokenizer=tokenizer, **kwargs)

    @with_probe_knobs
    def handle_prepared(self, model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                        config: ProbeConfig | None = None, generator: torch.Generator | None = None,
                        probe_streamer=None, probe_tokenizer=None, **model_kwargs):
        """What ``model.generate`` calls with the prepared processors, criteria and generation
        config (a ``custom_generate`` function): decodes ``input_ids`` and returns what
        ``model.generate`` would."""
        if model is not self.model:
            raise ValueError("this ProbeDecoder belongs to another model; build one per model")
        knobs, custom_drafter = split_probe_knobs(model_kwargs)
        probe_config = ProbeConfig.from_kwargs(config or self.config, **knobs)
        requests = build_requests(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                  probe_config, custom_drafter, generator, probe_streamer, model_kwargs.get("attention_mask"))
        if len(requests) == 1:
            out = self.decode(requests[0])
        else:
            out = self.decode_batch(requests, generation_config)
        out.sequences = out.sequences.to(input_ids.device)
        return out if generation_config.return_dict_in_generate else out.sequences

    @torch.no_grad()
    def decode(self, request: DecodeRequest) -> GenerateOutput:
        """Run one generation (one row).  Afterwards the prompt and its output join the drafting
        memory's corpus."""
        with self._lock, grouped_query_attention(self.model):
            if self.memory is not None:
                self.memory.begin_request()
            generation, strategy = self.start(request)
            out = run(generation, strategy)
            if self.memory is not None:
                self.memory.remember(generation.host_context)
            return out

    @torch.no_grad()
    def decode_batch(self, requests: list[DecodeRequest], generation_config) -> GenerateOutput:
        """Decode several rows together, one forward pass per step (:mod:`probe_mtp.batch`); the
        result is padded as ``model.generate`` pads a batch."""
        if requests[0].config.acceptance == "confadapt":
            raise ValueError("acceptance='confadapt' decodes one sequence at a time; use a batch of one row")
        with self._lock, grouped_query_attention(self.model):
            if self.memory is not None:
                self.memory.begin_request()
            memory = self.memory if self.memory is not None else DraftingMemory(self._cold_bytes())
            rows = [self.start(request, memory=memory, with_cache=False)[0] for request in requests]
            longest = max(g.buffer.shape[1] for g in rows)
            capacity = min(longest, rows[0].prompt_len + RESERVE_AHEAD) + requests[0].config.max_budget
            cache = RaggedCache(new_cache(self.model, capacity=capacity, every_layer=True), len(rows), capacity,
                                self.model.device)
            window = getattr(self.model.config.get_text_config(decoder=True), "sliding_window", None)
            types = self.fmt.layer_types or ("full_attention",)
            # a supplied cost curve is taken as said; a measured one is corrected by the batches' own passes
            widths = self._batch_widths if requests[0].config.cost_curve is None else None
            batch = Batch(rows, cache, types, window if "sliding_attention" in types else None, widths)
            pad = generation_config._pad_token_tensor
            out = run_batch(batch, None if pad is None else int(pad.reshape(-1)[0]))
            if self.memory is not None:
                for g in rows:
                    self.memory.remember(g.host_context)
            return out

    def start(self, request: DecodeRequest, memory: DraftingMemory | None = None,
              with_cache: bool = True) -> tuple[Generation, Strategy]:
        """The state of a new generation for ``request`` and how to decode it (the lossless
        strategy, or ConfAdapt's when asked for).  ``memory``: the drafting memory to use (default:
        the decoder's, or an empty one when it keeps none); ``with_cache``: give the generation its
        own KV cache (a batch's rows share one)."""
        self._warn_if_inexact()
        config = request.config
        drafter = request.drafter if request.drafter is not None else make_drafter(config)
        if memory is None:
            memory = self.memory if self.memory is not None else DraftingMemory(self._cold_bytes())
        drafter.attach_memory(memory)
        lossy = config.acceptance == "confadapt"
        if lossy and request.do_sample:
            raise ValueError("acceptance='confadapt' is a greedy rule; use do_sample=False (or acceptance='verify')")
        k = drafter.num_masks
        prompt = request.prompt.to(self.model.device)
        tuned = self.tuned_masks(config, k) if k else None
        masks = self.mask_vectors(config, prompt[0], k, tuned) if k else None
        cache = None
        if with_cache:
            # room for the whole generation and one more pass (a longer one grows the buffer once)
            reserve = min(request.max_length, prompt.shape[1] + RESERVE_AHEAD) + config.max_budget
            cache = new_cache(self.model, capacity=reserve)
            start_recording(cache)
        accept = acceptance_rule(request.do_sample, config.sampling_rule, request.processors, request.generator,
                                 drafter, self.model.device)
        policy = self.budget_policy(config, drafter, fixed=lossy or accept.needs_whole_tree, memory=memory)
        head = self.split_head if self.split_head.usable else None
        # rows to run the output layer on, per rows wanted: the cheapest measured count (auto budget)
        padding = policy.head_padding(self.widest_pass(config)) if head is not None else None
        parts = Parts(self.model, self.embed, self.fmt, OutputLayer(self.model, head, padding), self.layouts)
        stats = DecodeStats(method=drafter.name, budget=config.budget, num_masks=k,
                            masks=masks_label(config, tuned) if k else "", memory="cold" if self.memory is None else "warm")
        generation = Generation(parts, request, drafter, policy, accept, masks, cache, stats)
        return generation, (ConfAdapt(config.threshold).strategy() if lossy else LOSSLESS)

    def _warn_if_inexact(self) -> None:
        """Once per decoder: warn when outputs can differ from ``model.generate`` at near-ties."""
        if self._precision_checked:
            return
        self._precision_checked = True
        message = exactness_warning(self.model)
        if message is not None:
            warnings.warn(f"probe-mtp: {message}", InexactPrecisionWarning, stacklevel=2)

    def _nothing_to_generate(self, input_ids, kwargs):
        """``max_new_tokens=0``: the input, as a tensor or as a result object (no forward pass)."""
        knobs, _ = split_probe_knobs(dict(kwargs))
        ProbeConfig.from_kwargs(kwargs.get("config") or self.config, **knobs)  # still validate knobs
        if kwargs.get("return_dict_in_generate"):
            return GenerateOutput(input_ids.clone(), DecodeStats(), () if kwargs.get("output_scores") else None)
        return input_ids.clone()

    # ------------------------------------------------------------------ what requests share
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

    def budget_policy(self, config: ProbeConfig, drafter: Drafter, fixed: bool = False,
                      memory: DraftingMemory | None = None) -> BudgetPolicy:
        """The adaptive budget for ``budget="auto"`` (starting from what ``memory`` learnt for this
        drafter); the drafter's whole tree otherwise, and with ``fixed`` (ConfAdapt reads every
        step's masks; recursive rejection needs the drawn tree)."""
        if not config.adaptive or fixed:
            return FixedBudget.for_drafter(drafter)
        widest = self.widest_pass(config)
        state = None
        if memory is not None:
            state = memory.budget_state(f"{drafter.name}/k{drafter.num_masks}/m{drafter.mask_nodes}/w{widest}")
        return AdaptiveBudget.for_drafter(self.cost_curve(config), drafter, widest, state=state)

    def _cold_bytes(self) -> int:
        return int(self.memory_mb * (1 << 20))

    def widest_pass(self, config: ProbeConfig) -> int:
        """The most inputs ``budget="auto"`` may verify at once: ``max_budget``, lowered so that
        one pass's logits stay under ``pass_memory`` times the weights' bytes (never below the
        smallest tree with masks on its root)."""
        if not config.pass_memory:
            return config.max_budget
        if self._weight_bytes is None:
            self._weight_bytes = weight_bytes(self.model)
        row_bytes = 4 * self.embed.num_embeddings  # a float32 logits row
        rows = int(config.pass_memory * self._weight_bytes // row_bytes)
        return max(min(config.max_budget, rows), min_block_complexity(config.num_masks))

    def embedding_stats(self) -> EmbeddingStats:
        if self._embedding_stats is None:
            self._embedding_stats = embedding_stats(self.embed, self.embed.num_embeddings)
        return self._embedding_stats

    def tuned_masks(self, config: ProbeConfig, num_masks: int) -> TunedMasks | None:
        """The tuned vectors ``config.masks`` asks for (None: the untuned ``mask_init``)."""
        choice = config.masks
        if choice is None or (isinstance(choice, str) and choice in UNTUNED_MASKS):
            return None
        if isinstance(choice, str) and choice == AUTO_MASKS:
            if config.mask_init != "prompt_mean":
                return None
            if num_masks not in self._auto_tuned:
                self._auto_tuned[num_masks] = self._tuned.bundled_if_any(num_masks)
            return self._auto_tuned[num_masks]
        return self._tuned.get(choice, num_masks)

    def mask_vectors(self, config: ProbeConfig, prompt: torch.Tensor, num_masks: int,
                     tuned: TunedMasks | None = None) -> MaskVectors:
        """The k mask vectors of one generation: ``tuned`` or from ``mask_init``."""
        if tuned is not None:
            return tuned.mask_vectors(self.embed, prompt, num_masks, config.mask_update)
        stats = self.embedding_stats() if config.mask_init == "sample" else None
        return config_mask_vectors(config, self.embed, prompt, num_masks, stats)
