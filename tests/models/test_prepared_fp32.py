"""Exact decoding on the embedded models prepared for float32 by ``probe_mtp.optimize(model,
torch.float32)`` (what ``dtype="auto"`` picks where packed float32 is the fastest exact
configuration), the lean counterpart of test_prepared_bf16.py: greedy probe-mtp output is
token-identical to ``model.generate(do_sample=False)`` on the same prepared model with the default
decoder on prompts of every Spec-Bench task, every drafter at a fixed budget, a batch row for row,
and Gemma 3 past its sliding window.  Last, ``dtype="auto"``'s own path on SmolLM2: the model it
gives is identical to ``model.generate`` on itself."""

from __future__ import annotations

import copy

import pytest
import torch

import probe_mtp
from probe_mtp import ProbeDecoder
from probe_mtp.choice import CONFIGURATIONS, Loader, bf16_copy, load_fastest
from probe_mtp.optimize import AUTO_ATTRIBUTE
from probe_mtp.precision import exactness_warning
from probe_mtp.prompts import TASKS, balanced_subset
from probe_mtp.report.batches import left_padded

from conftest import chat_ids
from oracle import OracleDrafter

NEW = 48
WINDOW = 512


@pytest.fixture(scope="module")
def smol_cases(smollm2_fp32_prepared, specbench, greedy):
    """One prompt of each Spec-Bench task with its greedy reference on the prepared model."""
    model, tok = smollm2_fp32_prepared
    out = []
    for prompt in balanced_subset(specbench, 1):
        ids = chat_ids(tok, prompt.turns[0])
        out.append((prompt.task, ids, greedy(model, ids, NEW)))
    assert {task for task, _, _ in out} == set(TASKS)
    return out


def test_prepared_float32_is_packed_and_exact(smollm2_fp32_prepared):
    model, _ = smollm2_fp32_prepared
    assert probe_mtp.is_optimized(model) and model.dtype == torch.float32
    assert probe_mtp.describe(model).startswith("float32, on cpu (")
    assert exactness_warning(model) is None


def test_default_decoder_on_every_task(smollm2_fp32_prepared, smol_cases):
    model, _ = smollm2_fp32_prepared
    bad = [task for task, ids, ref in smol_cases
           if not torch.equal(probe_mtp.generate(model, ids, max_new_tokens=NEW), ref)]
    assert not bad, f"differs from model.generate on the prepared float32 model: {bad}"


@pytest.mark.parametrize("knobs,which", [
    (dict(drafter="esp", num_masks=2, budget=60), slice(0, None, 3)),
    (dict(drafter="hybrid", num_masks=0, budget=32), slice(1, None, 3)),
    (dict(drafter="pld", budget=30), slice(2, None, 3)),
    (dict(drafter="lookahead", budget=30), slice(0, None, 4)),
    (dict(drafter="stand", budget=30), slice(1, None, 4)),
    (dict(drafter="ar"), slice(3, None, 4)),
], ids=["esp-k2-bc60", "hybrid-k0-bc32", "pld", "lookahead", "stand", "ar"])
def test_every_drafter_at_a_fixed_budget(smollm2_fp32_prepared, smol_cases, knobs, which):
    model, tok = smollm2_fp32_prepared
    decoder = ProbeDecoder(model, tok)
    bad = [task for task, ids, ref in smol_cases[which]
           if not torch.equal(decoder.generate(ids, max_new_tokens=NEW, **knobs), ref)]
    assert not bad, f"{knobs}: differs from model.generate on the prepared float32 model on {bad}"


def test_smollm2_batch_is_row_for_row_generate(smollm2_fp32_prepared, specbench):
    model, tok = smollm2_fp32_prepared
    texts = [p.turns[0] for p in balanced_subset(specbench, 1)][:2] + ["Say hello."]
    ids, mask = left_padded([chat_ids(tok, t) for t in texts], tok.pad_token_id)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    assert torch.equal(ProbeDecoder(model, tok).generate(ids, attention_mask=mask, max_new_tokens=24), ref)


@pytest.mark.gemma
def test_gemma_past_its_sliding_window(gemma3_fp32_prepared, specbench, greedy):
    """A short prompt, and a prompt of 490 tokens whose output crosses the 512-token window, with
    the default decoder and ESP; then blocks accepted right across the window's edge."""
    model, tok = gemma3_fp32_prepared
    rag = [p.turns[0] for p in specbench if p.task == "rag"][:40]
    crossing = min(rag, key=lambda t: len(tok(t)["input_ids"]))
    long_ids = tok(crossing, return_tensors="pt")["input_ids"][:, :490]
    short = next(p.turns[0] for p in balanced_subset(specbench, 1) if p.task == "qa")
    decoder = ProbeDecoder(model, tok)
    for ids, knobs in ((tok(short, return_tensors="pt")["input_ids"], {}), (long_ids, dict(drafter="esp", num_masks=2,
                                                                                            budget=30))):
        ref = greedy(model, ids, 32, exact=True)
        assert torch.equal(decoder.generate(ids, max_new_tokens=32, **knobs), ref), knobs
    assert long_ids.shape[1] < WINDOW <= ref.shape[1]
    blocks = decoder.generate(long_ids, max_new_tokens=32, drafter=OracleDrafter(ref[0, 490:].tolist(), 490))
    assert torch.equal(blocks, ref)


def test_dtype_auto_gives_a_model_identical_to_its_own_generate(smollm2, tmp_path):
    """dtype auto's path on SmolLM2 (configurations made from the session's float32 model rather
    than read from disk; the choice kept in tmp_path, not in the user's cache): whichever it picks
    here, probe-mtp on it is token-identical to model.generate on it."""
    base, tok = smollm2

    def load(dtype):
        return (bf16_copy(base) if dtype == torch.bfloat16 else copy.deepcopy(base)), tok

    # measured once (watch=None): beside the suite's other process every try would be contended
    model, _ = load_fastest(Loader(load, {"source": "session smollm2"}, base.device, directory=tmp_path, watch=None))
    name = model.__dict__[AUTO_ATTRIBUTE].name
    assert (model.dtype, probe_mtp.is_optimized(model)) == CONFIGURATIONS[name]
    for text in ("Name three rivers in Africa.", "Write a haiku about rain."):
        ids = chat_ids(tok, text)
        assert torch.equal(probe_mtp.generate(model, ids, max_new_tokens=32),
                           model.generate(ids, do_sample=False, max_new_tokens=32))
