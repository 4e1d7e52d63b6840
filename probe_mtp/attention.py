"""Attention for tree passes on CPU without copying key/value heads.

Models with grouped-query attention (fewer key/value heads than query heads: SmolLM2 has 9 query
heads on 3 key/value heads) share each key/value head among a group of query heads.  transformers'
``sdpa`` attention, given a mask and more than one query (every tree pass, every batched pass),
copies each key/value head once per query head (``repeat_kv``) on CPU before calling
``scaled_dot_product_attention``: per layer a copy of the whole cache times the group size, which
for a batch of rows costs more than the attention itself.  torch's CPU kernel takes the groups as
they are (``enable_gqa=True``) and gives the same numbers bit for bit.

:func:`grouped_query_attention` switches a model to that attention while a decoder runs it (every
other call, one query or no mask, goes to transformers' ``sdpa`` unchanged) and back afterwards.
The attention function is registered with transformers' documented ``AttentionInterface`` (and
the ``sdpa`` mask builder under the same name), never patched in.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_SDPA = "probe_mtp_grouped_sdpa"


def grouped_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' ``sdpa`` attention, except that a masked pass of several queries on a CPU
    hands the key/value groups to torch as they are instead of copying them per query head."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or attention_mask is None or query.shape[2] == 1 or query.device.type != "cpu"
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions", False)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def uses_grouped_attention(model) -> bool:
    """Whether :func:`grouped_query_attention` changes anything for ``model``: an ``sdpa`` model on
    a CPU whose attention shares key/value heads, and which lets its attention be switched."""
    config = model.config
    if getattr(config, "_attn_implementation", None) not in ("sdpa", GROUPED_SDPA) or model.device.type != "cpu":
        return False
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if not heads or kv_heads >= heads:
        return False
    can_switch = getattr(model, "_can_set_attn_implementation", None)
    return bool(can_switch()) if callable(can_switch) else False


@contextmanager
def grouped_query_attention(model):
    """Run ``model`` with :func:`grouped_sdpa_attention` inside the block (when
    :func:`uses_grouped_attention`), then give it back its ``sdpa``.  Blocks that nest, or that run at
    once in several threads on one model, leave the switching to the outermost: a block entered
    while the model is already switched changes nothing, and one that leaves restores ``sdpa``
    (the two compute the same numbers, so a block still running is not affected, only slower)."""
    if not uses_grouped_attention(model) or model.config._attn_implementation == GROUPED_SDPA:
        yield
        return
    model.set_attn_implementation(GROUPED_SDPA)
    try:
        yield
    finally:
        if model.config._attn_implementation == GROUPED_SDPA:
            model.set_attn_implementation("sdpa")
