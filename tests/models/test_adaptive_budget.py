"""The lean step and the adaptive budget on the real models: still token-identical to
``model.generate``, whatever the cost curve makes the policy choose."""

from __future__ import annotations

import pytest
import torch

from probe_mtp import ProbeConfig, ProbeDecoder
from probe_mtp.cost import CostCurve
from probe_mtp.head import SplitHead

from conftest import chat_ids, task_prompts

CPU_CURVE = {1: 57, 2: 91, 4: 80, 8: 78, 16: 90, 32: 117, 64: 174}  # a 2-core CPU's measured SmolLM2 curve (ms)
FLAT_CURVE = {1: 10.0, 64: 10.5}  # GPU-like: width is free, trees always pay
# the CPU table with timings of the output layer alone that make 16 rows cheaper than 2-15
HEAD_CURVE = CostCurve(tuple(CPU_CURVE), tuple(CPU_CURVE.values()), head_rows=(1, 16, 32, 64), head_seconds=(5.0, 4.0, 8.0, 16.0))


@pytest.fixture(scope="module")
def smol_cases(smollm2, specbench):
    _, tok = smollm2
    # three kinds of text: copying (summarization), free (mt_bench), reasoning (math)
    wanted = ("summarization", "mt_bench", "math_reasoning")
    return [chat_ids(tok, p.turns[0]) for p in task_prompts(specbench, 1) if p.task in wanted]


@pytest.mark.parametrize(
    "knobs",
    [
        dict(drafter="esp", budget="auto", cost_curve=CPU_CURVE),
        dict(drafter="esp", budget="auto", num_masks=2, cost_curve=FLAT_CURVE),
        dict(drafter="pld", budget="auto", cost_curve=CPU_CURVE),
        dict(drafter="stand", budget="auto", cost_curve=FLAT_CURVE, max_budget=24),
        dict(drafter="hybrid", budget="auto", cost_curve=FLAT_CURVE, pass_memory=0.004),
        dict(drafter="esp", budget="auto", num_masks=2, cost_curve=HEAD_CURVE),
    ],
    ids=["esp-cpu", "esp-k2-flat", "pld-cpu", "stand-flat", "hybrid-flat-memory-capped", "esp-k2-padded-head"],
)
def test_adaptive_budget_is_lossless(smollm2, smol_cases, greedy, knobs):
    model, tok = smollm2
    decoder = ProbeDecoder(model, tok)
    assert decoder.split_head.usable
    head_rows = []  # rows the output layer ran on, in the decoder's passes
    sizes = set()
    for ids in smol_cases:
        ref = greedy(model, ids, 32)
        hook = model.get_output_embeddings().register_forward_hook(lambda _m, args, _o: head_rows.append(args[0].shape[-2]))
        try:
            out = decoder.generate(ids, max_new_tokens=32, return_dict_in_generate=True, **knobs)
        finally:
            hook.remove()
        assert torch.equal(out.sequences, ref)
        assert max(out.stats.inputs_per_pass) <= decoder.widest_pass(ProbeConfig(**knobs)) <= knobs.get("max_budget", 64)
        sizes |= set(out.stats.inputs_per_pass)
    if knobs["cost_curve"] is HEAD_CURVE:  # the output layer only ever runs at measured row counts
        # (and the prefill's model forward, once per prompt, on the last position and its 2 masks)
        assert set(head_rows) <= {16, 32, 64, 3} and head_rows.count(3) == len(smol_cases) and 16 in head_rows
    if "pass_memory" in knobs:  # 0.4% of SmolLM2's 538 MB of weights: 10 rows of 49152 float32 logits
        assert decoder.widest_pass(ProbeConfig(**knobs)) == 10 and max(sizes) <= 10
    elif knobs["cost_curve"] in (CPU_CURVE, HEAD_CURVE):
        assert not sizes & {2, 3}  # the slow sizes of a CPU are never chosen
    else:
        assert max(sizes) > 8  # on a flat curve trees grow


def test_auto_is_the_default_and_measures_its_curve_once(smollm2, smol_cases, greedy, tmp_path, monkeypatch):
    model, tok = smollm2
    monkeypatch.setenv("PROBE_MTP_CACHE_DIR", str(tmp_path))
    decoder = ProbeDecoder(model, tok)
    assert decoder.config.budget == "auto"
    ids = smol_cases[0]
    ref = greedy(model, ids, 24)
    out = decoder.generate(ids, max_new_tokens=24, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert isinstance(decoder.cost_curve(decoder.config), CostCurve)
    assert len(list(tmp_path.glob("cost-curve-*.json"))) == 1
    curve = decoder.cost_curve(decoder.config)  # with the split head, the output layer is timed alone too
    assert curve.head_rows is not None and len(curve.head_seconds) == len(curve.head_rows)
    padding = curve.head_padding(decoder.widest_pass(decoder.config))
    assert all(m <= padding[m] and (padding[m] == m or padding[m] in curve.head_rows) for m in range(1, padding.shape[0]))
    assert 0.0 <= out.stats.overhead_fraction < 1.0 and out.stats.forward_seconds > 0


@pytest.mark.gemma
def test_adaptive_and_split_head_on_gemma(gemma3, specbench):
    model, tok = gemma3
    assert SplitHead(model).usable
    decoder = ProbeDecoder(model, tok)
    prompts = [p.turns[0] for p in task_prompts(specbench, 1)][:2]
    # 5% of Gemma's 1072 MB of fp32 weights holds 51 logits rows of its 262144-token vocabulary
    assert decoder.widest_pass(decoder.config) == 51
    for text, curve, drafter in zip(prompts, [CPU_CURVE, FLAT_CURVE], ["esp", "hybrid"]):
        ids = tok(text, return_tensors="pt")["input_ids"]
        ref = model.generate(ids, do_sample=False, max_new_tokens=32)
        out = decoder.generate(ids, max_new_tokens=32, budget="auto", cost_curve=curve, drafter=drafter,
                               return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert max(out.stats.inputs_per_pass) <= 51
