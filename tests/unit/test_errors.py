"""Bad input gets a clear error naming the argument, raised before any forward pass."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM

import probe_mtp
from probe_mtp import ProbeDecoder
from probe_mtp.kv import UnsupportedModelError
from probe_mtp.loading import ModelNotAvailableError, load_model


def _tiny_llama(**kw):
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=32, vocab_size=32, max_position_embeddings=64,
                         attn_implementation="sdpa", bos_token_id=0, eos_token_id=1, pad_token_id=0, **kw)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def counted():
    """A tiny model that counts its forward passes."""
    model = _tiny_llama()
    calls = {"n": 0}
    model.register_forward_pre_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    return model, calls


IDS = torch.tensor([[3, 4, 5, 6]])

CASES = {
    "empty input": (dict(input_ids=torch.zeros((1, 0), dtype=torch.long)), ValueError, "empty"),
    "1D input_ids": (dict(input_ids=torch.tensor([3, 4, 5])), ValueError, "2D"),
    "float input_ids": (dict(input_ids=IDS.float()), TypeError, "integer"),
    "list input_ids": (dict(input_ids=[[3, 4, 5]]), TypeError, "torch.Tensor"),
    "empty batch": (dict(input_ids=IDS[:0]), ValueError, "no rows"),
    "too long context": (dict(input_ids=torch.full((1, 64), 3)), ValueError, "max_position_embeddings"),
    "negative max_new_tokens": (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
    "num_masks 0": (dict(drafter="esp", num_masks=0), ValueError, "num_masks"),
    "budget too small": (dict(num_masks=2, budget=5), ValueError, "budget"),
    "num_beams": (dict(num_beams=2), ValueError, "num_beams"),
    "num_return_sequences with greedy": (dict(num_return_sequences=2), ValueError, "num_return_sequences"),
    "unknown drafter": (dict(drafter="nope"), ValueError, "drafter"),
    "negative pass_memory": (dict(pass_memory=-0.1), ValueError, "pass_memory"),
    "pass_memory not a number": (dict(pass_memory="5%"), ValueError, "pass_memory"),
    "unknown mask_init": (dict(mask_init="nope"), ValueError, "mask_init"),
    "bad sampling_rule": (dict(sampling_rule="nope", do_sample=True), ValueError, "sampling_rule"),
    "mask shape": (dict(attention_mask=torch.ones((1, 3), dtype=torch.long)), ValueError, "attention_mask"),
    "right padding": (dict(attention_mask=torch.tensor([[1, 1, 1, 0]])), ValueError, "left padding"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_before_any_forward(counted, case):
    model, calls = counted
    kwargs, error, words = CASES[case]
    kwargs = dict(kwargs)
    ids = kwargs.pop("input_ids", IDS)
    kwargs.setdefault("max_new_tokens", 5)
    calls["n"] = 0
    with pytest.raises(error, match=words):
        probe_mtp.generate(model, ids, **kwargs)
    assert calls["n"] == 0


def test_zero_new_tokens_returns_the_input(counted):
    model, calls = counted
    calls["n"] = 0
    out = probe_mtp.generate(model, IDS, max_new_tokens=0)
    assert torch.equal(out, IDS) and calls["n"] == 0


@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention"])
def test_attention_without_tree_masks_is_refused(impl):
    model = _tiny_llama()
    model.config._attn_implementation = impl
    with pytest.raises(UnsupportedModelError, match="sdpa"):
        ProbeDecoder(model)
    with pytest.raises(ValueError, match="sdpa"):
        load_model("smollm2-135m", attn_implementation=impl)


def test_recurrent_model_is_refused():
    config = MambaConfig(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=2)
    model = MambaForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match="(?i)cache|recurrent|attention"):
        ProbeDecoder(model)


def test_missing_model_file_names_the_path(tmp_path):
    with pytest.raises(ModelNotAvailableError, match="not found"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(TypeError, match="dtype"):
        load_model(None, dtype="float32")
