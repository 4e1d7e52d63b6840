"""Self-distilled mask vectors, model-free: the training batch's index arithmetic, the EMA anchors,
relative vectors under the EMA, training prompts from files, the command's errors before loading a
model, and no bundled vectors for another model (training and decoding on the real models are in
tests/models/test_tuned_masks_on_models.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import probe_mtp
from probe_mtp.cli import main
from probe_mtp.distill.batch import IGNORE, default_owners, ema_anchors, owner_batch
from probe_mtp.distill.teacher import training_prompts
from probe_mtp.masks import MaskVectors


# --------------------------------------------------------------------------- index arithmetic


def test_owner_batch_layout():
    ids = np.arange(100, 110)  # L = 10
    owners = default_owners(10, prompt_len=4)
    assert owners.tolist() == [3, 4, 5, 6, 7]
    b = owner_batch(ids, owners, num_masks=2, past_len=8)
    assert b.size == 10
    assert b.owner.tolist() == [3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    assert b.positions.tolist() == [4, 5, 5, 6, 6, 7, 7, 8, 8, 9]
    # mask j of owner t predicts x[t + 1 + j]; past the end: ignored
    assert b.targets.tolist() == [105, 106, 106, 107, 107, 108, 108, 109, 109, IGNORE]
    assert b.past_visible[0].tolist() == [True] * 4 + [False] * 4
    assert b.past_visible[-1].tolist() == [True] * 8
    assert b.block_visible[1].tolist() == [True, True] + [False] * 8  # mask 2 sees mask 1 of its owner
    assert b.block_visible[2].tolist() == [False, False, True] + [False] * 7
    with pytest.raises(ValueError, match="owner"):
        owner_batch(ids, np.array([8]), 1, past_len=8)


def test_ema_anchors_follow_the_decoders_update():
    torch.manual_seed(0)
    e = torch.randn(9, 5, dtype=torch.float64)
    anchors = ema_anchors(e, prompt_len=4, ema=0.1)
    masks = MaskVectors(e[:4].mean(0, keepdim=True), 0.1)
    assert torch.allclose(anchors[3], masks.vectors[0])
    for t in range(4, 9):
        masks.update(e[t : t + 1])
        assert torch.allclose(anchors[t], masks.vectors[0])


def test_relative_vectors_keep_their_offsets_under_the_ema():
    anchor = torch.zeros(2, 3)
    offsets = torch.tensor([[1.0, 0, 0], [0, 1.0, 0]])
    m = MaskVectors(anchor, 0.5, offsets=offsets)
    assert torch.equal(m.vectors, offsets)
    m.update(torch.tensor([[2.0, 2.0, 2.0]]))
    assert torch.allclose(m.vectors, offsets + 1.0)


def test_training_prompts_from_files(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    assert [p.text for p in training_prompts(text)] == ["first prompt", "second prompt"]
    bundled = training_prompts(per_task=2)
    assert [p.task for p in bundled] == ["translation"] * 2 + ["summarization"] * 2 + ["qa"] * 2
    with pytest.raises(ValueError, match="unknown task"):
        training_prompts(tasks=("nope",))
    with pytest.raises(FileNotFoundError):
        training_prompts(tmp_path / "missing.txt")


def test_tune_masks_errors_before_loading(capsys, tmp_path):
    assert main(["tune-masks", "--steps", "0", "--out", str(tmp_path)]) == 2
    assert "steps" in capsys.readouterr().err
    assert main(["tune-masks", "--prompts", str(tmp_path / "none.txt"), "--out", str(tmp_path)]) == 2
    assert "not found" in capsys.readouterr().err


def test_no_bundled_vectors_for_another_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tiny = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                                        intermediate_size=32, vocab_size=32, attn_implementation="sdpa")).eval()
    with pytest.raises(ValueError, match="no bundled tuned mask vectors"):
        probe_mtp.generate(tiny, torch.tensor([[3, 4, 5]]), max_new_tokens=2, masks="bundled")
