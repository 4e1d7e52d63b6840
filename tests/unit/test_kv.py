"""The decoding cache (probe_mtp.kv) on toy tensors: keep_accepted keeps the accepted prefix and
path (sliding layers trimmed to their window), the reserved layer writes in place and grows when
full, and a whole generation on a tiny model never reallocates the reserved buffers."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Gemma3TextConfig, LlamaConfig
from transformers.cache_utils import DynamicLayer
from transformers import LlamaForCausalLM

from probe_mtp.kv import GROW_TOKENS, ReservedLayer, keep_accepted, new_cache, start_recording


def _filled_cache(config, length, num_layers, capacity=None):
    cache = DynamicCache(config=config)
    if capacity is not None:  # reserved full-attention layers, as decoding uses them
        cache.layers = [ReservedLayer(capacity) if type(layer) is DynamicLayer else layer
                        for layer in cache.layers]
    start_recording(cache)
    for i in range(num_layers):
        k = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1).expand(1, 1, length, 2).clone()
        cache.layers[i].update(k, k.clone())
    return cache


RESERVED = pytest.mark.parametrize("capacity", [None, 16], ids=["dynamic", "reserved"])


@RESERVED
def test_keep_accepted_selects_prefix_and_path(capacity):
    config = LlamaConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=1, num_key_value_heads=1,
                         intermediate_size=8, vocab_size=16)
    cache = _filled_cache(config, 10, 2, capacity)  # 6 cached + a pass of 4 new entries
    keep_accepted(cache, 4, torch.tensor([0, 2]))
    for layer in cache.layers:
        assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 8]
        assert layer.values.shape[-2] == 8
    assert cache.get_seq_length() == 8


@RESERVED
def test_keep_accepted_prefix_and_empty_keep_then_next_pass_appends_after_them(capacity):
    config = LlamaConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=1, num_key_value_heads=1,
                         intermediate_size=8, vocab_size=16)
    cache = _filled_cache(config, 10, 2, capacity)  # 6 cached + a pass of 4
    keep_accepted(cache, 4, torch.tensor([0, 1]))  # a prefix of the pass: a cut, nothing moves
    assert [layer.keys[0, 0, :, 0].tolist() for layer in cache.layers] == [[0, 1, 2, 3, 4, 5, 6, 7]] * 2
    new = torch.full((1, 1, 3, 2), 50.0)
    for layer in cache.layers:
        layer.update(new, new.clone())
    keep_accepted(cache, 3, torch.tensor([], dtype=torch.long))  # nothing of the pass is kept
    for layer in cache.layers:
        assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
        layer.update(new[:, :, :2] + 1, new[:, :, :2] + 2)
    keep_accepted(cache, 2, torch.tensor([1]))
    for layer in cache.layers:
        assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 51]
        assert layer.values[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 52]
    assert cache.get_seq_length() == 9


@RESERVED
def test_keep_accepted_trims_sliding_layers_to_window(capacity):
    config = Gemma3TextConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=1, num_key_value_heads=1,
                              intermediate_size=8, vocab_size=16, head_dim=2, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"])
    cache = _filled_cache(config, 9, 2, capacity)  # 5 committed + a pass of 4
    sliding, full = cache.layers
    keep_accepted(cache, 4, torch.tensor([0, 3]))
    assert sliding.cumulative_length == 7
    # the window keeps the last sliding_window - 1 = 3 committed entries: positions 4, 5 (node 0), 8 (node 3)
    assert sliding.keys[0, 0, :, 0].tolist() == [4, 5, 8]
    assert full.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 8]


def test_reserved_layer_writes_in_place_grows_when_full_and_adopts_replaced_tensors():
    layer = ReservedLayer(capacity=8)
    rows = lambda a, b: torch.arange(a, b, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 2, -1, 3).clone()  # noqa: E731
    keys, values = layer.update(rows(0, 5), rows(0, 5) + 100)
    buffer = layer.keys.data_ptr()
    assert keys.shape == (1, 2, 5, 3) and layer.get_seq_length() == 5
    layer.update(rows(5, 8), rows(5, 8) + 100)  # fills the buffer exactly: no new allocation
    assert layer.keys.data_ptr() == buffer and layer.capacity == 8
    cache = DynamicCache()
    cache.layers = [layer]
    keep_accepted(cache, 3, torch.tensor([2]))  # keep entry 7 only: [0..4, 7]
    assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 7] and layer.keys.data_ptr() == buffer
    layer.update(rows(20, 25), rows(20, 25) + 100)  # 6 + 5 > 8: moves to a larger buffer once
    assert layer.capacity == 8 + GROW_TOKENS
    assert layer.keys[0, 1, :, 0].tolist() == [0, 1, 2, 3, 4, 7, 20, 21, 22, 23, 24]
    assert layer.values[0, 1, :, 2].tolist() == [100, 101, 102, 103, 104, 107, 120, 121, 122, 123, 124]
    grown = layer.keys.data_ptr()
    layer.update(rows(30, 31), rows(30, 31))
    assert layer.keys.data_ptr() == grown
    layer.keys, layer.values = layer.keys[:, :, :4].clone(), layer.values[:, :, :4].clone()  # replaced from outside
    layer.update(rows(40, 41), rows(40, 41))
    assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 40]


def test_decoding_cache_is_reserved_and_never_reallocated():
    """A whole generation writes into the buffers reserved at the prompt: same storage at the end."""
    model = _tiny_llama("sdpa")
    model.generation_config.eos_token_id = None
    cache = new_cache(model, capacity=64)
    assert all(isinstance(layer, ReservedLayer) for layer in cache.layers)
    ids = torch.randint(1, 15, (1, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, cache=cache, use_cache=True)
    first = [layer.keys.data_ptr() for layer in cache.layers]
    for i in range(40):
        model(input_ids=ids[:, i % 12 : i % 12 + 1], cache=cache, use_cache=True)
    assert [layer.keys.data_ptr() for layer in cache.layers] == first
    assert cache.get_seq_length() == 52


def _tiny_llama(attn: str):
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=16, max_position_embeddings=256,
                         attn_implementation=attn, bos_token_id=0, eos_token_id=15, pad_token_id=0)
    return LlamaForCausalLM(config).eval()
