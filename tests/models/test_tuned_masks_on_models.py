"""Self-distilled mask vectors on the real models: the training pass matches decoding, a short run
lowers the loss, the file round-trips with its metadata, vectors of another model are refused, and
decoding with tuned vectors stays lossless."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import probe_mtp
from probe_mtp import ProbeDecoder
from probe_mtp.distill.cli import cmd_tune
from probe_mtp.distill.teacher import TeacherSequence, TrainingPrompt, teacher_sequences
from probe_mtp.distill.train import PrefixCache, TrainSettings, embedding_rms, evaluate, masked_logits, train_masks
from probe_mtp.architectures import attention_format
from probe_mtp.masks import initial_mask_vectors
from probe_mtp.tuned_masks import ModelIdentity, TunedMasks

from conftest import chat_ids

TRAIN_TEXTS = (
    "Translate to German: The train leaves at eight.",
    "Summarize in one sentence: The city opened a new library with a large children's section.",
    "What is the capital of Italy?",
)


# --------------------------------------------------------------------------- on the model


@pytest.fixture(scope="module")
def teachers(smollm2):
    model, tok = smollm2
    prompts = [TrainingPrompt("custom", t) for t in TRAIN_TEXTS]
    return teacher_sequences(model, tok, prompts, max_new_tokens=16, max_context=512)


def test_training_pass_matches_a_plain_forward(smollm2, teachers):
    """The cached, all-owners-at-once pass gives each mask the logits a plain causal forward of
    ``x[0..t] + masks`` gives (what the decoder's pass computes for an accepted node's masks)."""
    model, _ = smollm2
    seq = teachers[0]
    k = 2
    torch.manual_seed(1)
    vectors = 0.05 * torch.randn(k, model.config.hidden_size)
    prefix = PrefixCache(model, seq.ids, int(seq.ids.shape[0]) - 2)
    with torch.no_grad():
        logits, batch = masked_logits(model, vectors, seq, prefix, None, attention_format(model))
        embed = model.get_input_embeddings()
        for q in (0, 1, batch.size - 2, batch.size - 1):
            t = int(batch.owner[q])
            e = torch.cat([embed(seq.ids[: t + 1]), vectors])
            plain = model(inputs_embeds=e[None], position_ids=torch.arange(t + 1 + k)[None]).logits[0, t + 1 + int(batch.slot[q])]
            assert torch.allclose(logits[q], plain, atol=2e-3), q
    assert prefix.cache.get_seq_length() == prefix.past_len  # the prefix is restored after the pass


@pytest.mark.slow
@pytest.mark.gemma
def test_training_pass_matches_a_plain_forward_on_gemma(gemma3):
    """Gemma 3: scaled embeddings and sliding-window layers (the dict attention mask)."""
    model, tok = gemma3
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    full = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)[0]
    seq = TeacherSequence("custom", full, int(ids.shape[1]))
    k = 2
    torch.manual_seed(3)
    vectors = embedding_rms(model.get_input_embeddings()) * torch.randn(k, model.config.hidden_size)
    prefix = PrefixCache(model, seq.ids, int(seq.ids.shape[0]) - 2)
    assert prefix.sliding
    with torch.no_grad():
        logits, batch = masked_logits(model, vectors, seq, prefix, None, attention_format(model))
        embed = model.get_input_embeddings()
        for q in range(batch.size):
            t = int(batch.owner[q])
            e = torch.cat([embed(seq.ids[: t + 1]), vectors])
            plain = model(inputs_embeds=e[None], position_ids=torch.arange(t + 1 + k)[None]).logits[0, t + 1 + int(batch.slot[q])]
            assert torch.allclose(logits[q], plain, atol=5e-3), q


def test_short_tuning_run_lowers_the_loss(smollm2, teachers):
    model, _ = smollm2
    settings = TrainSettings(num_masks=2, steps=9, lr=0.05, mode="relative")
    tuned, history = train_masks(model, teachers, settings)
    assert len(history) == 9 and all(np.isfinite(h["loss"]) for h in history)
    untuned = TunedMasks(torch.zeros_like(tuned.base), torch.zeros_like(tuned.offsets), "relative", tuned.identity, {"ema": 0.1})
    before = evaluate(model, untuned, teachers)
    after = evaluate(model, tuned, teachers)
    assert after["loss"] < before["loss"] - 0.2, (before, after)
    assert not any(p.requires_grad for p in model.parameters())  # the model stayed frozen


def _saved(tmp_path, model, mode="relative", k=2, name="m.safetensors", **identity_changes):
    identity = ModelIdentity.of(model)
    if identity_changes:
        identity = ModelIdentity(**{**identity.__dict__, **identity_changes})
    torch.manual_seed(2)
    h = identity.hidden_size
    tuned = TunedMasks(0.01 * torch.randn(h), 0.01 * torch.randn(k, h), mode, identity, {"steps": 3, "lr": 0.05})
    return tuned, tuned.save(tmp_path / name)


def test_file_round_trip_with_metadata(smollm2, tmp_path):
    model, _ = smollm2
    tuned, path = _saved(tmp_path, model)
    back = TunedMasks.load(path)
    assert torch.equal(back.base, tuned.base) and torch.equal(back.offsets, tuned.offsets)
    assert back.mode == "relative" and back.num_masks == 2 and back.identity == tuned.identity
    assert back.settings["steps"] == 3 and back.settings["probe_mtp_version"] == probe_mtp.__version__
    assert path.stat().st_size < 20_000
    back.check_model(model)
    bogus = tmp_path / "bogus.safetensors"
    bogus.write_bytes(b"not a tensor file")
    with pytest.raises(ValueError, match="not a safetensors"):
        TunedMasks.load(bogus)


def test_vectors_of_another_model_are_refused(smollm2, tmp_path):
    model, tok = smollm2
    ids = chat_ids(tok, "Hi")
    _, other = _saved(tmp_path, model, name="other.safetensors", fingerprint="0123456789abcdef")
    with pytest.raises(ValueError, match="another model"):
        probe_mtp.generate(model, ids, max_new_tokens=3, masks=str(other))
    tuned = TunedMasks(torch.zeros(16), torch.zeros(1, 16), "absolute", ModelIdentity("tiny", 16, 32, "ff"), {})
    small = tuned.save(tmp_path / "small.safetensors")
    with pytest.raises(ValueError, match="hidden size 16"):
        probe_mtp.generate(model, ids, max_new_tokens=3, masks=str(small))
    _, two = _saved(tmp_path, model, k=2, name="two.safetensors")
    with pytest.raises(ValueError, match="num_masks=3"):
        probe_mtp.generate(model, ids, max_new_tokens=3, masks=str(two), num_masks=3, budget=30)
    with pytest.raises(FileNotFoundError):
        probe_mtp.generate(model, ids, max_new_tokens=3, masks=str(tmp_path / "missing.safetensors"))


@pytest.fixture(scope="module")
def greedy_cases(smollm2):
    model, tok = smollm2
    out = []
    for text in ("Name two prime numbers.", "Write a haiku about rain.", "How do I boil an egg?"):
        ids = chat_ids(tok, text)
        out.append((ids, model.generate(ids, do_sample=False, max_new_tokens=24)))
    return out


def test_absolute_vectors_from_a_file_are_lossless(smollm2, tmp_path, greedy_cases):
    model, tok = smollm2
    _, path = _saved(tmp_path, model, mode="absolute", k=2)
    decoder = ProbeDecoder(model, tok, drafter="esp")
    for ids, ref in greedy_cases[:2]:
        out = decoder.generate(ids, max_new_tokens=24, masks=str(path), num_masks=2, budget=30, mask_update=0.0)
        assert torch.equal(out, ref)


def test_bundled_vectors_are_lossless_and_accept_more(smollm2, greedy_cases):
    """The shipped SmolLM2 vectors (masks="bundled", relative mode, EMA on top): identical to
    greedy, and more tokens per pass than the untuned prompt-mean vectors on the same prompts."""
    model, tok = smollm2
    decoder = ProbeDecoder(model, tok, drafter="esp")
    tuned_steps = plain_steps = tuned_tokens = plain_tokens = 0
    for (ids, ref), k in zip(greedy_cases, (1, 2, 1)):
        out = decoder.generate(ids, max_new_tokens=24, masks="bundled", num_masks=k, budget=30,
                               return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        plain = decoder.generate(ids, max_new_tokens=24, masks="prompt_mean", num_masks=k, budget=30,
                                 return_dict_in_generate=True)
        tuned_steps += len(out.stats.accepted_lengths)
        tuned_tokens += sum(out.stats.accepted_lengths)
        plain_steps += len(plain.stats.accepted_lengths)
        plain_tokens += sum(plain.stats.accepted_lengths)
    assert tuned_tokens / tuned_steps > plain_tokens / plain_steps


def test_tuned_vectors_are_what_the_decoder_feeds(smollm2, tmp_path):
    model, tok = smollm2
    tuned, _ = _saved(tmp_path, model, mode="relative", k=2)
    embed = model.get_input_embeddings()
    ids = chat_ids(tok, "Hello there")[0]
    m = tuned.mask_vectors(embed, ids, 2, 0.1)
    plain = initial_mask_vectors("prompt_mean", embed, ids, 2, 0.1)
    assert torch.allclose(m.vectors, plain.vectors + tuned.slot_vectors(2), atol=1e-6)
    absolute = TunedMasks(tuned.base, tuned.offsets, "absolute", tuned.identity).mask_vectors(embed, ids, 1, 0.0)
    assert torch.allclose(absolute.vectors, tuned.slot_vectors(1))


def test_tune_masks_command(smollm2, tmp_path, capsys):
    """The CLI end to end on two text prompts: the safetensors file, the loss curve (CSV + PNG)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(TRAIN_TEXTS[:2]) + "\n")
    out = tmp_path / "tuned"
    from probe_mtp.cli import build_parser

    args = build_parser().parse_args(["tune-masks", "--prompts", str(prompts), "--max-new-tokens", "8", "--steps", "3",
                                      "--out", str(out), "--no-progress"])
    assert cmd_tune(args, loaded=smollm2) == 0
    tuned = TunedMasks.load(out / "masks.safetensors")
    tuned.check_model(smollm2[0])
    assert tuned.settings["steps"] == 3 and tuned.settings["training_prompts"] == 2
    rows = (out / "loss_curve.csv").read_text().strip().splitlines()
    assert rows[0].startswith("step,") and len(rows) == 1 + 3
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "teacher.json").read_text())["sequences"]
    assert "loss" in capsys.readouterr().err
