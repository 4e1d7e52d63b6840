"""The cost curve (probe_mtp.cost): interpolation and the small-size trap, the output layer's row
padding, the context line, and measurement on tiny random-weight models at a context beyond the
sliding window (the disk cache on the real model is in tests/models/test_cost_on_smollm2.py)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig
from transformers import Gemma3ForCausalLM, LlamaForCausalLM

from probe_mtp.cost import CostCurve, measure_cost_curve, measured_busy
from probe_mtp.head import SplitHead

# the shape of a 2-core CPU's curve for SmolLM2 (ms): 2 inputs cost more than 4
CPU_CURVE = CostCurve.from_mapping({1: 57, 2: 91, 4: 80, 8: 78, 16: 90, 32: 117, 64: 174})


def test_cost_curve_interpolates_and_flags_the_small_size_trap():
    c = CPU_CURVE
    assert c.cost(1) == 57 and c.cost(12) == pytest.approx(84.0)
    assert c.cost(128) == pytest.approx(174 + (174 - 117) / 32 * 64)
    assert not c.is_efficient(2) and not c.is_efficient(3) and c.is_efficient(1)
    assert c.is_efficient(4) and c.is_efficient(6)  # within 5% of the cheaper 8
    assert c.is_efficient(8) and c.is_efficient(64)
    assert c.speedup_bound(2.0, 32) == pytest.approx(2.0 * 57 / 117)
    assert CostCurve.from_dict(json.loads(json.dumps(c.as_dict()))) == c
    with pytest.raises(ValueError):
        CostCurve((2, 4), (1.0, 2.0))
    with pytest.raises(ValueError):
        CostCurve((1, 4), (1.0, -2.0))


def test_kernels_held_back_by_the_environment_keep_their_own_curve(monkeypatch):
    from probe_mtp.cost import curve_key
    from probe_mtp.kernels import KERNEL_ENVIRONMENT

    for name in KERNEL_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    plain = curve_key(model)
    assert "kernel_environment" not in plain  # the keys (and files) of unrestricted machines as before
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert curve_key(model)["kernel_environment"] == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_a_kept_curve_slower_than_passes_timed_now_was_measured_busy():
    now = CostCurve.from_mapping({1: 50, 8: 70})
    assert not measured_busy(CPU_CURVE, now)  # within 1.5x: the same machine, as quiet
    assert not measured_busy(CostCurve.from_mapping({n: t / 3 for n, t in zip(CPU_CURVE.sizes, CPU_CURVE.seconds)}), now)
    busy = CostCurve.from_mapping({1: 530, 2: 521, 4: 471, 8: 473, 16: 609, 32: 554, 64: 688})  # kept from a loaded machine
    assert measured_busy(busy, now)
    assert measured_busy(CostCurve.from_mapping({1: 57, 8: 200, 64: 300}), now)  # wrong shape at one width suffices


# 128 tokens of context: 8 inputs cost 1.2x one; at 1024 they cost 2x (attention reads the cache)
def test_cost_curve_times_of_the_output_layer_give_its_row_padding():
    curve = CostCurve((1, 8), (1.0, 2.0), head_rows=(1, 2, 4, 16, 32), head_seconds=(1.0, 1.0, 3.0, 2.0, 2.5))
    padding = curve.head_padding(20)
    # 1 and 2 rows stay; 3-16 rows run on 16 (cheaper than 4); 17-20 rows: nothing measured there
    assert padding.tolist() == [0, 1, 2] + [16] * 14 + [17, 18, 19, 20]
    assert curve.head_padding(10).tolist() == [0, 1, 2, 4, 4] + list(range(5, 11))  # capped at 10 rows
    assert CostCurve((1, 8), (1.0, 2.0)).head_padding(5).tolist() == list(range(6))  # no timings: as wanted
    assert CostCurve.from_dict(curve.as_dict()) == curve
    assert "output layer by rows" in str(curve)
    with pytest.raises(ValueError, match="head_rows and head_seconds"):
        CostCurve((1, 8), (1.0, 2.0), head_rows=(1, 2))
    with pytest.raises(ValueError, match="increasing"):
        CostCurve((1, 8), (1.0, 2.0), head_rows=(2, 1), head_seconds=(1.0, 1.0))
    with pytest.raises(ValueError, match="positive"):
        CostCurve((1, 8), (1.0, 2.0), head_rows=(1, 2), head_seconds=(1.0, 0.0))


LONG_CURVE = CostCurve((1, 8, 32), (10.0, 12.0, 20.0), 128, "toy", 1024, (12.0, 24.0, 60.0))


def test_cost_curve_follows_the_context_along_a_line():
    c = LONG_CURVE
    assert c.cost(8) == 12.0 and c.cost(8, 128) == 12.0 and c.cost(8, 1024) == 24.0
    assert c.cost(8, 576) == pytest.approx(18.0)  # halfway
    assert c.cost(8, 1920) == pytest.approx(36.0)  # beyond: along the same line
    assert c.cost(8, 0) == pytest.approx(12.0 - 128 * 12 / 896) and c.cost(32, 0) >= 10.0  # floor: half
    assert c.relative(32, 1024) == pytest.approx(5.0) and c.relative(32, 128) == pytest.approx(2.0)
    assert c.speedup_bound(3.0, 8, 1024) == pytest.approx(1.5)
    assert CPU_CURVE.cost(8, 5000) == CPU_CURVE.cost(8)  # a one-row curve has no context term
    assert CostCurve.from_dict(json.loads(json.dumps(c.as_dict()))) == c
    assert "context 1024" in str(c)
    with pytest.raises(ValueError, match="both"):
        CostCurve((1, 8), (1.0, 2.0), 128, "", 1024, None)
    with pytest.raises(ValueError, match="exceed"):
        CostCurve((1, 8), (1.0, 2.0), 128, "", 64, (1.0, 2.0))
    with pytest.raises(ValueError, match="one time per size"):
        CostCurve((1, 8), (1.0, 2.0), 128, "", 1024, (1.0,))


def _tiny_llama(attn: str):
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=16, max_position_embeddings=256,
                         attn_implementation=attn, bos_token_id=0, eos_token_id=15, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def _tiny_gemma(attn: str):
    torch.manual_seed(0)
    config = Gemma3TextConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=16, intermediate_size=64, vocab_size=16, sliding_window=8,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              max_position_embeddings=256, attn_implementation=attn,
                              bos_token_id=2, eos_token_id=1, pad_token_id=0)
    return Gemma3ForCausalLM(config).eval()


@pytest.mark.parametrize("make", [_tiny_llama, _tiny_gemma], ids=["llama", "gemma3-sliding"])
def test_cost_curve_is_measured_at_a_context_beyond_the_sliding_window(make):
    model = make("sdpa")
    curve = measure_cost_curve(model, sizes=(1, 2, 4), context=16, rounds=1, long_context=64)  # window: 8
    assert curve.long_context == 64 and len(curve.long_seconds) == 3
    assert curve.cost(4, 200) > 0 and curve.head_rows is None
    # with the split head: the output layer timed alone, the passes run with it padded
    head = SplitHead(model)
    assert head.usable
    timed = measure_cost_curve(model, sizes=(1, 2, 4), context=16, rounds=1, long_context=64, head=head, head_rows=(1, 3, 8))
    assert timed.head_rows == (1, 3, 8) and all(s > 0 for s in timed.head_seconds) and timed.cost(4, 200) > 0
    # no room for a long context within the model's positions: one row
    assert measure_cost_curve(model, sizes=(1, 2), context=130, rounds=1, long_context=1024).long_seconds is None


# --------------------------------------------------------------------------- devices


class FakeRuntime:
    """Stands in for ``torch.cuda`` on a machine without a GPU: a device name, a capability and the
    runtime's version."""

    def __init__(self, name: str, capability=(9, 0), version: str | None = "CUDA 12.8"):
        self.name, self.capability, self.version = name, capability, version

    def get_device_name(self, device):
        return self.name

    def get_device_capability(self, device):
        return self.capability


