"""``probe_mtp.pack_wide``: a layer's one-row product is the stock one bit for bit, its products of
two rows or more use the weight packed once by MKL or by oneDNN (equal to the stock product up to
float32 rounding); everything a plain layer offers still works (state_dict, load_state_dict, copies,
pickling, moves, autograd, tied weights, unpacking); refusals say why and change nothing.  Toy
layers and tiny random models; the embedded models are in tests/models/test_packed_wide.py."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

import probe_mtp
from probe_mtp import mkl_gemm
from probe_mtp.wide import (KERNELS, PackWideError, WideConv1D, WideLinear, default_kernel, pack_wide, unpack_wide,
                            wide_kernel)

@pytest.fixture(params=list(KERNELS))
def kernel(request) -> str:
    """Each packing this torch carries (MKL's, oneDNN's)."""
    if not KERNELS[request.param].available():
        pytest.skip(f"this torch carries no {KERNELS[request.param].by} to pack with")
    return request.param


def toy() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 48, bias=False))


def tiny(config: str = "LlamaConfig", **kwargs):
    torch.manual_seed(0)
    std = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=128, max_position_embeddings=128, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(getattr(transformers, config)(**{**std, **kwargs})).eval()


@torch.no_grad()
def test_one_row_is_the_stock_product_and_wider_ones_agree_to_rounding(kernel):
    stock = toy()
    packed = pack_wide(copy.deepcopy(stock), kernel)
    assert [type(m) for m in packed] == [WideLinear, nn.GELU, WideLinear]
    for shape in ((1, 64), (1, 1, 64)):
        x = torch.randn(shape)
        assert torch.equal(packed(x), stock(x))
    for shape in ((2, 64), (7, 64), (3, 5, 64), (300, 64)):
        x = torch.randn(shape)
        out = packed(x)
        assert out.shape == stock(x).shape and torch.allclose(out, stock(x), rtol=1e-5, atol=1e-5)
    assert packed[0]._wide_pack is not None  # packed at pack_wide, not at the first wide product
    assert wide_kernel(packed) == kernel


@torch.no_grad()
def test_state_dict_keys_and_weights_stay_and_a_loaded_weight_is_packed_again(kernel):
    stock = toy()
    packed = pack_wide(copy.deepcopy(stock), kernel)
    assert list(packed.state_dict()) == list(stock.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(packed.state_dict().values(), stock.state_dict().values()))
    other = toy()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(2)
    packed.load_state_dict(other.state_dict())
    x = torch.randn(6, 64)
    assert torch.allclose(packed(x), other(x), rtol=1e-5, atol=1e-5)
    packed[2].weight.add_(1.0)  # changed in place: packed again at the next wide product
    h = torch.randn(6, 96)
    assert torch.allclose(packed[2](h), nn.functional.linear(h, packed[2].weight), rtol=1e-5, atol=1e-4)


@torch.no_grad()
def test_copies_and_pickles_pack_again_instead_of_copying_the_packed_bytes(kernel):
    stock = toy()
    packed = pack_wide(copy.deepcopy(stock), kernel)
    twin = copy.deepcopy(packed)
    assert "_wide_pack" not in twin[0].__dict__ and type(twin[0]) is WideLinear and wide_kernel(twin) == kernel
    buffer = io.BytesIO()
    torch.save(packed, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(4, 64)
    for model in (twin, loaded):
        assert torch.allclose(model(x), stock(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(model(x[:1]), stock(x[:1]))


def test_weights_made_under_inference_mode_are_refused_and_packed_models_run_under_it(kernel):
    """Inference tensors keep no version counter, so a packed copy could go stale unseen: such
    weights are refused with the reason; a model packed first runs under inference_mode as usual."""
    with torch.inference_mode():
        made_there = toy()
    with pytest.raises(PackWideError, match="made under torch.inference_mode"):
        pack_wide(made_there, kernel)
    assert type(made_there[0]) is nn.Linear
    stock = toy()
    packed = pack_wide(copy.deepcopy(stock), kernel)
    with torch.inference_mode():
        x = torch.randn(5, 64)
        assert torch.allclose(packed(x), stock(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(packed(x[:1]), stock(x[:1]))


def test_moves_other_dtypes_and_autograd_take_the_stock_product(kernel):
    stock = toy()
    packed = pack_wide(copy.deepcopy(stock), kernel)
    x = torch.randn(4, 64, requires_grad=True)
    mine = x.detach().clone().requires_grad_(True)
    stock(x).square().sum().backward()
    packed(mine).square().sum().backward()  # through the stock product: autograd records it
    assert torch.equal(x.grad, mine.grad)
    with torch.no_grad():
        half = copy.deepcopy(packed).to(torch.bfloat16)
        assert torch.equal(half(x.detach().bfloat16()), copy.deepcopy(stock).to(torch.bfloat16)(x.detach().bfloat16()))


@torch.no_grad()
def test_a_tied_model_stays_tied_and_unpacking_restores_the_stock_classes(kernel):
    model = tiny()
    ids = torch.randint(0, 128, (1, 12))
    before = model(ids).logits
    pack_wide(model, kernel)
    assert model.lm_head.weight is model.get_input_embeddings().weight and type(model.lm_head) is WideLinear
    assert torch.allclose(model(ids).logits, before, rtol=1e-4, atol=1e-5)
    assert probe_mtp.is_packed_wide(model)
    assert f"packed once by {KERNELS[kernel].by} (probe_mtp.pack_wide)" in probe_mtp.describe(model)
    unpack_wide(model)
    assert not probe_mtp.is_packed_wide(model) and type(model.lm_head) is nn.Linear
    assert "_wide_pack" not in model.lm_head.__dict__ and wide_kernel(model) is None
    assert torch.equal(model(ids).logits, before)
    assert probe_mtp.describe(model).startswith("float32, stock kernels")


@torch.no_grad()
def test_gpt2s_conv1d_layers_pack_too(kernel):
    model = tiny("GPT2Config", n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=128)
    stock = copy.deepcopy(model)
    pack_wide(model, kernel)
    convs = [m for m in model.modules() if isinstance(m, Conv1D)]
    assert convs and all(type(m) is WideConv1D for m in convs)
    for mine, theirs in zip(convs, (m for m in stock.modules() if isinstance(m, Conv1D))):
        x_in = torch.randn(5, theirs.weight.shape[0])
        assert torch.allclose(mine(x_in), theirs(x_in), rtol=1e-5, atol=1e-5)
        assert torch.equal(mine(x_in[:1]), theirs(x_in[:1]))


def test_refusals_say_why_and_change_nothing(monkeypatch):
    bf16 = toy().to(torch.bfloat16)
    with pytest.raises(PackWideError, match="float32 weights on the CPU; this model's linear layers hold bfloat16"):
        pack_wide(bf16)
    assert type(bf16[0]) is nn.Linear
    prepared = probe_mtp.optimize(tiny(), torch.float32)
    with pytest.raises(PackWideError, match="prepared by probe_mtp.optimize"):
        pack_wide(prepared)
    with pytest.raises(PackWideError, match="no nn.Linear or Conv1D layers"):
        pack_wide(nn.Sequential(nn.GELU()))
    with pytest.raises(PackWideError, match="kernel must be one of 'mkl', 'onednn', not 'blas'"):
        pack_wide(toy(), "blas")
    if mkl_gemm.available() or KERNELS["onednn"].available():
        twice = pack_wide(toy())
        with pytest.raises(PackWideError, match="packed already"):
            pack_wide(twice)
    monkeypatch.setattr(mkl_gemm, "available", lambda: False)
    plain = toy()
    with pytest.raises(PackWideError, match="this torch carries no MKL"):
        pack_wide(plain, "mkl")
    assert type(plain[0]) is nn.Linear
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.raises(PackWideError, match="built without oneDNN"):
        pack_wide(plain, "onednn")
    with pytest.raises(PackWideError, match="neither MKL's packed float32 product nor oneDNN"):
        pack_wide(plain)
    assert type(plain[0]) is nn.Linear


def test_the_default_kernel_is_mkl_on_intel_and_onednn_elsewhere_each_where_this_torch_carries_it(monkeypatch):
    if not KERNELS["onednn"].available():
        pytest.skip("this torch carries no oneDNN")
    from probe_mtp.kernels import processor_vendor

    assert default_kernel("AuthenticAMD") == default_kernel("") == "onednn"
    if mkl_gemm.available():
        assert default_kernel("GenuineIntel") == "mkl"
        assert wide_kernel(pack_wide(toy())) == ("mkl" if processor_vendor() == "GenuineIntel" else "onednn")
    monkeypatch.setattr(mkl_gemm, "available", lambda: False)
    assert default_kernel("GenuineIntel") == "onednn" and wide_kernel(pack_wide(toy())) == "onednn"


def test_optimize_takes_a_packed_model_as_it_would_the_stock_one(kernel):
    """A packed model prepared by optimize afterwards: its layers become optimize's, each packed copy
    dropped with the layer it belonged to."""
    model = pack_wide(tiny(), kernel)
    probe_mtp.optimize(model, torch.float32)
    assert probe_mtp.is_optimized(model) and not probe_mtp.is_packed_wide(model)


def test_a_packed_model_keeps_its_own_cost_curve(kernel):
    """budget="auto" prices trees from the model's measured curve: a packed model's differs from the
    stock one's (cheaper wide passes), so it is kept under another key."""
    from probe_mtp.cost import curve_key

    model = tiny()
    stock = curve_key(model)
    assert "linear" not in stock
    assert curve_key(pack_wide(model, kernel)) == {**stock, "linear": [KERNELS[kernel].label]}
    assert KERNELS["mkl"].label != KERNELS["onednn"].label
