"""The KV cache of a decoding run: creation, checks, attention inputs for a pass, and rollback to
the accepted path.

Full-attention layers are :class:`ReservedLayer`: their keys and values live in one buffer sized for
the whole generation, each pass writes its entries in place and the layer's ``keys``/``values`` are
views of the filled part.  So the cache never re-allocates while decoding (a ``DynamicLayer``
concatenates a new copy of itself at every pass), and memory stays flat.  After each pass the
accepted inputs' entries are copied down over the pass's first slots and the rest is cut off.
Sliding-window layers (bounded by their window) stay transformers' ``DynamicSlidingWindowLayer``:
they record the past during a pass (``activate_past_recording``) and are trimmed back to their
window afterwards, with ``cumulative_length`` set to the committed length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .attention import GROUPED_SDPA
from .kernels import EXACT_ATTENTION
from .tree import additive_mask, full_attention_mask, sliding_attention_mask

SUPPORTED_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)
GROW_TOKENS = 1024  # a reserved layer that runs out of room grows by at least this many entries


class UnsupportedModelError(ValueError):
    """The model cannot be decoded with tree verification (no KV cache, recurrent state, ...)."""


class ReservedLayer(DynamicLayer):
    """A full-attention cache layer whose entries live in one buffer of ``capacity`` positions,
    allocated at the first write (the prompt) and written in place by every later pass.

    ``keys`` and ``values`` are views ``buffer[:, :, :length]``, so everything that reads a
    ``DynamicLayer`` (masks, sequence length, rollback by slicing) reads this one alike.  A pass that
    would overflow the buffer moves it to a larger one (by at least ``GROW_TOKENS``), which a
    capacity sized from ``max_length`` never needs."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = int(capacity)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._allocate(key_states, value_states, max(self.capacity, key_states.shape[-2]), 0)
        self.is_initialized = True

    def _allocate(self, key_like: torch.Tensor, value_like: torch.Tensor, capacity: int, keep: int) -> None:
        b, h, _, d = key_like.shape
        keys = key_like.new_zeros((b, h, capacity, d))
        values = value_like.new_zeros((b, h, capacity, value_like.shape[-1]))
        if keep:
            keys[:, :, :keep] = self.keys
            values[:, :, :keep] = self.values
        self._key_buffer, self._value_buffer = keys, values
        self.keys, self.values = keys[:, :, :keep], values[:, :, :keep]
        self.capacity = capacity

    def _holds_buffer_prefix(self) -> bool:
        """``keys`` is still a prefix view of the buffer (not replaced by a tensor of its own)."""
        return (
            self.keys is not None
            and self.keys.data_ptr() == self._key_buffer.data_ptr()
            and self.values.data_ptr() == self._value_buffer.data_ptr()
            and self.keys.shape[:2] == self._key_buffer.shape[:2]
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if start and not self._holds_buffer_prefix():
            self._allocate(key_states, value_states, max(self.capacity, end), start)  # adopt a replaced tensor
        elif end > self.capacity:
            self._allocate(key_states, value_states, max(end, self.capacity + GROW_TOKENS), start)
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None


def new_cache(model, capacity: int | None = None, every_layer: bool = False) -> DynamicCache:
    """A fresh ``DynamicCache`` for ``model``, checked to hold only attention layers that can be
    rolled back.  With ``capacity``, its full-attention layers are :class:`ReservedLayer` buffers of
    that many positions; with ``every_layer`` too, its sliding-window layers (which then keep
    every entry, the window being applied by the attention mask: a batch's rows hold different
    numbers of tokens, so no one window of slots fits them all)."""
    try:
        # transformers makes a few tensors of its own in there (the sliding window's size): on the
        # model's device, whatever torch's default device is
        with torch.device(model.device):
            cache = DynamicCache(config=model.config)
    except Exception as exc:  # noqa: BLE001 - report any failure as unsupported
        raise UnsupportedModelError(
            f"{type(model).__name__} cannot use a transformers DynamicCache ({exc}); probe-mtp needs a KV cache"
        ) from exc
    bad = sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in SUPPORTED_LAYERS})
    if bad:
        raise UnsupportedModelError(
            f"{type(model).__name__} keeps cache layers of type {bad} (recurrent or compressed state) that "
            "cannot be rolled back to an accepted tree path; probe-mtp supports attention models with "
            "full or sliding-window KV caches"
        )
    if capacity is not None:
        kinds = (DynamicLayer, DynamicSlidingWindowLayer) if every_layer else (DynamicLayer,)
        cache.layers = [ReservedLayer(capacity) if type(layer) in kinds else layer for layer in cache.layers]
    return cache


