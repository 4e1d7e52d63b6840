"""The embedded models packed for wide passes by ``probe_mtp.pack_wide`` (stock one-row products,
float32 weights packed once by MKL for products of two rows or more; what ``dtype="auto"`` picks
where that is the fastest configuration): probe-mtp's greedy output on the packed model is
token-identical to ``model.generate(do_sample=False)`` on the stock float32 model, on two prompts of
every Spec-Bench task with the default decoder, with every drafter at a fixed budget, for a batch
row for row, and on Gemma 3 past its sliding window; and ``model.generate`` on the packed model
gives the stock model's tokens too.  Its one-token pass gives the stock pass's logits bit for bit.
Packed by oneDNN instead (``kernel="onednn"``): the same on a prompt of every task, a batch and
Gemma 3's texts."""

from __future__ import annotations

import pytest
import torch

import probe_mtp
from probe_mtp import ProbeDecoder
from probe_mtp.prompts import TASKS, balanced_subset
from probe_mtp.report.batches import left_padded
from probe_mtp.wide import WideLinear

from conftest import GEMMA_TEXTS, chat_ids, greedy_cases

NEW = 48
WINDOW = 512


@pytest.fixture(scope="module")
def smol_cases(smollm2, specbench, greedy):
    """Two prompts of each Spec-Bench task with their greedy references on the stock model."""
    out = greedy_cases(*smollm2, balanced_subset(specbench, 2), greedy, NEW)
    assert {task for task, _, _ in out} == set(TASKS) and len(out) == 2 * len(TASKS)
    return out


def test_every_linear_layer_is_packed_and_describe_says_so(smollm2_packed_wide):
    model, _ = smollm2_packed_wide
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(isinstance(m, WideLinear) for m in layers)
    assert probe_mtp.is_packed_wide(model) and not probe_mtp.is_optimized(model)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied
    assert probe_mtp.describe(model).startswith(f"float32, stock one-row products, products of 2+ rows with the "
                                                f"weights of {len(layers)} linear layers packed once by MKL")


@torch.no_grad()
def one_token_logits_agree(base, packed, tok) -> bool:
    """Same cache, one new token: every product is a one-row product, the stock one."""
    from transformers import DynamicCache

    ids = chat_ids(tok, "Name three rivers in Africa.")
    cache, mirror = DynamicCache(config=base.config), DynamicCache(config=base.config)
    base(ids[:, :-1], cache=cache, use_cache=True)
    base(ids[:, :-1], cache=mirror, use_cache=True)
    stock = base(ids[:, -1:], cache=cache, use_cache=True).logits
    return torch.equal(stock, packed(ids[:, -1:], cache=mirror, use_cache=True).logits)


def test_a_one_token_pass_gives_the_stock_logits_bit_for_bit(smollm2, smollm2_packed_wide):
    base, tok = smollm2
    assert one_token_logits_agree(base, smollm2_packed_wide[0], tok)


def test_default_decoder_on_two_prompts_of_every_task(smollm2, smollm2_packed_wide, smol_cases):
    packed, tok = smollm2_packed_wide
    decoder = ProbeDecoder(packed, tok)
    bad = [task for task, ids, ref in smol_cases if not torch.equal(decoder.generate(ids, max_new_tokens=NEW), ref)]
    assert not bad, f"differs from model.generate on the stock float32 model: {bad}"


def test_generate_on_the_packed_model_gives_the_stock_tokens(smollm2_packed_wide, smol_cases):
    packed, _ = smollm2_packed_wide
    bad = [task for task, ids, ref in smol_cases[::2]
           if not torch.equal(packed.generate(ids, do_sample=False, max_new_tokens=NEW), ref)]
    assert not bad, f"the packed model's own generate differs from the stock model's on {bad}"


