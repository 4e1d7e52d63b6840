"""bf16 and fp16: decoding runs and stays close to ``model.generate`` in the same dtype.

A tree pass and a one-token pass round differently in reduced precision, so near-ties can break the
other way (as for every tree-verification method); fp32 is the exact mode.  Here the test checks
that reduced precision decodes through every part of the step (masks, split head, padding, adaptive
budget) and that where it leaves ``model.generate``'s tokens, the reference itself stood at a near-tie."""

from __future__ import annotations

import copy

import pytest
import torch

from probe_mtp import ProbeDecoder

from conftest import chat_ids, task_prompts


NEAR_TIE = 0.125  # logits: a tree pass and a one-token pass may break a tie this close either way


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    n = min(a.numel(), b.numel())
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if diff.numel() else None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_reduced_precision_differs_only_at_near_ties(dtype, smollm2, specbench):
    # a cast copy of the session's fp32 model: the same weights as load_model(dtype=...) gives (GGUF
    # dequantizes to fp32, then casts), without parsing the GGUF file again (about 25 s)
    fp32_model, tok = smollm2
    model = copy.deepcopy(fp32_model).to(dtype)
    decoder = ProbeDecoder(model, tok, drafter="esp")
    identical = 0
    for prompt in task_prompts(specbench, 1)[:2]:
        ids = chat_ids(tok, prompt.turns[0])
        ref = model.generate(ids, do_sample=False, max_new_tokens=32)[0, ids.shape[1]:]
        with torch.no_grad():  # the reference's own top-2 gap at every step, from one plain pass
            logits = model(torch.cat([ids[0], ref])[None]).logits[0, ids.shape[1] - 1:].float()
        top2 = logits.topk(2, dim=-1).values
        for knobs in (dict(budget=30), dict(budget="auto", cost_curve={1: 1.0, 64: 1.1})):
            out = decoder.generate(ids, max_new_tokens=32, return_dict_in_generate=True, **knobs)
            assert out.sequences.shape[1] <= ids.shape[1] + 32
            assert torch.equal(out.sequences[:, : ids.shape[1]], ids)
            new = out.sequences[0, ids.shape[1]:]
            assert new.numel() > 0 and int(new.max()) < model.config.vocab_size
            i = _first_difference(new, ref)
            if i is None:
                identical += 1
                continue
            # measured on SmolLM2: every difference starts at an exact tie (gap 0.0) of the reference;
            # a broken reduced-precision path (wrong dtype of masks, logits or cache) differs elsewhere
            gap = float(top2[i, 0] - top2[i, 1])
            assert gap <= NEAR_TIE, f"{dtype}: first difference at new token {i}, where the reference's top-2 gap is {gap:.3f}"
    assert identical >= 1
