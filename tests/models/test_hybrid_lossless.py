"""The hybrid drafter: losslessness on the embedded models."""

from __future__ import annotations

import pytest
import torch

import probe_mtp
from probe_mtp.decoder import ProbeDecoder

from conftest import GEMMA_TEXTS, SMOL_NEW_TOKENS


# ---------------------------------------------------------------------- lossless
@pytest.fixture(scope="module")
def smol_decoder(smollm2):
    model, tokenizer = smollm2
    return ProbeDecoder(model, tokenizer)


@pytest.mark.parametrize("num_masks,budget,prompts", [(0, 32, (0, 2, 4)), (1, 16, (1, 3, 5)), (2, "auto", (0, 1, 5))])
def test_hybrid_lossless_on_smollm2(smollm2, smol_refs, smol_decoder, num_masks, budget, prompts):
    """Three Spec-Bench tasks per setting, every task by at least one; the public entry point for
    the first.  The adaptive case runs on a flat (GPU-like) cost curve so that it verifies trees
    with the root's masks."""
    model, _ = smollm2
    kwargs = dict(max_new_tokens=SMOL_NEW_TOKENS, drafter="hybrid", budget=budget, num_masks=num_masks,
                  return_dict_in_generate=True)
    if budget == "auto":
        kwargs["cost_curve"] = {1: 1.0, 64: 1.05}
    for n, i in enumerate(prompts):
        ids = smol_refs.ids[i]
        out = probe_mtp.generate(model, ids, **kwargs) if n == 0 else smol_decoder.generate(ids, **kwargs)
        assert torch.equal(out.sequences, smol_refs(i)), f"k={num_masks} BC={budget} differs on {smol_refs.tasks[i]}"
        assert out.stats.method == "hybrid" and out.stats.num_masks == num_masks


@pytest.mark.gemma
def test_hybrid_lossless_on_gemma3(gemma3, greedy):
    """Gemma 3: scaled embeddings, 262k vocabulary; a copying prompt without masks, code with."""
    model, tokenizer = gemma3
    decoder = ProbeDecoder(model, tokenizer)
    for text, k, budget in zip(GEMMA_TEXTS, (0, 1), (32, 30)):
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        out = decoder.generate(ids, max_new_tokens=32, drafter="hybrid", num_masks=k, budget=budget)
        assert torch.equal(out, greedy(model, ids, 32, exact=True)), f"k={k} differs"