def test_the_accelerator_is_named_by_make_capability_and_runtime():
    from probe_mtp.cost import accelerator_name

    h100 = accelerator_name("cuda:0", FakeRuntime("NVIDIA H100 80GB HBM3"))
    assert h100 == "cuda: NVIDIA H100 80GB HBM3, capability 9.0, CUDA 12.8"
    assert accelerator_name("cuda:0", FakeRuntime("NVIDIA A100-SXM4-40GB", (8, 0))) != h100
    assert accelerator_name("cuda:0", FakeRuntime("NVIDIA H100 80GB HBM3", version="CUDA 13.0")) != h100
    assert accelerator_name("cpu") is None and accelerator_name(torch.device("cpu"), FakeRuntime("x")) is None
    # a runtime that cannot answer (torch built without it, no driver): the device's kind alone
    assert accelerator_name("xpu", object()) == "xpu"
    broken = FakeRuntime("unused")
    broken.get_device_name = lambda device: (_ for _ in ()).throw(RuntimeError("no driver"))
    assert accelerator_name("cuda", broken) == "cuda: capability 9.0, CUDA 12.8"
    # this machine's torch, whatever its build: a name, never an error
    assert accelerator_name("cuda").startswith("cuda") and accelerator_name("mps").startswith("mps")


def test_the_curve_key_names_the_accelerator_off_the_cpu_only(monkeypatch):
    from probe_mtp import cost

    model = _tiny_llama("sdpa")
    key = cost.curve_key(model)
    assert "accelerator" not in key and key["device"] == "cpu" and key["torch"] == torch.__version__
    names = iter(["cuda: NVIDIA H100 80GB HBM3, capability 9.0, CUDA 12.8", "cuda: NVIDIA L4, capability 8.9, CUDA 12.8"])
    monkeypatch.setattr(cost, "accelerator_name", lambda device: next(names))
    h100, l4 = cost.curve_key(model), cost.curve_key(model)
    assert h100["accelerator"] != l4["accelerator"] and h100 != key
    assert len({json.dumps(k, sort_keys=True) for k in (key, h100, l4)}) == 3  # three files


@pytest.mark.parametrize("make", [_tiny_llama, _tiny_gemma], ids=["llama", "gemma3-sliding"])
def test_cost_curve_makes_every_tensor_on_the_models_device(make):
    """Under ``meta_default_device`` a tensor made without an explicit device has no data: the curve
    (its inputs, cache, masks and the output layer's hidden states) is still measured, and sanely."""
    from probe_mtp.device_audit import meta_default_device

    model = make("sdpa")
    head = SplitHead(model)
    with meta_default_device():
        curve = measure_cost_curve(model, sizes=(1, 2, 4), context=16, rounds=1, long_context=64)
        timed = measure_cost_curve(model, sizes=(1, 2), context=16, rounds=1, long_context=None, head=head,
                                   head_rows=(1, 3))
    assert curve.sizes == (1, 2, 4) and curve.long_context == 64
    assert all(0 < s < 5 for s in curve.seconds + curve.long_seconds)  # seconds, not a launch or a hang
    assert timed.head_rows == (1, 3) and all(0 < s < 5 for s in timed.seconds + timed.head_seconds)
