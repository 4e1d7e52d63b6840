"""Greedy identity on Gemma 3 270M: sliding-window layers (512 tokens), a scaled embedding, a
262k vocabulary.  Includes contexts that cross the window during generation and prompts that are
longer than the window."""

from __future__ import annotations

import pytest
import torch

from probe_mtp import ProbeDecoder
from probe_mtp.prompts import balanced_subset

from oracle import OracleDrafter

pytestmark = pytest.mark.gemma

WINDOW = 512


@pytest.fixture(scope="module")
def gemma_cases(gemma3, specbench):
    """Plain-text prompts (a base model): 2 short ones from different tasks, one that crosses the window
    during generation, one longer than the window."""
    model, tok = gemma3
    assert model.config.sliding_window == WINDOW
    short = [p.turns[0] for p in balanced_subset(specbench, 2) if p.task != "rag"][::4][:2]
    rag = [p.turns[0] for p in specbench if p.task == "rag"]
    lengths = {text: len(tok(text)["input_ids"]) for text in rag[:40]}
    crossing_text = min(rag[:40], key=lambda t: lengths[t])  # the shortest RAG prompt, ~600 tokens
    cases = []
    for text in short:
        cases.append((tok(text, return_tensors="pt")["input_ids"], 40))
    # cut a long prompt to 490 tokens so that 40 new tokens cross the 512 window mid-generation
    long_ids = tok(crossing_text, return_tensors="pt")["input_ids"]
    cases.append((long_ids[:, :490], 40))
    cases.append((long_ids, 24))  # a prompt longer than the window
    return cases


def test_identical_to_generate_on_gemma(gemma3, gemma_cases, greedy):
    model, tok = gemma3
    decoder = ProbeDecoder(model, tok, drafter="esp")
    configs = [dict(num_masks=1, budget=30), dict(num_masks=2, budget=30)]
    crossed = False
    for i, (ids, max_new) in enumerate(gemma_cases):
        ref = greedy(model, ids, max_new, exact=True)
        out = decoder.generate(ids, max_new_tokens=max_new, return_dict_in_generate=True, **configs[i % 2])
        assert torch.equal(out.sequences, ref), f"case {i} (prompt of {ids.shape[1]} tokens)"
        crossed |= ids.shape[1] < WINDOW <= out.sequences.shape[1]
        if ids.shape[1] > WINDOW:
            # also with accepted blocks that straddle the window edge
            cont = ref[0, ids.shape[1]:].tolist()
            blocks = decoder.generate(ids, max_new_tokens=max_new, drafter=OracleDrafter(cont, ids.shape[1]))
            assert torch.equal(blocks, ref)
    assert crossed


def test_block_crossing_the_window_edge(gemma3, gemma_cases, greedy):
    """An oracle drafter accepts blocks of up to 10 tokens right across position 512."""
    model, _ = gemma3
    ids, _ = gemma_cases[-2]  # 490 tokens
    ref = greedy(model, ids, 40, exact=True)
    cont = ref[0, ids.shape[1]:].tolist()
    decoder = ProbeDecoder(model)
    for limit in (23, 40):
        out = decoder.generate(ids, max_new_tokens=limit, drafter=OracleDrafter(cont, ids.shape[1]))
        assert torch.equal(out, ref[:, : ids.shape[1] + limit])