@pytest.mark.parametrize("knobs,which", [
    (dict(drafter="esp", num_masks=2, budget=60), slice(0, None, 4)),
    (dict(drafter="hybrid", num_masks=0, budget=32), slice(1, None, 4)),
    (dict(drafter="pld", budget=30), slice(2, None, 4)),
    (dict(drafter="lookahead", budget=30), slice(3, None, 4)),
    (dict(drafter="stand", budget=30), slice(0, None, 5)),
], ids=["esp-k2-bc60", "hybrid-k0-bc32", "pld", "lookahead", "stand"])
def test_every_drafter_at_a_fixed_budget(smollm2_packed_wide, smol_cases, knobs, which):
    model, tok = smollm2_packed_wide
    decoder = ProbeDecoder(model, tok)
    bad = [task for task, ids, ref in smol_cases[which]
           if not torch.equal(decoder.generate(ids, max_new_tokens=NEW, **knobs), ref)]
    assert not bad, f"{knobs}: differs from model.generate on the stock float32 model on {bad}"


def test_a_batch_is_row_for_row_generate(smollm2, smollm2_packed_wide, specbench):
    base, tok = smollm2
    packed, _ = smollm2_packed_wide
    texts = [p.turns[0] for p in balanced_subset(specbench, 1)][:3] + ["Say hello."]
    ids, mask = left_padded([chat_ids(tok, t) for t in texts], tok.pad_token_id)
    ref = base.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    assert torch.equal(ProbeDecoder(packed, tok).generate(ids, attention_mask=mask, max_new_tokens=24), ref)


@pytest.mark.gemma
def test_gemma_on_its_texts_and_past_its_sliding_window(gemma3, gemma3_packed_wide, specbench, greedy):
    """Gemma 3's plain-text prompts with the default decoder; then a prompt of 490 tokens whose
    output crosses the 512-token window, with ESP at a fixed budget; references on the stock model."""
    base, tok = gemma3
    packed, _ = gemma3_packed_wide
    decoder = ProbeDecoder(packed, tok)
    for text in GEMMA_TEXTS:
        ids = tok(text, return_tensors="pt")["input_ids"]
        assert torch.equal(decoder.generate(ids, max_new_tokens=32), greedy(base, ids, 32, exact=True)), text
    rag = [p.turns[0] for p in specbench if p.task == "rag"][:40]
    crossing = min(rag, key=lambda t: len(tok(t)["input_ids"]))
    long_ids = tok(crossing, return_tensors="pt")["input_ids"][:, :490]
    ref = greedy(base, long_ids, 32, exact=True)
    assert long_ids.shape[1] < WINDOW <= ref.shape[1]
    assert torch.equal(decoder.generate(long_ids, max_new_tokens=32, drafter="esp", num_masks=2, budget=30), ref)


# ------------------------------------------------------------------------------- oneDNN's packing
def test_onednn_every_linear_layer_packed_and_one_token_pass_bit_for_bit(smollm2, smollm2_packed_onednn):
    base, tok = smollm2
    packed, _ = smollm2_packed_onednn
    layers = [m for m in packed.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(isinstance(m, WideLinear) for m in layers)
    assert "linear layers packed once by oneDNN" in probe_mtp.describe(packed)
    assert one_token_logits_agree(base, packed, tok)


def test_onednn_default_decoder_on_a_prompt_of_every_task_and_a_batch(smollm2, smollm2_packed_onednn, smol_cases):
    base, tok = smollm2
    packed, _ = smollm2_packed_onednn
    decoder = ProbeDecoder(packed, tok)
    bad = [task for task, ids, ref in smol_cases[::2]
           if not torch.equal(decoder.generate(ids, max_new_tokens=NEW), ref)]
    assert not bad, f"differs from model.generate on the stock float32 model: {bad}"
    ids, mask = left_padded([ids for _, ids, _ in smol_cases[1:6:2]] + [chat_ids(tok, "Say hello.")], tok.pad_token_id)
    ref = base.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    assert torch.equal(decoder.generate(ids, attention_mask=mask, max_new_tokens=24), ref)


@pytest.mark.gemma
def test_onednn_gemma_on_its_texts(gemma3, gemma3_packed_onednn, greedy):
    base, tok = gemma3
    decoder = ProbeDecoder(gemma3_packed_onednn[0], tok)
    for text in GEMMA_TEXTS:
        ids = tok(text, return_tensors="pt")["input_ids"]
        assert torch.equal(decoder.generate(ids, max_new_tokens=32), greedy(base, ids, 32, exact=True)), text
