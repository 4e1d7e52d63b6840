"""The model plugin's placeholder handling: armed placeholder positions (and only those) get the
mask vectors, each armed vector is used once; served through vLLM with probe masks on, the outputs
stay plain vLLM's and the masks' predictions reach the proposer."""

from __future__ import annotations

import pytest
import torch

from probe_mtp.vllm.plugin import ARCHITECTURES, MaskSlots, architecture_for


def test_only_armed_placeholders_are_taken_once():
    slots = MaskSlots((98, 99), hidden_size=4)
    ids = torch.tensor([5, 98, 99, 7, 98, 99, 98])
    positions = torch.tensor([10, 11, 12, 3, 4, 5, 20])
    a, b, c = torch.ones(4), 2 * torch.ones(4), 3 * torch.ones(4)
    slots.arm(11, 0, a)
    slots.arm(12, 1, b)
    slots.arm(4, 0, c)
    rows, vectors, where = slots.take(ids, positions)
    # rows 5 (99 at position 5) and 6 (98 at position 20) are placeholder ids nobody armed: left alone
    assert rows.tolist() == [1, 2, 4] and where == [(11, 0), (12, 1), (4, 0)]
    assert all(torch.equal(v, w) for v, w in zip(vectors, (a, b, c)))
    rows, _, _ = slots.take(ids, positions)  # used once
    assert rows.numel() == 0


def test_same_position_in_two_rows_is_taken_in_row_order():
    slots = MaskSlots((98,), hidden_size=2)
    first, second = torch.zeros(2), torch.ones(2)
    slots.arm(7, 0, first)
    slots.arm(7, 0, second)
    rows, vectors, _ = slots.take(torch.tensor([98, 1, 98]), torch.tensor([7, 8, 7]))
    assert rows.tolist() == [0, 2] and torch.equal(vectors[0], first) and torch.equal(vectors[1], second)


def test_bad_slots_and_vectors_are_clear_errors():
    slots = MaskSlots((98, 99), hidden_size=4)
    with pytest.raises(ValueError, match="slot 2 out of range"):
        slots.arm(0, 2, torch.zeros(4))
    with pytest.raises(ValueError, match=r"must be \[4\]"):
        slots.arm(0, 0, torch.zeros(3))
    with pytest.raises(ValueError, match="must differ"):
        MaskSlots((5, 5), hidden_size=4)
    assert architecture_for("LlamaForCausalLM") == "ProbeMtpLlamaForCausalLM" and len(ARCHITECTURES) == 2
    with pytest.raises(ValueError, match="no class for 'MistralForCausalLM'"):
        architecture_for("MistralForCausalLM")


def masks_seen(model):
    """Run in vLLM's worker (LLM.apply_model): passes that carried masks, and the placeholders."""
    return model.probe_masks.passes_with_masks, model.probe_masks.placeholder_ids


def test_masks_through_vllm_keep_plain_vllms_tokens(plain_llm, masked_llm, prompt_ids):
    from engine_helpers import greedy

    assert greedy(masked_llm, prompt_ids[:4]) == greedy(plain_llm, prompt_ids[:4])
    (passes, placeholders), = masked_llm.apply_model(masks_seen)
    assert passes > 10 and len(placeholders) == 2


def test_an_engine_with_masks_is_served_through_the_plugins_class(tmp_path):
    """engine(proposer={"num_masks": k}) names the plugin's class for the folder's architecture
    (what the bench's --vllm-proposer '{"num_masks": 2}' relies on); a folder that names none is a
    clear error."""
    import json

    from probe_mtp.vllm.engine import plugin_architecture

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"]}))
    assert plugin_architecture(str(tmp_path)) == "ProbeMtpGemma3ForCausalLM"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="no class for 'GPT2LMHeadModel'"):
        plugin_architecture(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="names no architecture"):
        plugin_architecture(str(tmp_path))
