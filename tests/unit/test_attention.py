"""The grouped-query attention decoders switch to: the same numbers as transformers' sdpa bit for
bit (tree masks, batches of rows, sliding windows), switched on only where it applies, and given
back afterwards, also when blocks nest, fail or overlap."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

import probe_mtp
from probe_mtp.attention import GROUPED_SDPA, grouped_query_attention, uses_grouped_attention


def _llama(kv_heads=2, attn="sdpa"):
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads,
                         intermediate_size=128, vocab_size=64, max_position_embeddings=256, attn_implementation=attn)
    return LlamaForCausalLM(config).eval()


def _gemma():
    torch.manual_seed(0)
    config = Gemma3TextConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                              head_dim=32, intermediate_size=128, vocab_size=64, sliding_window=8,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              max_position_embeddings=256, attn_implementation="sdpa")
    return Gemma3ForCausalLM(config).eval()


def _tree_mask(batch: int, past: int, n: int, seed: int = 0) -> torch.Tensor:
    """[batch, 1, n, past + n]: a random visible past per row (left padding) and a random tree."""
    g = torch.Generator().manual_seed(seed)
    past_mask = torch.rand(batch, 1, n, past, generator=g) > 0.2
    tree = torch.tril(torch.rand(n, n, generator=g) > 0.5) | torch.eye(n, dtype=torch.bool)
    return torch.cat([past_mask, tree.expand(batch, 1, n, n)], dim=-1)


@torch.no_grad()
@pytest.mark.parametrize("batch", [1, 3])
def test_the_grouped_attention_gives_sdpa_s_logits_bit_for_bit(batch, monkeypatch):
    model = _llama()
    sdpa, grouped_calls = torch.nn.functional.scaled_dot_product_attention, []

    def counting(*args, **kwargs):
        grouped_calls.append(bool(kwargs.get("enable_gqa")) and kwargs.get("attn_mask") is not None)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    ids = torch.randint(0, 64, (batch, 40), generator=torch.Generator().manual_seed(1))
    past, n = 30, 10
    mask = _tree_mask(batch, past, n)
    positions = torch.arange(past, past + n).expand(batch, n)

    def logits():
        cache = model(input_ids=ids[:, :past], use_cache=True).past_key_values
        return model(input_ids=ids[:, past:], attention_mask=mask, position_ids=positions, cache=cache).logits

    plain = logits()
    assert not any(grouped_calls)
    with grouped_query_attention(model):
        assert model.config._attn_implementation == GROUPED_SDPA
        grouped = logits()
    assert sum(grouped_calls) == 2  # each layer's tree pass took the groups as they are
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(plain, grouped)


@torch.no_grad()
def test_decoding_with_and_without_it_is_the_same_on_a_sliding_window_model():
    model = _gemma()
    ids = torch.randint(3, 64, (1, 24), generator=torch.Generator().manual_seed(2))
    reference = model.generate(ids, do_sample=False, max_new_tokens=40)
    out = probe_mtp.generate(model, ids, max_new_tokens=40, drafter="esp", num_masks=2, budget=12)
    assert torch.equal(out, reference)
    assert model.config._attn_implementation == "sdpa"  # given back after the call


def test_it_applies_only_to_sdpa_models_with_shared_key_value_heads():
    assert uses_grouped_attention(_llama(kv_heads=2))
    assert uses_grouped_attention(_gemma())
    assert not uses_grouped_attention(_llama(kv_heads=4))  # one key/value head per query head
    assert not uses_grouped_attention(_llama(attn="eager"))
    eager = _llama(attn="eager")
    with grouped_query_attention(eager):
        assert eager.config._attn_implementation == "eager"


def test_nested_failing_and_overlapping_blocks_give_sdpa_back():
    model = _llama()
    with grouped_query_attention(model):
        with grouped_query_attention(model):  # nested: the outer block switches back
            pass
        assert model.config._attn_implementation == GROUPED_SDPA
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError):
        with grouped_query_attention(model):
            raise RuntimeError("a failed request")
    assert model.config._attn_implementation == "sdpa"
    # two threads: one enters, the other enters and leaves, the first leaves
    entered, second_done = threading.Event(), threading.Event()

    def first():
        with grouped_query_attention(model):
            entered.set()
            second_done.wait(5)

    thread = threading.Thread(target=first)
    thread.start()
    entered.wait(5)
    with grouped_query_attention(model):
        pass
    second_done.set()
    thread.join()
    assert model.config._attn_implementation == "sdpa"
