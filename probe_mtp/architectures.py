"""Which Hugging Face causal LMs probe-mtp can decode, decided up front from the model and its config.

A verification pass hands the model a token tree: inputs whose positions are their depths (so
siblings share a position), a 4D attention mask that lets each input see only the committed past
and its own ancestors, and a KV cache that is later cut back to the accepted path.  A model can be
decoded losslessly only if its forward honours all three.  :func:`check_supported` refuses, before
any forward pass, every model known not to, with the reason and what to do instead; everything it
lets through is covered by the architecture matrix in ``tests/unit/test_architectures.py``.

Checked here, in this order (mechanisms read from the model and its config, not model names):

- every cache layer can be rolled back (:func:`probe_mtp.kv.new_cache`: no recurrent, compressed
  or shared-KV layers: Mamba, Qwen3-Next, MiniMax, Granite-MoE-Hybrid, DeepSeek-V4 ...);
- the forward takes a KV cache (``cache`` / ``past_key_values``: not OpenAI GPT, RWKV, XLNet);
- the forward takes ``position_ids``: a model without them places every input by its order in the
  sequence (BLOOM's and MPT's ALiBi biases from the key's index, the learned positions of
  BART-style decoders from the cache length), so tree nodes, which must sit at their depth, would
  be biased or embedded as if they were a chain;
- no ALiBi computed from cache indices (Falcon with ``alibi=True``), for the same reason;
- the decoder's self-attention is causal (an encoder such as BERT loaded as a causal LM without
  ``is_decoder=True`` attends both ways; XLM with ``causal=False``);
- no local attention windowed by cache index inside the attention module (GPT-Neo's "local"
  layers), which a tree attention mask cannot correct;
- every layer is a full-attention or sliding-window layer (``config.layer_types`` as transformers'
  ``DynamicCache`` reads it): chunked attention (Llama 4) masks keys by fixed chunks, which the
  tree masks do not implement.

The attention implementation (``sdpa`` or ``eager`` only) is checked by
:func:`attention_format`, which calls :func:`check_supported` first.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from .kv import AttentionFormat, UnsupportedModelError, new_cache

# the layer types whose tree masks probe_mtp.kv.attention_inputs builds
MASKED_LAYER_TYPES = ("full_attention", "sliding_attention")

_USE_INSTEAD = (
    "decode it with model.generate(), or use a model with rotary or learned absolute positions "
    "(Llama, Qwen, Mistral, Gemma, Phi, GPT-2, ...)"
)


def _describe(model) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__}" + (f" (model_type {model_type!r})" if model_type else "")


def text_config(model):
    """The decoder's config (the text config of a composite model)."""
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def decoder_layer_types(model) -> list[str]:
    """Each decoder layer's attention type, as transformers' ``DynamicCache(config=...)`` derives
    it: ``config.layer_types`` if set, else ``"sliding_attention"`` for every layer when
    ``config.sliding_window`` is set, ``"chunked_attention"`` with ``attention_chunk_size``, else
    ``"full_attention"``."""
    types, _ = get_layer_types_and_kwargs(text_config(model))
    return list(types)


def _forward_parameters(model) -> set[str] | None:
    """The names the model's ``forward`` takes (None: not introspectable, let other checks decide)."""
    try:
        return set(inspect.signature(type(model).forward).parameters)
    except (TypeError, ValueError):
        return None


def _bidirectional_attention(model) -> list[str]:
    """Names of decoder modules that attend in both directions: ``is_causal=False`` on a
    self-attention module (cross-attention excluded), or ``is_decoder=False`` on a module of a
    BERT-style encoder (which then builds a bidirectional mask)."""
    try:
        root = model.get_decoder()
    except Exception:  # noqa: BLE001 - no separate decoder: scan the whole model
        root = model
    root = root if isinstance(root, torch.nn.Module) else model
    found = []
    for name, module in root.named_modules():
        if getattr(module, "is_causal", True) is False and not getattr(module, "is_cross_attention", False):
            found.append(f"{name or 'model'}.is_causal=False")
        elif getattr(module, "is_decoder", True) is False:
            found.append(f"{name or 'model'}.is_decoder=False")
    return found


