"""``probe_mtp.precision.exactness_warning``: which models can give other tokens than ``model.generate``
at near-ties (reduced precision with stock kernels, float32 with TF32 matmuls on CUDA) and which
cannot (float32 with IEEE products, a model prepared by ``probe_mtp.optimize``).  CUDA models are
stood in for by an object with a CUDA device: the function reads settings only."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import probe_mtp
from probe_mtp.precision import TF32_OFF, exactness_warning, tf32_matmuls


@pytest.fixture(scope="module")
def tiny():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=64, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.fixture
def tf32():
    """TF32 matmuls on for the test, the setting restored afterwards."""
    before = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.set_float32_matmul_precision(before)


def on_cuda(dtype):
    """What exactness_warning reads of a model loaded on a GPU."""
    return SimpleNamespace(dtype=dtype, device=torch.device("cuda", 0), config=SimpleNamespace())


def test_float32_on_the_cpu_is_exact(tiny):
    assert exactness_warning(tiny) is None


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_reduced_precision_with_stock_kernels_is_told_how_to_stay_exact(tiny, dtype, name):
    message = exactness_warning(copy.deepcopy(tiny).to(dtype))
    assert message is not None
    assert f"computes in {name} on cpu" in message and "near-ties" in message and "model.generate" in message
    assert "float32" in message and "probe_mtp.optimize(model)" in message
    assert "TF32" not in message  # a CPU has no TF32 to turn off


def test_a_prepared_model_is_exact(tiny):
    model = probe_mtp.optimize(copy.deepcopy(tiny), require_matrix_units=False)
    assert exactness_warning(model) is None
    model.set_attn_implementation("sdpa")  # no longer row-invariant: told again
    assert "bfloat16" in exactness_warning(model)


@pytest.mark.parametrize("setting", ["medium", "fp32_precision"])
def test_float32_on_a_cpu_with_bf16_units_is_warned_of_when_onednn_may_multiply_it_in_bf16(tiny, monkeypatch, setting):
    """torch.set_float32_matmul_precision("medium") lets oneDNN multiply float32 in bf16 on a CPU
    with bf16 matrix units (measured on AMX: a stock float32 product off by 0.2 instead of 1e-5);
    without such units it changes nothing, so nothing is said."""
    from probe_mtp import kernels

    with_units = kernels.Processor("Test CPU", frozenset({"amx_bf16"}), True)
    monkeypatch.setattr(kernels, "processor", lambda: with_units)
    before = torch.backends.mkldnn.matmul.fp32_precision
    try:
        if setting == "medium":
            torch.set_float32_matmul_precision("medium")
        else:
            torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        message = exactness_warning(tiny)
        assert message is not None and "may run in bf16 inside oneDNN" in message
        assert "torch.set_float32_matmul_precision('highest')" in message and "near-ties" in message
        assert not tf32_matmuls() or setting == "medium"  # the mixed switches do not make the CUDA query raise
        monkeypatch.setattr(kernels, "processor", lambda: kernels.Processor("Old CPU", frozenset(), False))
        assert exactness_warning(tiny) is None
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before
        torch.backends.cuda.matmul.fp32_precision = "none"
        torch.set_float32_matmul_precision("highest")
    assert exactness_warning(tiny) is None


def test_cuda_reduced_precision_names_the_tf32_switches():
    message = exactness_warning(on_cuda(torch.bfloat16))
    assert "bfloat16 on cuda:0" in message and TF32_OFF in message and "probe_mtp.optimize(model)" in message


def test_float32_on_cuda_is_exact_only_with_tf32_off(tf32):
    assert tf32_matmuls()
    message = exactness_warning(on_cuda(torch.float32))
    assert "float32 on cuda:0 with TF32 matmuls enabled" in message and TF32_OFF in message and "near-ties" in message
    torch.backends.cuda.matmul.allow_tf32 = False
    assert not tf32_matmuls() and exactness_warning(on_cuda(torch.float32)) is None
    torch.set_float32_matmul_precision("medium")  # bf16 inside float32 products: reduced as well
    assert tf32_matmuls() and exactness_warning(on_cuda(torch.float32)) is not None
