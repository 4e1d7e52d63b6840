"""``probe-mtp report``, model-free: method selection, aggregation math, the outputs and the JSON
schema from hand-made records, the speed bound, the memory comparison's processes (the runs on
SmolLM2 are in tests/models/test_report_end_to_end.py)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from probe_mtp.drafters import DRAFTERS
from probe_mtp.cli import main
from probe_mtp.report import GREEDY, GREEDY_FP32, HF_PLD, Report, resolve_methods, summarize, write_outputs
from probe_mtp.report.baselines import DEFAULT
from probe_mtp.cost import CostCurve
from probe_mtp.report.bench import _bound
from probe_mtp.report.harness import ReportSettings, _PassCounter, parse_budgets
from probe_mtp.report.outputs import markdown_summary, rich_table
from probe_mtp.report.summary import OVERALL, accepted_length_counts, ratio_interval, verdict

from report_schema import ENVIRONMENT_TYPES, OPT_INT, check_schema


# --------------------------------------------------------------------------- settings


def test_methods_default_to_every_registered_drafter():
    assert resolve_methods(None) == tuple(DRAFTERS)
    assert resolve_methods("all") == tuple(DRAFTERS)
    assert resolve_methods(" esp , esp") == ("esp",)
    assert resolve_methods(("pld", "esp")) == ("pld", "esp")


def test_unknown_methods_fail_clearly():
    with pytest.raises(ValueError, match="unknown method 'nope'.*available: hybrid, esp"):
        resolve_methods("nope")
    with pytest.raises(ValueError, match="always measured"):
        resolve_methods(GREEDY)


def test_budgets_parse_as_a_sweep():
    assert parse_budgets("10,30,60") == (10, 30, 60)
    assert parse_budgets("30, 30") == (30,)
    assert parse_budgets(30) == (30,)
    with pytest.raises(ValueError, match="comma"):
        parse_budgets("10;30")
    with pytest.raises(ValueError):
        ReportSettings(methods=("esp",), budgets=(2,))  # below the smallest tree


def test_cli_errors_before_loading_a_model(capsys):
    assert main(["report", "--methods", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    assert main(["report", "--tasks", "bogus"]) == 2
    assert "unknown task" in capsys.readouterr().err


# --------------------------------------------------------------------------- transformers' pass counting


def test_pass_counter_reads_committed_tokens_from_cache_lengths():
    c = _PassCounter()
    c.cache_lengths = [0, 47, 48]  # prompt 47 -> first pass 1 token, then 1, then 6 (55 total)
    assert c.accepted_lengths(47, 8) == ([1, 6], 1)
    c.cache_lengths = [0, 50, 51]  # the first pass accepted 3 prompt-lookup tokens + its own
    assert c.accepted_lengths(47, 8) == ([1, 3], 4)
    c.cache_lengths = [0, None]
    assert c.accepted_lengths(47, 2) == (None, None)
    c.cache_lengths = [0, 47, 47]  # a pass that committed nothing: inconsistent
    assert c.accepted_lengths(47, 3) == (None, None)


# --------------------------------------------------------------------------- aggregation


def _rec(label, task, qid, seconds, lengths, new=None, passes=None, identical=True, turn=1, method=None,
         inputs=None):
    new = (sum(lengths) + 1) if new is None else new
    default = label == DEFAULT
    baseline = label in (GREEDY, HF_PLD, GREEDY_FP32)
    return {
        "method": method or label.split(" ")[0],
        "label": label,
        "kind": "baseline" if baseline else "default" if default else "probe",
        "budget": None if baseline else "auto" if default else 30,
        "num_masks": None if baseline else 1,
        "task": task,
        "category": task,
        "question_id": qid,
        "turn": turn,
        "ask": 1,
        "order": 0,
        "prompt_tokens": 10,
        "new_tokens": new,
        "forward_passes": (len(lengths) + 1) if passes is None else passes,
        "first_pass_tokens": 1,
        "accepted_lengths": lengths,
        "mean_accepted_length": (sum(lengths) / len(lengths)) if lengths else None,
        "seconds": seconds,
        "prefill_seconds": None,
        "forward_seconds": None,
        "inputs_per_pass": inputs,
        "tokens_per_second": new / seconds,
        "identical_to_greedy": identical,
        "first_mismatch": None if identical else 0,
        "masks": "bundled:smollm2-135m" if default else None,
        "memory": None if baseline else "warm",
        "acceptance": "verify",
        "matching_tokens": new if identical else 1,
        "compared_tokens": new,
        "agreement": 1.0 if identical else 1 / new,
    }


HAND_MADE = [
    # task a: two prompts
    _rec(GREEDY, "a", 1, 4.0, [1] * 7),
    _rec(HF_PLD, "a", 1, 5.0, [1, 1, 1, 4]),
    _rec("esp BC=30", "a", 1, 2.0, [2, 2, 3]),
    _rec(GREEDY, "a", 2, 6.0, [1] * 3),
    _rec(HF_PLD, "a", 2, 3.0, None, new=4, passes=3),
    _rec("esp BC=30", "a", 2, 3.0, [1, 2], new=4, identical=False),
    # task b: one prompt, two turns
    _rec(GREEDY, "b", 7, 1.0, [1], turn=1),
    _rec("esp BC=30", "b", 7, 2.0, [1], turn=1),
    _rec(GREEDY, "b", 7, 3.0, [1, 1], turn=2),
    _rec("esp BC=30", "b", 7, 2.0, [2], turn=2),
]


def test_aggregation_per_task_and_overall():
    rows = {(r["task"], r["label"]): r for r in summarize(HAND_MADE)}
    assert [t for t, _ in rows][:1] == ["a"] and ("b", HF_PLD) not in rows

    esp_a = rows[("a", "esp BC=30")]
    assert esp_a["n"] == 2
    assert esp_a["tau"] == pytest.approx((2 + 2 + 3 + 1 + 2) / 5)  # pooled, not a mean of means
    assert esp_a["new_tokens"] == 8 + 4
    assert esp_a["forward_passes"] == 4 + 3
    assert esp_a["tokens_per_pass"] == pytest.approx(12 / 7)
    assert esp_a["tokens_per_second"] == pytest.approx(12 / 5.0)
    assert esp_a["speedup_vs_greedy"] == pytest.approx((4.0 + 6.0) / (2.0 + 3.0))
    assert esp_a["speedup_vs_hf_pld"] == pytest.approx((5.0 + 3.0) / (2.0 + 3.0))
    assert esp_a["identical"] == 1 and not esp_a["all_identical"]
    assert esp_a["agreement"] == pytest.approx((8 + 1) / (8 + 4))  # pooled over tokens

    pld_a = rows[("a", HF_PLD)]
    assert pld_a["tau"] is None  # one record without accepted lengths: n/a rather than a guess
    assert pld_a["speedup_vs_greedy"] == pytest.approx(10.0 / 8.0)

    greedy_a = rows[("a", GREEDY)]
    assert greedy_a["tau"] == 1.0 and greedy_a["speedup_vs_greedy"] == 1.0

    esp_b = rows[("b", "esp BC=30")]
    assert esp_b["tau"] == pytest.approx(3 / 2)
    assert esp_b["speedup_vs_greedy"] == pytest.approx(4.0 / 4.0)
    assert esp_b["speedup_vs_hf_pld"] is None  # no prompt lookup records for task b

    esp_all = rows[(OVERALL, "esp BC=30")]
    assert esp_all["n"] == 4
    assert esp_all["tau"] == pytest.approx((2 + 2 + 3 + 1 + 2 + 1 + 2) / 7)
    assert esp_all["speedup_vs_greedy"] == pytest.approx(14.0 / 9.0)
    # against prompt lookup only over the turns it ran (task a)
    assert esp_all["speedup_vs_hf_pld"] == pytest.approx(8.0 / 5.0)
    assert esp_all["identical"] == 3


def test_summary_order_and_histogram():
    rows = summarize(HAND_MADE, labels=[GREEDY, HF_PLD, "esp BC=30"])
    assert [r["task"] for r in rows] == ["a"] * 3 + ["b"] * 2 + [OVERALL] * 3
    assert [r["label"] for r in rows[:3]] == [GREEDY, HF_PLD, "esp BC=30"]
    hist = accepted_length_counts(HAND_MADE)
    assert hist["esp BC=30"] == {1: 2, 2: 4, 3: 1}
    assert hist[HF_PLD] == {1: 3, 4: 1}


# --------------------------------------------------------------------------- outputs and schema


DEFAULT_RECS = [
    # the default configuration: half of model.generate's time on every turn
    _rec(DEFAULT, "a", 1, 2.0, [2, 3, 2], inputs=[9, 9, 1]),
    _rec(DEFAULT, "a", 2, 3.0, [1, 2], new=4, inputs=[1, 9]),
    _rec(DEFAULT, "b", 7, 0.5, [1], turn=1, inputs=[1]),
    _rec(DEFAULT, "b", 7, 1.5, [2], turn=2, inputs=[17]),
]
VERDICT = ("default decoder (warm): 2.00x model.generate (95% interval 2.00-2.00), identical on 4/4; 1.60x "
           "transformers' prompt lookup: faster than model.generate, not clearly faster or slower than "
           "transformers' prompt lookup")


def _hand_made_report(fp32: bool = False) -> Report:
    """The hand-made records as a report; ``fp32``: with the float32 baseline of a prepared model
    (twice model.generate's time on every turn; one of its outputs differs)."""
    settings = ReportSettings(methods=("esp",), max_new_tokens=8).as_dict()
    env = {k: (1 if t is int or t == OPT_INT else None if isinstance(t, tuple) else "x") for k, t in ENVIRONMENT_TYPES.items()}
    records, methods = HAND_MADE + DEFAULT_RECS, [GREEDY, HF_PLD, DEFAULT, "esp BC=30"]
    if fp32:
        env.update(dtype="bfloat16 prepared", kernels="bfloat16, packed", fp32_reference="float32, stock kernels")
        settings["dtype"] = "auto"
        records = records + [_rec(GREEDY_FP32, r["task"], r["question_id"], 2 * r["seconds"], [1] * (r["new_tokens"] - 1),
                                  turn=r["turn"], identical=r["question_id"] != 2)
                             for r in HAND_MADE if r["label"] == GREEDY]
        methods.insert(2, GREEDY_FP32)
    return Report(settings, env, records, "2026-01-01T00:00:00+00:00", 1.5, methods, {30: 2.25})


def test_outputs_from_hand_made_records(tmp_path):
    report = _hand_made_report()
    written = write_outputs(report, tmp_path / "out")
    names = [p.name for p in written]
    assert names[:4] == ["report.json", "records.csv", "summary.md", "default_speedup.png"]  # the default plot first
    assert sorted(names[4:]) == ["accepted_lengths.png", "speedup_per_task.png", "tau_per_task.png"]
    for p in written:
        assert p.stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the staging folder is gone
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    check_schema(doc)
    assert Report.from_dict(doc).summary == doc["summary"]
    assert Report.from_dict(doc).pass_costs == {30: 2.25}
    with (tmp_path / "out" / "records.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(HAND_MADE) + len(DEFAULT_RECS) and rows[0]["accepted_lengths"] == "1 1 1 1 1 1 1"
    md = markdown_summary(report)
    assert "| esp BC=30 | 1.86 |" in md  # overall tau, ratios only
    assert "tokens/s" not in md
    assert (tmp_path / "out" / "tau_per_task.png").read_bytes()[:4] == b"\x89PNG"


def test_default_section_leads_report_json_and_summary_md(tmp_path):
    report = _hand_made_report()
    write_outputs(report, tmp_path / "out", plots=False)
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    section = doc["default"]
    assert section["budget"] == "auto" and section["memory"] == "warm" and section["masks"] == "bundled:smollm2-135m"
    assert section["pass_sizes"] == {"1": 3, "9": 3, "17": 1}  # the budgets the adaptive budget chose
    assert section["verdict"] == VERDICT
    overall = next(r for r in section["summary"] if r["task"] == OVERALL and r["label"] == DEFAULT)
    assert overall["speedup_vs_greedy"] == pytest.approx(2.0) and overall["identical"] == 4
    assert {r["label"] for r in section["summary"]} == {GREEDY, HF_PLD, DEFAULT}
    assert all(r["budget"] == "auto" for r in doc["records"] if r["label"] == DEFAULT)
    assert doc["equal_budget"]["labels"] == ["esp BC=30"]
    assert "2.2x a one-token pass" in doc["equal_budget"]["note"]
    md = (tmp_path / "out" / "summary.md").read_text()
    assert md.index(VERDICT) < md.index("## The default configuration") < md.index("## Equal block complexity")
    assert "| overall | default | 4 |" in md and "2.00-2.00" in md
    assert "budget 'auto' chose passes of 1-17 inputs (median 9" in md
    assert "tau above 2 can still be slower" in md


def test_verdict_line_is_computed_from_the_records():
    assert verdict(summarize(HAND_MADE + DEFAULT_RECS), DEFAULT, "warm") == VERDICT
    # twice model.generate's time on every turn, one output different, no prompt lookup records
    slow = [_rec(GREEDY, "a", q, 1.0, [1, 1]) for q in range(4)]
    slow += [_rec(DEFAULT, "a", q, 2.0, [1, 1], identical=q != 3) for q in range(4)]
    assert verdict(summarize(slow)) == (
        "default decoder: 0.50x model.generate (95% interval 0.50-0.50), identical on 3/4: slower than model.generate"
    )
    # faster on some prompts, slower on others: the interval straddles 1
    mixed = [_rec(GREEDY, "a", q, 1.0, [1]) for q in range(4)]
    mixed += [_rec(DEFAULT, "a", q, t, [1]) for q, t in enumerate((0.5, 2.0, 0.5, 2.0))]
    line = verdict(summarize(mixed), DEFAULT, "cold")
    assert line.startswith("default decoder (cold): 0.80x model.generate (95% interval ")
    assert line.endswith("identical on 4/4: not clearly faster or slower than model.generate")
    # faster than both baselines on every turn
    both = [_rec(GREEDY, "a", q, 2.0, [1]) for q in range(3)] + [_rec(HF_PLD, "a", q, 1.5, [1]) for q in range(3)]
    both += [_rec(DEFAULT, "a", q, 1.0, [2]) for q in range(3)]
    assert verdict(summarize(both)).endswith("; 1.50x transformers' prompt lookup: faster than both")
    # a single prompt turn: no interval, so no claim either way
    one = verdict(summarize(both[:1] + both[3:4] + both[6:7]))
    assert "interval" not in one and one.endswith(": not clearly faster or slower than either")
    assert verdict(summarize(HAND_MADE)) is None  # no default row


def test_speedup_interval_is_a_paired_bootstrap_over_prompts():
    # the method takes half the time on every turn, whatever the turn's length: paired, the
    # interval is exactly 2 (an unpaired resampling would spread it over 0.02-200)
    assert ratio_interval([(1.0, 0.5), (10.0, 5.0), (100.0, 50.0)]) == pytest.approx((2.0, 2.0))
    pairs = [(1.0, 0.8), (2.0, 1.0), (1.5, 1.6), (3.0, 1.0), (1.0, 1.1)]
    low, high = ratio_interval(pairs)
    point = sum(b for b, _ in pairs) / sum(m for _, m in pairs)
    assert min(b / m for b, m in pairs) <= low < point < high <= max(b / m for b, m in pairs)
    assert ratio_interval(pairs) == (low, high)  # fixed seed: the same interval every time
    assert ratio_interval([]) is None and ratio_interval([(2.0, 1.0)]) is None  # one turn: no spread


def test_terminal_output_leads_with_the_default_table_and_verdict():
    from rich.console import Console

    from probe_mtp.report.outputs import print_report

    console = Console(width=200, record=True)
    print_report(_hand_made_report(), console)
    text = console.export_text()
    assert text.index("probe-mtp default configuration") < text.index(VERDICT[:60]) < text.index("equal block complexity")
    assert "95% interval" in text and "2.00-2.00" in text
    assert "tau above 2 can still be slower than model.generate" in text
    assert "a 30-input pass costs 2.2x a one-token pass" in text


def test_rich_table_renders():
    from rich.console import Console

    console = Console(width=140, record=True)
    console.print(rich_table(_hand_made_report()))
    text = console.export_text()
    assert "esp BC=30" in text and "overall" in text and "1/2" in text


def test_mask_and_acceptance_variants_are_labelled():
    from probe_mtp.report.harness import mask_variants

    settings = ReportSettings(methods=("esp",), acceptance=("verify", "confadapt"), threshold=0.9)
    assert mask_variants(settings) == [
        ("auto", "", {"masks": "auto"}),
        ("auto", " confadapt@0.9", {"masks": "auto", "acceptance": "confadapt", "threshold": 0.9}),
    ]
    assert ReportSettings(methods=("esp",)).masks == ("auto",)  # the decoder's default
    with pytest.raises(FileNotFoundError, match="tuned mask file"):
        ReportSettings(methods=("esp",), masks=("missing/masks.safetensors",))
    with pytest.raises(ValueError, match="acceptance"):
        ReportSettings(methods=("esp",), acceptance=("nope",))


def test_bench_bound_costs_each_pass_at_its_context_and_adds_the_prefill_to_both_sides():
    # c(1, L) = 10 + 0.05 (L - 100); c(8, L) = 20 + 0.1 (L - 100)
    curve = CostCurve((1, 8), (10.0, 20.0), 100, "toy", 300, (20.0, 40.0))
    mine = 20.0 + (20 + 0.1 * 3)  # the second pass runs on 3 more cached tokens
    plain = sum(10 + 0.05 * t for t in range(4))  # one-token steps at contexts 100..103
    rec = {"inputs_per_pass": [8, 8], "accepted_lengths": [3, 1], "prefill_seconds": 5.0,
           "forward_seconds": 2 * mine, "prompt_tokens": 100, "new_tokens": 5}  # 1 + 3 + 1 tokens
    # the passes ran twice as slow as the curve: plain decoding is put on the same scale
    assert _bound([rec], curve) == pytest.approx((5.0 + 2 * plain) / (5.0 + 2 * mine))
    # a one-row curve and no prefill: tau / (c(N) / c(1))
    flat = CostCurve((1, 8), (10.0, 20.0))
    assert _bound([dict(rec, prefill_seconds=0.0)], flat) == pytest.approx(2.0 / (20 / 10))
    assert _bound([dict(rec, prefill_seconds=0.0, forward_seconds=None)], flat) == pytest.approx(1.0)
    assert _bound([dict(rec, inputs_per_pass=[])], curve) is None


@pytest.mark.parametrize("mkl_cache,preset,expected", [(False, None, "1"), (True, None, None), (False, "0", "0")],
                         ids=["off-by-default", "kept-on-request", "user-setting-wins"])
def test_memory_comparison_runs_each_method_in_a_fresh_process(monkeypatch, mkl_cache, preset, expected):
    from probe_mtp.report import memory

    monkeypatch.delenv(memory.MKL_CACHE_SWITCH, raising=False)
    if preset is not None:
        monkeypatch.setenv(memory.MKL_CACHE_SWITCH, preset)
    calls = []

    def fake_run(cmd, env, **kwargs):
        calls.append((cmd, env))
        method = cmd[cmd.index("--method") + 1]
        line = json.dumps({"method": method, memory.MKL_CACHE_SWITCH: env.get(memory.MKL_CACHE_SWITCH)})
        return subprocess.CompletedProcess(cmd, 0, stdout=f"noise\n{line}\n", stderr="")

    monkeypatch.setattr(memory.subprocess, "run", fake_run)
    results = memory.compare_memory("smollm2-135m", ["esp", "hybrid"], tokens=8, threads=2, mkl_cache=mkl_cache,
                                    dtype="auto")
    assert [r["method"] for r in results] == ["generate", "esp", "hybrid"]
    assert all(r[memory.MKL_CACHE_SWITCH] == expected for r in results)
    assert all(cmd[:3] == [sys.executable, "-m", "probe_mtp.report.memory"] and "--threads" in cmd for cmd, _ in calls)
    # the model as the run loaded it: prepared where --dtype auto prepares it
    assert all(cmd[cmd.index("--dtype") + 1] == "auto" for cmd, _ in calls)


# --------------------------------------------------------------------------- the float32 baseline of a prepared model


FP32_VERDICT = (VERDICT.removesuffix(": faster than model.generate, not clearly faster or slower than transformers' "
                                     "prompt lookup")
                + "; 4.00x float32 model.generate (95% interval 4.00-4.00): faster than model.generate, not clearly "
                "faster or slower than transformers' prompt lookup, faster than float32 model.generate")


def test_float32_baseline_speedup_interval_and_verdict(tmp_path):
    report = _hand_made_report(fp32=True)
    rows = {(r["task"], r["label"]): r for r in report.summary}
    default = rows[(OVERALL, DEFAULT)]
    assert default["speedup_vs_fp32"] == pytest.approx(4.0)  # twice generate's time, half of it
    assert (default["speedup_vs_fp32_low"], default["speedup_vs_fp32_high"]) == pytest.approx((4.0, 4.0))
    assert rows[(OVERALL, "esp BC=30")]["speedup_vs_fp32"] == pytest.approx(28.0 / 9.0)
    fp32 = rows[(OVERALL, GREEDY_FP32)]
    assert fp32["speedup_vs_greedy"] == pytest.approx(0.5) and (fp32["identical"], fp32["n"]) == (3, 4)
    # the old keys unchanged, and None where no float32 baseline ran
    assert default["speedup_vs_greedy"] == pytest.approx(2.0)
    assert all(r["speedup_vs_fp32"] is None and r["speedup_vs_fp32_low"] is None for r in summarize(HAND_MADE + DEFAULT_RECS))
    assert verdict(report.summary, DEFAULT, "warm") == FP32_VERDICT
    write_outputs(report, tmp_path / "out", plots=True)
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    check_schema(doc)
    assert doc["default"]["verdict"] == FP32_VERDICT
    assert doc["default"]["fp32_agreement"].startswith(
        "stock float32 against prepared bf16: model.generate on the float32 model is identical to model.generate on "
        "the prepared model on 3/4 turns")
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| overall | default | 4 | 1.86 | 2.00x | 2.00-2.00 | 1.60x | 4.00x | 4.00-4.00 | 4/4 |" in md
    assert f"| overall | {GREEDY_FP32} | 4 | 1.00 | 0.50x | 0.50-0.50 |  |  |  | 3/4 |" in md
    assert "(bfloat16 prepared; requested auto)" in md and "- kernels: bfloat16, packed" in md


def test_three_baselines_in_words():
    fast = [_rec(GREEDY, "a", q, 2.0, [1]) for q in range(3)] + [_rec(HF_PLD, "a", q, 1.5, [1]) for q in range(3)]
    fast += [_rec(GREEDY_FP32, "a", q, 3.0, [1]) for q in range(3)] + [_rec(DEFAULT, "a", q, 1.0, [2]) for q in range(3)]
    assert verdict(summarize(fast)).endswith("; 3.00x float32 model.generate (95% interval 3.00-3.00): faster than all three")
    one = [fast[0], fast[3], fast[6], fast[9]]  # one turn: no interval, no claim
    assert verdict(summarize(one)).endswith("; 3.00x float32 model.generate: not clearly faster or slower than any of them")


def test_terminal_output_of_a_prepared_model_has_the_float32_columns():
    from rich.console import Console

    from probe_mtp.report.outputs import print_report

    console = Console(width=250, record=True)
    print_report(_hand_made_report(fp32=True), console)
    text = console.export_text()
    assert "generate fp32 tok/s" in text and "x generate fp32" in text and "4.00x" in text
    assert "bfloat16 prepared; requested auto" in text and "kernels: bfloat16, packed" in text
    assert "on 3/4 turns" in text
    console = Console(width=250, record=True)
    print_report(_hand_made_report(), console)
    assert "fp32" not in console.export_text()
