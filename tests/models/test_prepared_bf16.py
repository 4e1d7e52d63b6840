"""Exact bf16 decoding on the embedded models prepared by ``probe_mtp.optimize``: greedy probe-mtp
output is token-identical to ``model.generate(do_sample=False)`` on the same prepared model, for
every drafter and budget, batches included, on prompts of every Spec-Bench task (SmolLM2) and past
Gemma 3's sliding window; the scores of every step are the same bits, so sampling draws from exactly
the distributions plain sampling draws from."""

from __future__ import annotations

import pytest
import torch

import probe_mtp
from probe_mtp import ProbeDecoder
from probe_mtp.prompts import TASKS, balanced_subset
from probe_mtp.report.batches import left_padded

from conftest import chat_ids
from oracle import OracleDrafter

NEW = 48
PER_TASK = 2  # 12 SmolLM2 prompts, every task twice
WINDOW = 512


@pytest.fixture(scope="module")
def smol_cases(smollm2_bf16, specbench, greedy):
    model, tok = smollm2_bf16
    out = []
    for prompt in balanced_subset(specbench, PER_TASK):
        ids = chat_ids(tok, prompt.turns[0])
        out.append((prompt.task, ids, greedy(model, ids, NEW)))
    assert {task for task, _, _ in out} == set(TASKS)
    return out


def _differs(decoder, cases, **knobs) -> list[str]:
    bad = []
    for task, ids, ref in cases:
        out = decoder.generate(ids, max_new_tokens=NEW, **knobs)
        if not torch.equal(out, ref):
            bad.append(task)
    return bad


def test_default_decoder_on_every_task(smollm2_bf16, smol_cases):
    """The default configuration (hybrid, budget auto sized from the prepared model's own cost
    curve), through the public entry point, on 12 prompts of the six tasks."""
    model, tok = smollm2_bf16
    bad = [task for task, ids, ref in smol_cases
           if not torch.equal(probe_mtp.generate(model, ids, max_new_tokens=NEW), ref)]
    assert not bad, f"differs from model.generate on the prepared model: {bad}"


@pytest.mark.parametrize("knobs,which", [
    (dict(drafter="esp", num_masks=1, budget=30), slice(0, None, 2)),
    (dict(drafter="esp", num_masks=2, budget=60), slice(1, None, 2)),
    (dict(drafter="hybrid", num_masks=2, budget="auto"), slice(0, None, 3)),
    (dict(drafter="hybrid", num_masks=0, budget=32), slice(1, None, 3)),
    (dict(drafter="pld", budget=30), slice(2, None, 3)),
    (dict(drafter="lookahead", budget=30), slice(0, None, 4)),
    (dict(drafter="stand", budget=30), slice(1, None, 4)),
    (dict(drafter="ar"), slice(3, None, 4)),
], ids=["esp-k1-bc30", "esp-k2-bc60", "hybrid-k2-auto", "hybrid-k0-bc32", "pld", "lookahead", "stand", "ar"])
def test_every_drafter_and_budget(smollm2_bf16, smol_cases, knobs, which):
    model, tok = smollm2_bf16
    bad = _differs(ProbeDecoder(model, tok), smol_cases[which], **knobs)
    assert not bad, f"{knobs}: differs from model.generate on the prepared model on {bad}"


def test_scores_are_the_same_bits(smollm2_bf16, smol_cases):
    """Every step's scores equal model.generate's bit for bit: sampling draws from the same
    distributions (the sampling rules themselves are tested on fp32 and toy tensors)."""
    model, tok = smollm2_bf16
    for _, ids, _ in smol_cases[:3]:
        ref = model.generate(ids, do_sample=False, max_new_tokens=24, output_scores=True, return_dict_in_generate=True)
        out = probe_mtp.generate(model, ids, max_new_tokens=24, output_scores=True, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref.sequences)
        assert len(out.scores) == len(ref.scores)
        for mine, theirs in zip(out.scores, ref.scores):
            assert torch.equal(mine, theirs)


def test_sampling_follows_the_seeded_first_draw(smollm2_bf16, smol_cases):
    """The first token is drawn from the prefill's distribution, the same as plain sampling's: with
    the same generator seed both draw the same token (the sampling statistics are in test_sampling)."""
    model, tok = smollm2_bf16
    _, ids, _ = smol_cases[0]
    for seed in range(6):
        torch.manual_seed(seed)
        plain = model.generate(ids, do_sample=True, temperature=0.8, top_p=0.9, max_new_tokens=1)
        torch.manual_seed(seed)
        probe = probe_mtp.generate(model, ids, do_sample=True, temperature=0.8, top_p=0.9, max_new_tokens=1)
        assert torch.equal(plain, probe)