def check_supported(model) -> list[str]:
    """Raise :class:`UnsupportedModelError` if ``model`` cannot verify a token tree losslessly;
    return its decoder layer types otherwise."""
    new_cache(model)  # first: recurrent, compressed or shared-KV layers, with their own message
    config = text_config(model)
    what = _describe(model)
    params = _forward_parameters(model)
    if params is not None and not {"cache", "past_key_values"} & params:
        raise UnsupportedModelError(
            f"{what} is not supported: its forward takes no KV cache (no cache or past_key_values argument), "
            "and tree verification needs one to cut back to the accepted path after every pass. "
            f"Instead: {_USE_INSTEAD}"
        )
    if params is not None and "position_ids" not in params:
        raise UnsupportedModelError(
            f"{what} is not supported: its forward takes no position_ids, so it positions every input by its "
            "order in the sequence (ALiBi biases from the key's index in BLOOM and MPT, learned positions from "
            "the cache length in BART-style decoders), while the nodes of a draft tree must sit at their depth "
            f"(siblings share a position); tree verification would change its output. Instead: {_USE_INSTEAD}"
        )
    if getattr(config, "alibi", False) is True:
        raise UnsupportedModelError(
            f"{what} with alibi=True is not supported: its ALiBi biases are computed from each key's index "
            "in the KV cache, not from position_ids, so draft-tree nodes (positioned at their depth) would "
            "get wrong biases. Checkpoints of this architecture with rotary positions (alibi=False) are "
            f"supported. Instead: {_USE_INSTEAD}"
        )
    bidirectional = _bidirectional_attention(model)
    if getattr(config, "causal", None) is False:  # XLM-style: a causal flag off means bidirectional
        bidirectional.insert(0, "config.causal=False")
    if bidirectional:
        raise UnsupportedModelError(
            f"{what} is not supported as configured: its self-attention is bidirectional ("
            f"{bidirectional[0]}{' and others' if len(bidirectional) > 1 else ''}), so it is not a causal LM and "
            "no token can be verified before the ones after it. For BERT-style encoders used as decoders, set "
            "config.is_decoder=True (then they are supported); otherwise decode it with model.generate()"
        )
    local = [t for t in (getattr(config, "attention_layers", None) or []) if t == "local"]
    if local and getattr(config, "window_size", None) is not None:
        raise UnsupportedModelError(
            f"{what} is not supported: its {len(local)} local-attention layer(s) apply their "
            f"window_size={config.window_size} by index in the KV cache inside the attention module, which "
            "a tree attention mask cannot correct (draft-tree inputs are not laid out at their positions). "
            f"Instead: {_USE_INSTEAD}"
        )
    try:
        types = decoder_layer_types(model)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot read layer types from
        raise UnsupportedModelError(f"{what}: cannot read its attention layer types ({exc})") from exc
    other = sorted({t for t in types if t not in MASKED_LAYER_TYPES})
    if "chunked_attention" in other:
        raise UnsupportedModelError(
            f"{what} is not supported: it has chunked-attention layers (config.layer_types contains "
            f"'chunked_attention', attention_chunk_size={getattr(config, 'attention_chunk_size', None)}), whose "
            "keys are masked by fixed chunks of positions; probe-mtp builds tree masks for full-attention "
            "and sliding-window layers only. Decode it with model.generate()"
        )
    if other:
        raise UnsupportedModelError(
            f"{what} is not supported: its layers of type {other} need attention masks probe-mtp cannot "
            "build for a draft tree (it supports full-attention and sliding-window layers). Decode it with "
            "model.generate()"
        )
    return types


def attention_format(model) -> AttentionFormat:
    """How to hand attention masks to ``model``, after :func:`check_supported`: raises
    :class:`~probe_mtp.kv.UnsupportedModelError` (with the reason and what to do) for a model that
    cannot verify a token tree."""
    types = tuple(sorted(set(check_supported(model))))
    return AttentionFormat.for_model(model, types)
