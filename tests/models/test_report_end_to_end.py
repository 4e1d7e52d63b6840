"""``probe-mtp report`` end to end on SmolLM2: through the real argument parser on the prepared
bf16 model beside its float32 original (what ``--dtype auto`` measures where the processor has bf16
matrix units: the default configuration first, the generate fp32 baseline with it, then the
equal-budget drafters), in float32 with tuned masks and ConfAdapt, as the installed command, and
the memory measurement of one generation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from probe_mtp.cli import build_parser
from probe_mtp.report import GREEDY, GREEDY_FP32, HF_PLD
from probe_mtp.report.baselines import DEFAULT
from probe_mtp.report.cli import cmd_report

from report_schema import check_schema


# --------------------------------------------------------------------------- end to end


def test_report_end_to_end(smollm2, smollm2_bf16, tmp_path, capsys, monkeypatch):
    """2 prompts, 16 new tokens: the default configuration, esp and the three baselines, through the
    real argument parser, on the prepared model (``--dtype auto``'s model where the processor has
    bf16 matrix units; prepared here on any processor) with the float32 model as its reference."""
    monkeypatch.setenv("COLUMNS", "200")  # wide enough that no label wraps (pytest-xdist workers set 80)
    out = tmp_path / "rep"
    args = build_parser().parse_args(
        ["report", "--tasks", "qa,math_reasoning", "--limit", "1", "--max-new-tokens", "16", "--methods", "esp",
         "--warmup-tokens", "4", "--out", str(out), "--no-progress"]
    )
    assert args.dtype == "auto"
    assert cmd_report(args, loaded=(*smollm2_bf16, smollm2[0])) == 0
    printed = capsys.readouterr().out
    assert printed.index("probe-mtp default configuration") < printed.index("default decoder (warm):") \
        < printed.index("equal block complexity")
    assert "esp BC=30 bundled:smollm2-135m" in printed and "overall" in printed
    assert "x generate fp32" in printed and "bfloat16 prepared; requested auto" in printed
    assert "differ from model.generate" not in printed  # exact: no reduced-precision excuse either
    for name in ("report.json", "records.csv", "summary.md", "default_speedup.png", "tau_per_task.png",
                 "speedup_per_task.png", "accepted_lengths.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    doc = json.loads((out / "report.json").read_text())
    check_schema(doc)
    assert doc["settings"]["warmup_tokens"] == 4 and doc["settings"]["tasks"] == ["qa", "math_reasoning"]
    assert doc["methods"] == [GREEDY, HF_PLD, GREEDY_FP32, DEFAULT, "esp BC=30 bundled:smollm2-135m"]
    assert doc["default"]["budget"] == "auto" and doc["default"]["masks"] == "bundled:smollm2-135m"
    assert doc["default"]["verdict"].startswith("default decoder (warm): ")
    assert "x float32 model.generate (95% interval " in doc["default"]["verdict"]
    assert doc["settings"]["dtype"] == "auto" and doc["environment"]["dtype"] == "bfloat16 prepared"
    recs = doc["records"]
    assert len(recs) == 2 * 5
    assert {r["task"] for r in recs} == {"qa", "math_reasoning"}
    # prepared bf16: every method is exact against model.generate on the prepared model
    assert all(r["identical_to_greedy"] for r in recs if r["label"] != GREEDY_FP32)
    overall = next(r for r in doc["summary"] if r["task"] == "overall" and r["label"] == DEFAULT)
    assert overall["speedup_vs_fp32"] > 0 and overall["speedup_vs_fp32_low"] <= overall["speedup_vs_fp32_high"]
    assert f"| overall | {GREEDY_FP32} | 2 |" in (out / "summary.md").read_text()
    for r in recs:
        assert r["new_tokens"] <= 16 and r["seconds"] > 0
        assert r["accepted_lengths"] is None or sum(r["accepted_lengths"]) == r["new_tokens"] - r["first_pass_tokens"]
    greedy = [r for r in recs if r["label"] == GREEDY]
    assert all(r["forward_passes"] == r["new_tokens"] and r["mean_accepted_length"] in (1.0, None) for r in greedy)
    default = [r for r in recs if r["label"] == DEFAULT]
    assert all(r["budget"] == "auto" and r["memory"] == "warm" and r["inputs_per_pass"] for r in default)
    esp = [r for r in recs if r["method"] == "esp"]
    assert all(r["budget"] == 30 and r["num_masks"] == 1 and r["prefill_seconds"] is not None for r in esp)
    assert all(r["masks"] == "bundled:smollm2-135m" for r in esp)
    assert sorted(r["order"] for r in recs if r["question_id"] == recs[0]["question_id"]) == [0, 1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.model  # loads the embedded SmolLM2 in its own process, not through the fixture
def test_console_script_end_to_end(tmp_path):
    """The installed command, as a user runs it (loads the model itself)."""
    out = tmp_path / "rep"
    proc = subprocess.run(
        [sys.executable, "-m", "probe_mtp.cli", "report", "--tasks", "qa", "--limit", "2", "--max-new-tokens", "16",
         "--methods", "esp", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "overall" in proc.stdout
    check_schema(json.loads((out / "report.json").read_text()))


def test_report_with_tuned_masks_and_confadapt(smollm2, tmp_path):
    """--masks untuned,FILE x --acceptance verify,confadapt: four esp variants next to the baselines
    and the default configuration, each labelled with the vectors it used; the lossless ones agree
    with greedy, ConfAdapt at threshold 0 emits its masks at prefill."""
    import torch

    from probe_mtp.tuned_masks import ModelIdentity, TunedMasks

    identity = ModelIdentity.of(smollm2[0])
    h = identity.hidden_size
    path = TunedMasks(torch.zeros(h), torch.zeros(1, h), "relative", identity, {}).save(tmp_path / "zero" / "masks.safetensors")
    out = tmp_path / "rep"
    args = build_parser().parse_args(
        ["report", "--tasks", "qa", "--limit", "1", "--max-new-tokens", "12", "--methods", "esp", "--masks",
         f"untuned,{path}", "--acceptance", "verify,confadapt", "--threshold", "0", "--warmup-tokens", "2",
         "--out", str(out), "--no-progress", "--no-plots"]
    )
    assert cmd_report(args, loaded=smollm2) == 0
    doc = json.loads((out / "report.json").read_text())
    check_schema(doc)
    untuned, tuned = "esp BC=30 untuned:prompt_mean", "esp BC=30 tuned:zero"
    assert doc["methods"] == [GREEDY, HF_PLD, DEFAULT, untuned, f"{untuned} confadapt@0", tuned,
                              f"{tuned} confadapt@0"]
    by_label = {r["label"]: r for r in doc["records"]}
    for label in (untuned, tuned):
        assert by_label[label]["identical_to_greedy"] and by_label[label]["agreement"] == 1.0
    for label in (f"{untuned} confadapt@0", f"{tuned} confadapt@0"):
        r = by_label[label]
        assert r["acceptance"] == "confadapt" and r["first_pass_tokens"] == 2  # verified token + mask 1
        assert 0.0 <= r["agreement"] <= 1.0
    assert by_label[untuned]["masks"] == "untuned:prompt_mean"
    assert by_label[tuned]["masks"].startswith("tuned:")
    assert "Agreement with greedy per task" in (out / "summary.md").read_text()


@pytest.mark.cpu_only  # resident memory of CPU processes
def test_memory_measurement_of_one_generation(smollm2):
    from probe_mtp.report.memory import MKL_CACHE_SWITCH, measure

    for method in ("generate", "hybrid"):
        r = measure("smollm2-135m", method, tokens=12, threads=None, loaded=smollm2)
        assert r["method"] == method and r["new_tokens"] == 12 and r["samples"] >= 1
        assert r["peak_mb"] >= r["rss_before_mb"] > 0 and MKL_CACHE_SWITCH in r
        assert abs(r["floor_growth_mb"]) <= r["peak_mb"]  # a difference of two resident sizes