def test_smollm2_batch_is_row_for_row_generate(smollm2_bf16, specbench):
    model, tok = smollm2_bf16
    texts = [p.turns[0] for p in balanced_subset(specbench, 1)][:4] + ["Reply with the single word: yes", "Say hello."]
    ids, mask = left_padded([chat_ids(tok, t) for t in texts], tok.pad_token_id)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    out = ProbeDecoder(model, tok).generate(ids, attention_mask=mask, max_new_tokens=40)
    assert torch.equal(out, ref)
    # each row is also what the row gives alone, unpadded
    for r, text in enumerate(texts[:2]):
        alone = model.generate(chat_ids(tok, text), do_sample=False, max_new_tokens=40)[0]
        pad = int((mask[r] == 0).sum())
        assert torch.equal(out[r, pad : pad + alone.shape[0]], alone)


@pytest.fixture(scope="module")
def gemma_cases(gemma3_bf16, specbench):
    model, tok = gemma3_bf16
    rag = [p.turns[0] for p in specbench if p.task == "rag"][:40]
    crossing = min(rag, key=lambda t: len(tok(t)["input_ids"]))  # about 600 tokens
    long_ids = tok(crossing, return_tensors="pt")["input_ids"]
    short = [p.turns[0] for p in balanced_subset(specbench, 1) if p.task in ("qa", "math_reasoning")]
    return [(tok(t, return_tensors="pt")["input_ids"], 40) for t in short] + [(long_ids[:, :490], 40), (long_ids, 24)]


@pytest.mark.gemma
def test_gemma_past_its_sliding_window(gemma3_bf16, gemma_cases, greedy):
    model, tok = gemma3_bf16
    decoder = ProbeDecoder(model, tok)
    crossed = False
    for i, (ids, new) in enumerate(gemma_cases):
        ref = greedy(model, ids, new, exact=True)
        knobs = [{}, dict(drafter="esp", num_masks=2, budget=30)][i % 2]
        assert torch.equal(decoder.generate(ids, max_new_tokens=new, **knobs), ref), f"case {i} {knobs}"
        crossed |= ids.shape[1] < WINDOW <= ref.shape[1]
        if ids.shape[1] >= 490:  # blocks accepted right across the window edge
            cont = ref[0, ids.shape[1]:].tolist()
            blocks = decoder.generate(ids, max_new_tokens=new, drafter=OracleDrafter(cont, ids.shape[1]))
            assert torch.equal(blocks, ref)
    assert crossed


@pytest.mark.gemma
def test_gemma_batch_across_the_window(gemma3_bf16, gemma_cases):
    model, tok = gemma3_bf16
    rows = [gemma_cases[0][0], gemma_cases[2][0][:, :495], gemma_cases[3][0]]
    ids, mask = left_padded(rows, 0)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=32)
    assert torch.equal(probe_mtp.generate(model, ids, attention_mask=mask, max_new_tokens=32), ref)


def test_auto_loads_the_same_bf16_weights_and_a_prepared_model_saves(smollm2, smollm2_bf16, tmp_path):
    """``dtype="auto"`` loads straight in bf16 (no float32 copy held): each weight is the float32
    one rounded as ``.to(torch.bfloat16)`` rounds it, so it is the model the other tests prepare.
    A prepared embedded model saves with ``save_pretrained`` and loads back to the same tokens."""
    from transformers import AutoModelForCausalLM

    from probe_mtp import loading

    fp32, tok = smollm2
    direct, _ = loading.load_model("smollm2-135m", dtype=torch.bfloat16)
    expected = fp32.state_dict()
    assert all(torch.equal(t, expected[k].to(torch.bfloat16)) for k, t in direct.state_dict().items())
    assert getattr(direct, "hf_quantizer", None) is None  # a dense model, not a GGUF-quantized one
    del direct
    model, _ = smollm2_bf16
    model.save_pretrained(tmp_path)
    loaded = probe_mtp.optimize(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval(),
                                require_matrix_units=False)
    ids = chat_ids(tok, "Name three rivers in Africa.")
    assert torch.equal(probe_mtp.generate(loaded, ids, max_new_tokens=24),
                       model.generate(ids, max_new_tokens=24, do_sample=False))