def select_batch_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only the batch rows ``rows`` of every (reserved) layer, in that order."""
    for layer in cache.layers:
        if not layer.is_initialized or layer.keys is None:
            continue
        length = layer.keys.shape[-2]
        if isinstance(layer, ReservedLayer):
            layer._key_buffer = layer._key_buffer.index_select(0, rows.to(layer._key_buffer.device))
            layer._value_buffer = layer._value_buffer.index_select(0, rows.to(layer._value_buffer.device))
            layer.keys = layer._key_buffer[:, :, :length]
            layer.values = layer._value_buffer[:, :, :length]
        else:
            layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))
            layer.values = layer.values.index_select(0, rows.to(layer.values.device))


def cached_length(cache: DynamicCache) -> int:
    """Committed tokens held by the cache (the sequence length, not the sliding windows' sizes)."""
    return cache.get_seq_length()


def _first_sliding(cache: DynamicCache) -> DynamicSlidingWindowLayer | None:
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            return layer
    return None


def _cache_layer_types(cache: DynamicCache) -> tuple[str, ...]:
    kinds = {"sliding_attention" if isinstance(layer, DynamicSlidingWindowLayer) else "full_attention" for layer in cache.layers}
    return tuple(sorted(kinds))


@dataclass
class AttentionFormat:
    """How attention inputs are handed to this model: bool masks for sdpa, additive float for
    eager; and whether as one 4D tensor or as a mapping ``{layer type: 4D mask}``.

    ``layer_types`` are the distinct attention types of the model's decoder layers
    (``"full_attention"``, ``"sliding_attention"``), read from its config the way transformers'
    ``DynamicCache(config=...)`` reads them, so the masks always fit the cache.  The rule (one
    place, from the model's config, no list of model names):

    - every layer of one type: ONE 4D tensor, that type's mask (the sliding-window mask when all
      layers slide: Mistral, Mixtral, Phi-3, Starcoder2 with ``sliding_window`` set, Qwen2 with
      every layer sliding).  transformers 5 models either pick one mask function from the config
      (``create_causal_mask`` or ``create_sliding_window_causal_mask``: Llama, Mistral, Mixtral,
      Phi-3, Qwen3-MoE, Starcoder2, ...) and take only a tensor (a mapping fails deep inside
      ``masking_utils``), or build a per-layer-type mapping themselves (Qwen2, Qwen3, Gemma 2/3,
      Cohere 2, ...) and, given a 4D tensor, use it for every layer; both pass a 4D tensor through
      unchanged, so one tensor is right for either kind whenever all layers share their type.
    - layers of different types (Gemma 2/3, Cohere 2, OLMo 3, GPT-OSS, Qwen2 with
      ``max_window_layers``): the mapping ``{"full_attention": ..., "sliding_attention": ...}``;
      only models that build per-layer-type masks have mixed layer types, and they all accept
      the mapping pre-built.

    ``layer_types=None`` (a format built by hand) reads the types off the cache at each pass.
    """

    additive_dtype: torch.dtype | None  # None: boolean masks
    device: torch.device
    layer_types: tuple[str, ...] | None = None

    @classmethod
    def for_model(cls, model, layer_types: tuple[str, ...] | None = None) -> "AttentionFormat":
        """The format for ``model``'s attention implementation (a clear error for one that cannot
        take a tree mask).  Use :func:`probe_mtp.architectures.attention_format`, which first checks
        that the model can verify a tree at all and reads its layer types."""
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        # GROUPED_SDPA: sdpa while a decoder runs (probe_mtp.attention); EXACT_ATTENTION: a model
        # prepared by probe_mtp.optimize (probe_mtp.kernels); both take sdpa's boolean masks
        if impl in ("sdpa", GROUPED_SDPA, EXACT_ATTENTION):
            return cls(None, model.device, layer_types)
        if impl == "eager":
            return cls(model.dtype, model.device, layer_types)
        raise UnsupportedModelError(
            f"attn_implementation={impl!r} cannot take a tree attention mask; load the model with "
            "attn_implementation='sdpa' (recommended) or 'eager'"
        )

    def finish(self, mask: torch.Tensor) -> torch.Tensor:
        return mask if self.additive_dtype is None else additive_mask(mask, self.additive_dtype)


def attention_inputs(
    cache: DynamicCache,
    block_visible,
    block_positions: torch.Tensor,
    fmt: AttentionFormat,
    past_visible: torch.Tensor | None = None,
):
    """The ``attention_mask`` argument for a pass of ``len(block_positions)`` new inputs on top of
    ``cache``: one 4D mask when all layers share their attention type, else the mapping
    ``{"full_attention": ..., "sliding_attention": ...}`` (see :class:`AttentionFormat`)."""
    types = fmt.layer_types or _cache_layer_types(cache)
    masks = {}
    if "full_attention" in types:
        past_len = cached_length(cache)
        masks["full_attention"] = fmt.finish(full_attention_mask(block_visible, past_len, past_visible, device=fmt.device))
    if "sliding_attention" in types:
        sliding_layer = _first_sliding(cache)
        n = int(block_positions.shape[0])
        kv_length, kv_offset = sliding_layer.get_mask_sizes(n)
        sliding_past_visible = None
        if past_visible is not None:
            sliding_past_visible = past_visible[kv_offset : kv_offset + kv_length - n]
        sliding = sliding_attention_mask(
            block_visible,
            block_positions,
            kv_offset,
            kv_length,
            sliding_layer.sliding_window,
            sliding_past_visible,
            device=fmt.device,
        )
        masks["sliding_attention"] = fmt.finish(sliding)
    if len(masks) == 1:
        return next(iter(masks.values()))
    return masks


def start_recording(cache: DynamicCache) -> None:
    """Make sliding layers keep every entry of a pass until :func:`keep_accepted` trims them."""
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.activate_past_recording()


def keep_accepted(cache: DynamicCache, num_new: int, keep_new) -> None:
    """After a pass that appended ``num_new`` entries, keep the previously cached entries and, of
    the new ones, only ``keep_new`` (indices into the pass's inputs, in increasing order; a host
    array, which is what the acceptance walk gives: it is moved to the cache's device once).

    Only the pass's own entries move: the kept ones are copied down in place over the first
    ``len(keep_new)`` new slots and the rest is cut off (a view; in a :class:`ReservedLayer` the
    next pass writes over it), so the step costs O(pass) rather than a copy of the whole cache."""
    keep_new = np.asarray(keep_new, dtype=np.int64)  # a device tensor here would be a hidden wait: refused
    kept = int(keep_new.size)
    is_prefix = kept == 0 or bool((keep_new == np.arange(kept)).all())
    host = torch.from_numpy(keep_new)
    moved: dict[torch.device, torch.Tensor] = {}
    for layer in cache.layers:
        if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            continue
        old = layer.keys.shape[-2] - num_new
        if not is_prefix:
            device = layer.keys.device
            if device not in moved:
                moved[device] = host.to(device)
            src = moved[device] + old
            layer.keys[:, :, old : old + kept] = layer.keys.index_select(-2, src)
            layer.values[:, :, old : old + kept] = layer.values.index_select(-2, src)
        if kept < num_new:
            layer.keys = layer.keys[:, :, : old + kept, :]
            layer.values = layer.values[:, :, : old + kept, :]
        if isinstance(layer, DynamicSlidingWindowLayer):
            # cumulative_length counted all num_new entries; the sequence grew by len(keep_new) only
            layer.cumulative_length = layer.cumulative_length - num_new + kept
            window = layer.sliding_window - 1
            if layer.keys.shape[-2] > window:
                layer.keys = layer.keys[:, :, -window:, :]
                layer.values = layer.values[:, :, -window:, :]
