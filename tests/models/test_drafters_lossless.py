"""The baseline drafters (pld, lookahead, stand, ar): losslessness through the shared tree verifier
on the embedded models."""

from __future__ import annotations

import pytest
import torch

import probe_mtp
from probe_mtp.decoder import ProbeDecoder

from conftest import GEMMA_TEXTS, SMOL_NEW_TOKENS

BASELINES = ("pld", "lookahead", "stand", "ar")


# ---------------------------------------------------------------------- lossless on SmolLM2
@pytest.fixture(scope="module")
def smol_decoder(smollm2):
    model, tokenizer = smollm2
    return ProbeDecoder(model, tokenizer)


@pytest.mark.parametrize(
    "drafter,budget,prompts",
    [
        # three tasks each (of mt_bench, translation, summarization, qa, math_reasoning, rag), every
        # task by two drafters: prompt lookup where copying pays, the others spread over the rest
        ("pld", 30, (1, 2, 5)),
        ("lookahead", 30, (0, 3, 4)),
        ("stand", 30, (0, 2, 4)),
        ("ar", 30, (1, 3, 5)),
        # the small budget on two prompts each (`make test-all`)
        pytest.param("pld", 10, (2, 5), marks=pytest.mark.slow),  # summarization, rag: where copying pays
        pytest.param("lookahead", 10, (0, 4), marks=pytest.mark.slow),
        pytest.param("stand", 10, (1, 3), marks=pytest.mark.slow),
    ],
)
def test_lossless_on_smollm2(smollm2, smol_refs, smol_decoder, drafter, budget, prompts):
    model, _ = smollm2
    for n, i in enumerate(prompts):
        kwargs = dict(max_new_tokens=SMOL_NEW_TOKENS, drafter=drafter, budget=budget, return_dict_in_generate=True)
        if n == 0:  # the public entry point once per case, the reusable decoder for the rest
            out = probe_mtp.generate(model, smol_refs.ids[i], **kwargs)
        else:
            out = smol_decoder.generate(smol_refs.ids[i], **kwargs)
        assert torch.equal(out.sequences, smol_refs(i)), f"{drafter} budget={budget} differs on a {smol_refs.tasks[i]} prompt"
        stats = out.stats
        assert stats.method == drafter and stats.num_masks == 0
        if drafter == "ar":
            assert set(stats.accepted_lengths) <= {1}


# ---------------------------------------------------------------------- lossless on Gemma 3

@pytest.mark.gemma
def test_lossless_on_gemma3(gemma3, greedy):
    model, tokenizer = gemma3
    decoder = ProbeDecoder(model, tokenizer)
    # two of the three texts each (copying, code, prose), every text by at least two drafters
    texts = {"pld": (0, 1), "lookahead": (1, 2), "stand": (0, 2), "ar": (0, 1)}
    for drafter in BASELINES:
        for j in texts[drafter]:
            ids = tokenizer(GEMMA_TEXTS[j], return_tensors="pt")["input_ids"]
            out = decoder.generate(ids, max_new_tokens=32, drafter=drafter, budget=30)
            assert torch.equal(out, greedy(model, ids, 32, exact=True)), f"{drafter} differs from greedy on Gemma 3 prompt {j}"
