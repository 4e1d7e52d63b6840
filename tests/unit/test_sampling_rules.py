"""Lossless sampling end to end on a tiny random Llama: seeded draws of the first tokens through
probe-mtp (each sampling rule) and through ``model.generate`` (temperature 1, top-p 0.9), compared
by a two-sample chi-square test (the rules on real SmolLM2 distributions are in
tests/models/test_sampling.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency
from transformers import LlamaConfig, LlamaForCausalLM

from probe_mtp import ProbeDecoder

ALPHA = 1e-3  # a correct rule fails one of these tests with probability about 0.1%


def _first_tokens(fn, n_draws, n_tokens):
    rows = []
    for seed in range(n_draws):
        rows.append(tuple(fn(seed)[0, -n_tokens:].tolist()))
    return rows


def _two_sample_p(a: list, b: list, min_count: int = 5) -> float:
    keys = sorted(set(a) | set(b))
    ca = np.array([a.count(k) for k in keys])
    cb = np.array([b.count(k) for k in keys])
    big = (ca + cb) >= min_count
    table = np.array([np.append(ca[big], ca[~big].sum()), np.append(cb[big], cb[~big].sum())])
    table = table[:, table.sum(0) > 0]
    return float(chi2_contingency(table).pvalue)


@pytest.fixture(scope="module")
def peaked_tiny_model():
    """A small random Llama with sharpened logits (so that trees get accepted) for thousands of
    cheap end-to-end draws."""
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=12, max_position_embeddings=128,
                         attn_implementation="sdpa", bos_token_id=0, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    return model


TINY_IDS = torch.tensor([[0, 5, 3, 7]])
TINY_SAMPLING = dict(do_sample=True, temperature=1.0, top_p=0.9, max_new_tokens=3)


@pytest.fixture(scope="module")
def plain_tiny_draws(peaked_tiny_model):
    """1500 seeded plain-sampling draws of the tiny model's first three tokens (shared by every
    end-to-end case)."""

    def plain(seed):
        torch.manual_seed(10_000 + seed)
        return peaked_tiny_model.generate(TINY_IDS, **TINY_SAMPLING)

    return _first_tokens(plain, 1500, 3)


@pytest.mark.heavy
@pytest.mark.parametrize("rule,drafter", [("match", "esp"), ("rejection", "esp"), ("match", "hybrid")])
def test_end_to_end_sampling_matches_plain_sampling(peaked_tiny_model, plain_tiny_draws, rule, drafter):
    decoder = ProbeDecoder(peaked_tiny_model, num_masks=2, budget=18, sampling_rule=rule, drafter=drafter)

    def probe(seed):
        return decoder.generate(TINY_IDS, generator=torch.Generator().manual_seed(seed), **TINY_SAMPLING)

    assert _two_sample_p(_first_tokens(probe, 1500, 3), plain_tiny_draws) > ALPHA
