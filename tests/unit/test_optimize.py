"""``probe_mtp.optimize``: a model prepared in place for exact bf16 decoding, on tiny models built
from configs (the embedded models: tests/models/test_prepared_bf16.py)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

import probe_mtp
from probe_mtp.kernels import EXACT_ATTENTION, PackedLinear, Processor
from probe_mtp.optimize import OptimizeError, _check_can_optimize, weight_bytes

STD = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
           vocab_size=256, max_position_embeddings=256, pad_token_id=0, bos_token_id=None, eos_token_id=None)


@pytest.fixture(autouse=True)
def _quiet():
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def tiny(config: str = "LlamaConfig", attn: str = "sdpa", **kwargs):
    torch.manual_seed(0)
    config = getattr(transformers, config)(**{**STD, **kwargs})
    config.initializer_range = 0.1
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def prepare(model):
    return probe_mtp.optimize(model, require_matrix_units=False)


def test_optimize_prepares_the_model_in_place():
    model = tiny(tie_word_embeddings=True)
    fp32_bytes = weight_bytes(model)
    assert prepare(model) is model
    assert probe_mtp.is_optimized(model) and model.dtype == torch.bfloat16
    assert model.config._attn_implementation == EXACT_ATTENTION
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.get_output_embeddings(), PackedLinear)
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert "bfloat16" in probe_mtp.describe(model) and "row-invariant attention" in probe_mtp.describe(model)
    assert weight_bytes(model) <= fp32_bytes  # the tied output layer's packed copy included
    assert prepare(model) is model  # already prepared: unchanged
    with pytest.raises(OptimizeError, match="already prepared"):
        probe_mtp.optimize(model, torch.float16, require_matrix_units=False)


def test_prepared_model_stays_close_to_float32():
    model = tiny()
    ids = torch.randint(1, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp32 = model(ids).logits.float()
        prepare(model)
        bf16 = model(ids).logits.float()
    assert (bf16 - fp32).abs().max() < 0.05 * fp32.abs().max()


def _passes(model, prompt, tokens):
    """Logits of ``tokens`` decoded one at a time after ``prompt``, and of one causal pass over them."""
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt, cache=cache, use_cache=True)
        wide_cache = copy.deepcopy(cache)
        one = torch.cat([model(tokens[:, i : i + 1], cache=cache, use_cache=True).logits[0]
                         for i in range(tokens.shape[1])])
        wide = model(tokens, cache=wide_cache, use_cache=True).logits[0]
    return one, wide


@pytest.mark.parametrize("config,kwargs", [("LlamaConfig", {}), ("Gemma3TextConfig", dict(head_dim=16, sliding_window=8)),
                                           ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256))])
def test_prepared_forward_is_row_invariant(config, kwargs):
    """A causal pass of 24 new tokens gives every row the bits of the one-token pass at that point."""
    model = tiny(config, **kwargs) if config != "GPT2Config" else tiny(config, **{k: v for k, v in STD.items() if k in (
        "vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")}, **kwargs)
    prepare(model)
    gen = torch.Generator().manual_seed(1)
    one, wide = _passes(model, torch.randint(1, 256, (1, 30), generator=gen), torch.randint(1, 256, (1, 24), generator=gen))
    assert torch.equal(one, wide)


def test_float32_model_is_not_row_invariant_in_bf16_without_preparation():
    """Why preparing is needed: the same model cast to bf16 with sdpa differs between the two."""
    model = tiny(hidden_size=256, intermediate_size=1536, num_attention_heads=4, num_key_value_heads=2).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    one, wide = _passes(model, torch.randint(1, 256, (1, 60), generator=gen), torch.randint(1, 256, (1, 24), generator=gen))
    assert not torch.equal(one, wide)
    prepare(model)
    one, wide = _passes(model, torch.randint(1, 256, (1, 60), generator=gen), torch.randint(1, 256, (1, 24), generator=gen))
    assert torch.equal(one, wide)


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, model.config._attn_implementation


def _unchanged(model, snapshot):
    state, attn = snapshot
    now = model.state_dict()
    return (set(now) == set(state) and all(torch.equal(now[k], state[k]) and now[k].dtype == state[k].dtype for k in state)
            and model.config._attn_implementation == attn and not probe_mtp.is_optimized(model))


def test_refusals_leave_the_model_as_it_was():
    model = tiny()
    before = _snapshot(model)
    with pytest.raises(OptimizeError, match="bfloat16 only"):
        probe_mtp.optimize(model, torch.float16, require_matrix_units=False)
    assert _unchanged(model, before)
    moe = tiny("Qwen3MoeConfig", head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    before = _snapshot(moe)
    with pytest.raises(OptimizeError, match="weights outside linear layers.*Qwen3MoeExperts.*decode it in float32"):
        prepare(moe)
    assert _unchanged(moe, before)
    xglm = tiny("XGLMConfig", attn="eager", d_model=64, num_layers=2, attention_heads=4, ffn_dim=128)
    with pytest.raises(OptimizeError, match="XGLMForCausalLM computes attention in its own code"):
        prepare(xglm)


def test_a_processor_without_bf16_units_is_told_so():
    model = tiny()
    old = Processor("Old CPU", frozenset(), True)
    with pytest.raises(OptimizeError, match=r"Old CPU.*no bf16 matrix units.*left as it was.*require_matrix_units=False"):
        _check_can_optimize(model, torch.bfloat16, old, require_matrix_units=True)
    _check_can_optimize(model, torch.bfloat16, old, require_matrix_units=False)  # allowed when asked for
    no_onednn = Processor("New CPU", frozenset({"amx_bf16"}), False)
    with pytest.raises(OptimizeError, match="oneDNN cannot run bf16"):
        _check_can_optimize(model, torch.bfloat16, no_onednn, require_matrix_units=True)


def test_prepared_model_saves_loads_copies_and_moves(tmp_path):
    model = prepare(tiny(tie_word_embeddings=False))
    ids = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    prepare(loaded)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)
        assert torch.equal(copy.deepcopy(model)(ids).logits, expected)
        model.to(torch.float32)  # a plain float32 model again (no longer packed)
        assert torch.allclose(model(ids).logits, expected.float(), atol=0.1, rtol=0.05)
