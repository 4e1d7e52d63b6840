"""``probe_mtp.optimize``: a model prepared in place for exact decoding in bf16 (or float32), on tiny
models built from configs (the embedded models: tests/models/test_prepared_bf16.py).  Both linear
kernels are covered: weights packed once for oneDNN (or by MKL, float32), and the stock product under checked row plans
(what an accelerator or a CPU without oneDNN for the dtype gets: on CUDA the same code decides at
run time), as are moves of a prepared model and refusals that leave the model as it was."""

from __future__ import annotations

import copy
import importlib
import logging

import pytest
import torch
from torch import nn
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

import probe_mtp
from probe_mtp import kernels
from probe_mtp.kernels import EXACT_ATTENTION, PackedLinear, Processor
from probe_mtp.optimize import OptimizeError, _check_can_optimize, weight_bytes

optimize_module = importlib.import_module("probe_mtp.optimize")  # the package exports the function by that name
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


@pytest.mark.cpu_only  # oneDNN packing
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
    with pytest.raises(OptimizeError, match="torch.bfloat16 or torch.float32, not torch.float16"):
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
    with pytest.raises(OptimizeError, match="bfloat16 or torch.float32, not torch.float16"):
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


@pytest.mark.cpu_only  # the processor's flags
def test_a_processor_without_bf16_units_is_told_so():
    model = tiny()
    old = Processor("Old CPU", frozenset(), True)
    with pytest.raises(OptimizeError, match=r"Old CPU.*no bf16 matrix units.*left as it was.*require_matrix_units=False"):
        _check_can_optimize(model, torch.bfloat16, old, require_matrix_units=True)
    _check_can_optimize(model, torch.bfloat16, old, require_matrix_units=False)  # allowed when asked for
    no_onednn = Processor("New CPU", frozenset({"amx_bf16"}), False)
    with pytest.raises(OptimizeError, match="oneDNN cannot run bf16"):
        _check_can_optimize(model, torch.bfloat16, no_onednn, require_matrix_units=True)
    _check_can_optimize(model, torch.float32, old, require_matrix_units=True)  # float32 needs no bf16 units


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


# ------------------------------------------------------------------------------- the stock-product path
@pytest.fixture
def stock_cpu(monkeypatch):
    """This processor as one whose oneDNN runs neither bf16 nor float32: optimize takes the path an
    accelerator takes (the stock product on the plain weight, under checked row plans)."""
    real = kernels.processor()
    fake = Processor(real.name, real.flags, False, False)
    monkeypatch.setattr(optimize_module, "processor", lambda: fake)
    return fake


def _greedy_identical(model, prompts, new=32):
    """Whether probe_mtp.generate gives model.generate's greedy tokens on every prompt."""
    return all(torch.equal(probe_mtp.generate(model, ids, max_new_tokens=new),
                           model.generate(ids, do_sample=False, max_new_tokens=new)) for ids in prompts)


def _prompts(count=2, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (1, 6 + 7 * i), generator=gen) for i in range(count)]


@pytest.mark.parametrize("config,kwargs", [("LlamaConfig", dict(tie_word_embeddings=True)),
                                           ("Gemma3TextConfig", dict(head_dim=16, sliding_window=8))])
def test_stock_products_are_checked_row_invariant_and_identical_to_generate(stock_cpu, config, kwargs):
    model = prepare(tiny(config, **kwargs))
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.packed is None and m.dtype == torch.bfloat16 for m in layers)
    text = probe_mtp.describe(model)
    assert "bfloat16, on cpu (" in text and "stock linear products" in text and "checked on first use" not in text
    if kwargs.get("tie_word_embeddings"):  # the output layer multiplies with the embedding's own storage
        assert model.get_output_embeddings().plain.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    gen = torch.Generator().manual_seed(4)
    one, wide = _passes(model, torch.randint(1, 256, (1, 30), generator=gen), torch.randint(1, 256, (1, 24), generator=gen))
    assert torch.equal(one, wide)
    assert _greedy_identical(model, _prompts())


KERNEL_FACTORIES = [pytest.param("stock_kernel", id="stock")]
if kernels.processor().onednn_bf16:
    KERNEL_FACTORIES.append(pytest.param("onednn_kernel", id="packed"))


@pytest.mark.parametrize("factory", KERNEL_FACTORIES)
def test_a_row_variant_kernel_is_refused_naming_the_layer_and_the_model_is_left_as_it_was(monkeypatch, request, factory):
    """A kernel whose result for a row depends on where in the call the row sits cannot be made
    row-invariant by any plan: optimize refuses before anything changes."""
    if factory == "stock_kernel":
        request.getfixturevalue("stock_cpu")

    def row_variant(weight, bias):
        dense = weight.to_dense() if weight.is_mkldnn else weight

        def kernel(x2d):
            out = nn.functional.linear(x2d.double(), dense.double())
            return (out * (1 + 2**-6 * torch.arange(x2d.shape[0], dtype=out.dtype))[:, None]).to(x2d.dtype)

        return kernel

    monkeypatch.setattr(kernels, factory, row_variant)
    model = tiny()
    before = _snapshot(model)
    with pytest.raises(OptimizeError, match=r"layer lm_head: .*a torch.bfloat16 product with a \[256, 64\] weight rounds a row "
                                            r"differently.*the model was left as it was"):
        prepare(model)
    assert _unchanged(model, before)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


# ------------------------------------------------------------------------------- float32
def test_float32_is_a_dtype_like_bf16():
    """optimize(model, torch.float32): the same layers and checks in float32 (packed once by MKL on an
    Intel processor where torch carries it, else by oneDNN where it runs float32), so float32 tree
    passes are row-invariant too; no bf16 units needed."""
    model = probe_mtp.optimize(tiny(), torch.float32)
    assert probe_mtp.is_optimized(model) and model.dtype == torch.float32
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert all(m.dtype == torch.float32 and m.kind == kernels.packing(torch.float32) for m in layers)
    assert probe_mtp.describe(model).startswith("float32, on cpu (")
    # packed once: no repacking at calls of two rows or more
    by = {kernels.MKL: "linear weights packed once by MKL", kernels.ONEDNN: "linear weights packed once for oneDNN"}
    if kernels.packing(torch.float32) in by:
        assert by[kernels.packing(torch.float32)] in probe_mtp.describe(model)
    gen = torch.Generator().manual_seed(6)
    one, wide = _passes(model, torch.randint(1, 256, (1, 30), generator=gen), torch.randint(1, 256, (1, 24), generator=gen))
    assert torch.equal(one, wide)
    assert _greedy_identical(model, _prompts())


# ------------------------------------------------------------------------------- moving a prepared model
def test_a_moved_model_stays_prepared_and_exact_and_says_so():
    model = prepare(tiny())
    model.to(torch.float32)
    assert probe_mtp.is_optimized(model) and model.dtype == torch.float32
    assert all(m.packed is None and m.dtype == torch.float32 for m in model.modules() if isinstance(m, PackedLinear))
    text = probe_mtp.describe(model)
    assert "float32, on cpu, moved after optimize (prepared as bfloat16 on cpu" in text
    assert "stock linear products (row plans checked on first use)" in text and "row-invariant attention" in text
    gen = torch.Generator().manual_seed(7)
    one, wide = _passes(model, torch.randint(1, 256, (1, 30), generator=gen), torch.randint(1, 256, (1, 24), generator=gen))
    assert torch.equal(one, wide)
    assert _greedy_identical(model, _prompts())
    assert "checked on first use" not in probe_mtp.describe(model)  # now checked there
    # prepared again where it now is: no longer "moved", packed as optimize packs float32 here
    probe_mtp.optimize(model, torch.float32)
    assert "moved" not in probe_mtp.describe(model)
    assert all(m.kind == kernels.packing(torch.float32) for m in model.modules() if isinstance(m, PackedLinear))
    model.to(torch.bfloat16)
    assert "moved after optimize (prepared as float32" in probe_mtp.describe(model)
    prepare(model)
    assert probe_mtp.describe(model).startswith("bfloat16, on cpu (")


def test_a_model_moved_to_meta_says_it_holds_no_data_and_is_not_prepared_again():
    model = prepare(tiny())
    ids = torch.randint(1, 256, (1, 9), generator=torch.Generator().manual_seed(8))
    empty = copy.deepcopy(model).to("meta")
    assert "on meta (no data" in probe_mtp.describe(empty)
    with torch.no_grad():
        logits = empty(ids.to("meta")).logits
    assert logits.device.type == "meta" and logits.shape == (1, 9, 256)
    with pytest.raises(OptimizeError, match="weights on meta"):
        prepare(empty)


def test_attention_switched_after_optimize_is_no_longer_prepared_until_prepared_again():
    model = prepare(tiny())
    model.set_attn_implementation("sdpa")
    assert not probe_mtp.is_optimized(model)
    assert "sdpa attention (switched after optimize: not row-invariant" in probe_mtp.describe(model)
    prepare(model)
    assert probe_mtp.is_optimized(model) and model.config._attn_implementation == EXACT_ATTENTION
