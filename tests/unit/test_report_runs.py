"""``probe-mtp report`` and ``bench`` options, model-free: --full and --cold parse and change what
runs, bad input fails before any model is loaded and leaves no output folder, the prompt streams of
the bench, and whole runs of the harness on a tiny random Llama (the default configuration, warm and
cold decoders, the repeat stream, batches) in seconds, and the same tiny Llama prepared by
probe_mtp.optimize beside its float32 copy (the generate fp32 baseline).  The runs on SmolLM2 are in
tests/models/test_report_end_to_end.py."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from probe_mtp.cli import build_parser, main
from probe_mtp.cost import CostCurve
from probe_mtp.drafters import DRAFTERS
from probe_mtp.prompts import Prompt
from probe_mtp.report import GREEDY, GREEDY_FP32, HF_PLD, ReportSettings, run_report
from probe_mtp.report.baselines import DEFAULT
from probe_mtp.report.cli import FULL, QUICK, cmd_bench, cmd_report, settings_from_args
from probe_mtp.report.streams import build_stream

from report_schema import check_schema


def _settings(*argv: str, default: bool = True) -> ReportSettings:
    return settings_from_args(build_parser().parse_args(list(argv)), default=default)


# --------------------------------------------------------------------------- --full and --cold


def test_report_defaults_are_the_quick_run():
    s = _settings("report")
    assert (s.limit, s.max_new_tokens, s.methods, s.method_limit, s.warmup_tokens) == (
        QUICK["limit"], QUICK["max_new_tokens"], QUICK["methods"], None, 8)
    assert s.default and s.memory == ("warm",) and s.budgets == (30,) and s.masks == ("auto",) and not s.full
    assert {"hybrid", "esp", "pld", "lookahead", "stand"} <= set(s.methods)


def test_full_runs_every_drafter_on_more_prompts_and_explicit_options_win():
    s = _settings("report", "--full")
    assert s.full and s.methods == tuple(DRAFTERS) and s.method_limit is None
    assert (s.limit, s.max_new_tokens) == (FULL["limit"], FULL["max_new_tokens"])
    assert s.limit > QUICK["limit"] and s.max_new_tokens > QUICK["max_new_tokens"]
    s = _settings("report", "--full", "--limit", "1", "--max-new-tokens", "8", "--methods", "esp")
    assert (s.limit, s.max_new_tokens, s.methods) == (1, 8, ("esp",))
    assert _settings("report", "--methods", "none").methods == ()
    assert _settings("report", "--fixed-limit", "2", "--limit", "3").method_limit == 2
    assert _settings("report", "--fixed-limit", "3", "--limit", "3").method_limit is None  # every prompt


def test_cold_gives_every_prompt_an_empty_memory():
    assert _settings("report", "--cold").memory == ("cold",)
    assert _settings("bench", "--cold", default=False).memory == ("cold",)
    bench = _settings("bench", "--memory", "warm,cold", "--stream", "repeat", default=False)
    assert bench.memory == ("warm", "cold") and bench.stream == "repeat" and not bench.default
    assert _settings("bench", "--stream", "conversation", default=False).stream == "conversation"


def test_a_busy_machine_is_named_before_the_run():
    from probe_mtp.report.cli import busy_machine_note

    assert busy_machine_note(2, load=0.3, cores=2) is None
    assert busy_machine_note(1, load=3.0, cores=2) is None  # one thread leaves a core to the other work
    assert busy_machine_note(4, load=3.0, cores=16) is None  # threads to spare
    note = busy_machine_note(2, load=1.9, cores=2)
    assert "load average 1.9" in note and "--threads 1" in note


# --------------------------------------------------------------------------- bad input


def _exit_code(argv: list[str]) -> int:
    """``probe-mtp ARGV``'s exit status (argparse's own errors exit with 2 too)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


@pytest.mark.parametrize("argv,message", [
    (["report", "--methods", "nope"], "unknown method 'nope'"),
    (["report", "--tasks", "bogus"], "unknown task"),
    (["report", "--budget", "2"], "too small"),
    (["report", "--budget", "5000"], "out of range"),
    (["report", "--budget", "ten"], "a budget is an integer or 'auto'"),
    (["report", "--prompts", "missing.jsonl"], "prompt file not found"),
    (["report", "--masks", "missing.safetensors"], "tuned mask file not found"),
    (["report", "--limit", "-1"], "--limit"),
    (["report", "--fixed-limit", "0"], "--fixed-limit"),
    (["bench", "--memory", "hot"], "--memory takes warm, cold"),
    (["bench", "--cold", "--memory", "warm"], "disagree"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--batch", "0,2"], "batch sizes must lie in 1..64"),
    (["bench", "--batch", "two"], "--batch takes a comma list"),
    (["bench", "--batch", "64", "--limit", "1"], "--batch 64 needs at least 64 prompts"),
])
def test_bad_input_fails_before_loading_a_model_and_writes_nothing(argv, message, tmp_path, capsys, monkeypatch):
    import probe_mtp.loading

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(probe_mtp.loading, "load_model", no_model)
    out = tmp_path / "rep"
    assert _exit_code(argv + ["--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_unreadable_prompt_files_and_output_folders_fail_clearly(tmp_path, capsys, monkeypatch):
    import probe_mtp.loading

    monkeypatch.setattr(probe_mtp.loading, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert main(["report", "--prompts", str(binary), "--out", "-"]) == 2
    assert "cannot read the prompt file" in capsys.readouterr().err
    assert main(["report", "--prompts", str(tmp_path), "--out", "-"]) == 2  # a folder
    assert "prompt file not found" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"turns": ["fine"]}\nnot json\n')
    assert main(["report", "--prompts", str(broken), "--out", "-"]) == 2
    assert "broken.jsonl:2: not valid JSON" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.write_text("a file, not a folder")
    assert main(["report", "--out", str(taken)]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err


# --------------------------------------------------------------------------- prompt streams


PROMPTS = [
    Prompt(1, "writing", ("w1", "w2")),
    Prompt(2, "qa", ("q",)),
    Prompt(3, "qa", ("r",)),
]


def _shape(stream):
    return [[(t.prompt.question_id, t.turn, t.text, t.ask) for t in c.turns] for c in stream]


def test_specbench_stream_keeps_each_prompt_its_own_conversation():
    assert _shape(build_stream(PROMPTS, "specbench")) == [
        [(1, 1, "w1", 1), (1, 2, "w2", 1)], [(2, 1, "q", 1)], [(3, 1, "r", 1)]]


def test_repeat_stream_asks_every_turn_twice_in_a_row():
    assert _shape(build_stream(PROMPTS, "repeat")) == [
        [(1, 1, "w1", 1), (1, 1, "w1", 2), (1, 2, "w2", 1), (1, 2, "w2", 2)],
        [(2, 1, "q", 1), (2, 1, "q", 2)], [(3, 1, "r", 1), (3, 1, "r", 2)]]


def test_conversation_stream_chains_the_prompts_of_a_task():
    stream = build_stream(PROMPTS, "conversation")
    assert [c.task for c in stream] == ["mt_bench", "qa"]
    assert _shape(stream) == [[(1, 1, "w1", 1), (1, 2, "w2", 1)], [(2, 1, "q", 1), (3, 2, "r", 1)]]
    with pytest.raises(ValueError, match="unknown stream 'chat'"):
        build_stream(PROMPTS, "chat")


# --------------------------------------------------------------------------- runs on a tiny model


class CharTokenizer:
    """A tokenizer without a chat template: one token per character, ids 1-13 (15 is EOS)."""

    chat_template = None

    def __call__(self, text, return_tensors="pt"):
        return {"input_ids": torch.tensor([[1 + ord(c) % 13 for c in text]])}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(i) % 26) for i in ids)


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """A tiny random Llama, a tokenizer, and a fixed cost curve (nothing measured or cached), on one
    torch thread (a second one only waits for the first on such small products, and much longer on
    a shared machine)."""
    import probe_mtp.decoder

    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    curve = CostCurve((1, 8, 16, 32, 64), (1.0, 1.2, 1.5, 2.0, 3.0))
    monkeypatch.setattr(probe_mtp.decoder, "cost_curve_for", lambda *a, **k: curve)
    monkeypatch.setenv("PROBE_MTP_CACHE_DIR", str(tmp_path / "cache"))
    yield tiny_llama(), CharTokenizer()
    torch.set_num_threads(threads)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=16, max_position_embeddings=256,
                         attn_implementation="sdpa", bos_token_id=0, eos_token_id=15, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny_prepared(tiny):
    """``(prepared model, tokenizer, float32 model)``: a copy of the tiny Llama prepared by
    probe_mtp.optimize (bf16 on any processor) and the float32 model it came from, as ``loaded=``
    takes them."""
    import copy

    import probe_mtp

    model, tokenizer = tiny
    return probe_mtp.optimize(copy.deepcopy(model), require_matrix_units=False), tokenizer, model


def _prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["abab abab", "again"]},
            {"question_id": 2, "category": "qa", "turns": ["what is x x x"]},
            {"question_id": 3, "category": "qa", "turns": ["tell y y"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_report_runs_the_default_configuration_warm_or_cold(tiny, tmp_path, capsys, cold):
    out = tmp_path / "rep"
    argv = ["report", "--prompts", str(_prompt_file(tmp_path)), "--limit", "2", "--max-new-tokens", "6",
            "--warmup-tokens", "2", "--methods", "pld", "--out", str(out), "--no-progress", "--no-plots"]
    argv += ["--cold"] if cold else []
    assert cmd_report(build_parser().parse_args(argv), loaded=tiny) == 0
    printed = capsys.readouterr().out
    memory = "cold" if cold else "warm"
    assert printed.index("probe-mtp default configuration") < printed.index(f"default decoder ({memory}):") \
        < printed.index("equal block complexity")
    doc = json.loads((out / "report.json").read_text())
    check_schema(doc)
    assert doc["methods"] == [GREEDY, HF_PLD, DEFAULT, "pld BC=30"]
    assert doc["default"]["memory"] == memory and doc["default"]["budget"] == "auto"
    assert doc["settings"]["memory"] == [memory]
    default = [r for r in doc["records"] if r["label"] == DEFAULT]
    assert len(default) == 4 and all(r["budget"] == "auto" and r["memory"] == memory for r in default)
    assert all(r["masks"] == "untuned:prompt_mean" for r in default)  # no bundled vectors fit a random model
    assert all(r["identical_to_greedy"] for r in doc["records"])
    assert {r["memory"] for r in doc["records"] if r["label"] == "pld BC=30"} == {memory}
    assert "tau above 2 can still be slower" in (out / "summary.md").read_text()
    # float32, nothing prepared: no float32 baseline, no column for it
    assert doc["environment"]["dtype"] == "float32" and doc["environment"]["fp32_reference"] is None
    assert doc["settings"]["dtype"] == "auto" and doc["environment"]["kernels"].startswith("float32, stock kernels")
    assert GREEDY_FP32 not in doc["methods"] and doc["default"]["fp32_agreement"] is None
    assert "generate fp32" not in (out / "summary.md").read_text() and "generate fp32" not in printed
    assert "float32 model.generate" not in doc["default"]["verdict"]
    if cold:
        assert doc["memories"] == {}
    else:  # each warm decoder's memory after the stream: 4 requests (the warm-up forgotten), saved and loaded
        assert doc["memories"][DEFAULT]["requests"] == 4 and doc["memories"][DEFAULT]["corpus_tokens"] > 0
        assert f"memory after the stream, {DEFAULT}: 4 requests" in printed


def test_every_method_has_its_own_decoder_and_forgets_the_warm_up(tiny):
    from probe_mtp.report.harness import build_methods

    model, tokenizer = tiny
    settings = ReportSettings(methods=("hybrid", "pld"), memory=("warm", "cold"), max_new_tokens=4)
    methods = build_methods(model, tokenizer, settings)
    assert [m.label for m in methods] == [GREEDY, HF_PLD, "default warm", "hybrid BC=30 untuned:prompt_mean warm",
                                         "pld BC=30 warm", "default cold", "hybrid BC=30 untuned:prompt_mean cold",
                                         "pld BC=30 cold"]
    decoders = [m.decoder for m in methods if m.decoder is not None]
    assert len({id(d) for d in decoders}) == len(decoders) == 6
    assert [d.memory is not None for d in decoders] == [True] * 3 + [False] * 3
    warm = methods[2]
    with torch.no_grad():
        warm.run(torch.tensor([[1, 2, 3, 4, 1, 2, 3]]), 4)
    assert warm.decoder.memory.requests == 1
    warm.forget()
    assert warm.decoder.memory.requests == 0 and len(warm.decoder.memory.corpus) == 0


def test_repeat_stream_runs_each_prompt_twice_with_the_same_prompt(tiny):
    model, tokenizer = tiny
    prompts = [Prompt(1, "qa", ("ab ab ab",)), Prompt(2, "rag", ("cd cd",))]
    settings = ReportSettings(methods=("pld",), memory=("warm",), stream="repeat", max_new_tokens=5, warmup_tokens=2,
                              default=False)
    report = run_report(model, tokenizer, settings, prompts, progress=False)
    pld = [r for r in report.records if r["method"] == "pld"]
    assert [(r["question_id"], r["ask"]) for r in pld] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert pld[0]["prompt_tokens"] == pld[1]["prompt_tokens"]
    assert all(r["identical_to_greedy"] for r in report.records)
    assert {r["kind"] for r in report.records} == {"baseline", "probe"}  # the bench has no default row


def test_report_and_bench_measure_batches_when_asked(tiny, tmp_path, capsys):
    out = tmp_path / "rep"
    argv = ["report", "--prompts", str(_prompt_file(tmp_path)), "--limit", "2", "--max-new-tokens", "5",
            "--warmup-tokens", "2", "--methods", "none", "--batch", "1,3", "--out", str(out), "--no-progress", "--no-plots"]
    assert cmd_report(build_parser().parse_args(argv), loaded=tiny) == 0
    printed = capsys.readouterr().out
    assert "default decoder on batches, against model.generate on the same batches: B=1:" in printed
    doc = json.loads((out / "report.json").read_text())
    check_schema(doc)
    assert [(r["batch"], r["batches"]) for r in doc["batches"]] == [(1, 3), (3, 1)]

    assert all(r["identical"] == r["batches"] for r in doc["batches"])  # greedy, row for row
    assert "## Batches" in (out / "summary.md").read_text()

    bench = tmp_path / "bench"
    argv = ["bench", "--prompts", str(_prompt_file(tmp_path)), "--limit", "2", "--max-new-tokens", "5", "--batch", "2",
            "--out", str(bench), "--no-progress"]
    assert cmd_bench(build_parser().parse_args(argv), loaded=tiny) == 0
    rows = json.loads((bench / "bench.json").read_text())["batches"]
    assert [(r["batch"], r["batches"], r["identical"]) for r in rows] == [(2, 1, 1)]
    assert "| 2 | 1 |" in (bench / "bench.md").read_text()


def test_every_batch_size_starts_with_an_empty_memory(tiny):
    """The sizes decode the same prompts: a size must not draft the outputs of an earlier size."""
    from probe_mtp import ProbeDecoder
    from probe_mtp.report.batches import measure_batches

    model, tokenizer = tiny
    decoder = ProbeDecoder(model, tokenizer)
    prompts = [torch.tensor([[1, 2, 3, 4, 1, 2]]), torch.tensor([[5, 6, 7]]), torch.tensor([[3, 3, 4, 5, 6]])]
    with torch.no_grad():
        rows = measure_batches(model, decoder, prompts, [1, 3], max_new_tokens=4)
    assert [r.identical for r in rows] == [3, 1]
    # what the memory holds is the last size's one batch of 3 rows, not the 3 + 3 rows of both sizes
    assert decoder.memory.requests == 3


# --------------------------------------------------------------------------- a prepared model beside float32


def _report_argv(tmp_path, out, methods: str = "pld") -> list[str]:
    return ["report", "--prompts", str(_prompt_file(tmp_path)), "--limit", "2", "--max-new-tokens", "6",
            "--warmup-tokens", "2", "--methods", methods, "--out", str(out), "--no-progress", "--no-plots"]


def test_a_prepared_model_is_measured_against_float32_generate_too(tiny_prepared, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # every column of the default table readable
    out = tmp_path / "rep"
    assert cmd_report(build_parser().parse_args(_report_argv(tmp_path, out)), loaded=tiny_prepared) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "report.json").read_text())
    check_schema(doc)
    assert doc["methods"] == [GREEDY, HF_PLD, GREEDY_FP32, DEFAULT, "pld BC=30"]
    env = doc["environment"]
    assert doc["settings"]["dtype"] == "auto" and env["dtype"] == "bfloat16 prepared"
    assert env["kernels"].startswith("bfloat16, ") and env["fp32_reference"].startswith("float32, stock kernels")
    fp32 = [r for r in doc["records"] if r["label"] == GREEDY_FP32]
    assert len(fp32) == 4 and all(r["kind"] == "baseline" and r["forward_passes"] == r["new_tokens"] for r in fp32)
    # every method exact against model.generate on the prepared model
    assert all(r["identical_to_greedy"] for r in doc["records"] if r["label"] != GREEDY_FP32)
    overall = {r["label"]: r for r in doc["summary"] if r["task"] == "overall"}
    default = overall[DEFAULT]
    assert default["speedup_vs_fp32"] > 0 and default["speedup_vs_fp32_low"] <= default["speedup_vs_fp32_high"]
    assert overall[GREEDY_FP32]["speedup_vs_fp32"] == 1.0
    assert f"x float32 model.generate (95% interval {default['speedup_vs_fp32_low']:.2f}-" in doc["default"]["verdict"]
    assert doc["default"]["fp32_agreement"].startswith("stock float32 against prepared bf16")
    assert {r["label"] for r in doc["default"]["summary"]} == {GREEDY, HF_PLD, GREEDY_FP32, DEFAULT}
    md = (out / "summary.md").read_text()
    assert "(bfloat16 prepared; requested auto)" in md and "- kernels: bfloat16, " in md
    assert "| speedup vs generate fp32 | 95% interval |" in md and f"| overall | {GREEDY_FP32} | 4 |" in md
    assert "## Speedup over model.generate on the float32 model per task" in md
    for column in ("generate fp32 tok/s", "x generate fp32"):
        assert column in printed
    assert "bfloat16 prepared; requested auto" in printed and "stock float32 against prepared bf16" in printed


def test_float32_outputs_that_differ_are_not_counted_as_losses(tiny_prepared, tmp_path, capsys):
    """Another random model as the 'float32 reference': its outputs differ from the prepared model's,
    which the agreement says; no output of probe-mtp differs, so no red line."""
    model, tokenizer, _ = tiny_prepared
    out = tmp_path / "rep"
    args = build_parser().parse_args(_report_argv(tmp_path, out, "none"))
    assert cmd_report(args, loaded=(model, tokenizer, tiny_llama(seed=1))) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "report.json").read_text())
    fp32 = next(r for r in doc["summary"] if r["task"] == "overall" and r["label"] == GREEDY_FP32)
    assert fp32["identical"] < fp32["n"] and fp32["agreement"] < 1.0
    assert f"on {fp32['identical']}/{fp32['n']} turns" in doc["default"]["fp32_agreement"]
    assert "differ from model.generate" not in printed


def test_loading_a_prepared_model_loads_its_float32_reference(tiny_prepared, monkeypatch, tmp_path):
    """--dtype auto gave a prepared model: prepare_run loads the float32 model beside it; a float32
    load loads nothing more."""
    import probe_mtp.loading
    from probe_mtp.report.cli import prepare_run

    prepared, tokenizer, fp32 = tiny_prepared
    loads = []

    def fake_load(name, dtype=torch.float32, **kwargs):
        loads.append(dtype)
        return (prepared if dtype == "auto" else fp32), tokenizer

    monkeypatch.setattr(probe_mtp.loading, "load_model", fake_load)
    argv = ["report", "--prompts", str(_prompt_file(tmp_path)), "--limit", "1", "--out", "-"]
    *_, model, _, reference = prepare_run(build_parser().parse_args(argv))
    assert (model, reference, loads) == (prepared, fp32, ["auto", torch.float32])
    loads.clear()
    *_, model, _, reference = prepare_run(build_parser().parse_args(argv + ["--dtype", "float32"]))
    assert (model, reference, loads) == (fp32, None, [torch.float32])
    *_, reference = prepare_run(build_parser().parse_args(argv), loaded=(prepared, tokenizer))
    assert reference is None and loads == [torch.float32]  # loaded=: nothing loaded, no reference unless given


def test_bench_and_batches_of_a_prepared_model_against_float32(tiny_prepared, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    bench = tmp_path / "bench"
    argv = ["bench", "--prompts", str(_prompt_file(tmp_path)), "--limit", "2", "--max-new-tokens", "5",
            "--warmup-tokens", "2", "--methods", "pld", "--repeats", "2", "--out", str(bench), "--no-progress"]
    assert cmd_bench(build_parser().parse_args(argv), loaded=tiny_prepared) == 0
    printed = capsys.readouterr()
    doc = json.loads((bench / "bench.json").read_text())
    models = doc["models"]
    assert set(models) == {"model", "fp32"}
    assert models["model"]["dtype"] == "bfloat16 prepared" and models["fp32"]["dtype"] == "float32"
    assert 0 < models["model"]["weight_bytes"] < models["fp32"]["weight_bytes"]
    assert models["model"]["relative_cost_16"] == pytest.approx(1.5)  # the fixture's curve, both models
    assert models["fp32"]["relative_cost_16"] == pytest.approx(1.5)
    assert doc["peak_rss_mb"] > 0 and doc["environment"]["dtype"] == "bfloat16 prepared"
    pld = next(r for r in doc["rows"] if r["task"] == "overall" and r["label"] == "pld BC=30")
    assert len(pld["vs_fp32"]) == 2 and pld["vs_fp32_min"] <= pld["vs_fp32_median"] <= pld["vs_fp32_max"]
    md = (bench / "bench.md").read_text()
    assert "x generate fp32 median | min | max |" in md and "peak memory: " in md
    assert md.count("c(16)/c(1) = 1.50") == 2 and "cost curve: " in md
    assert "peak memory: " in printed.out and printed.out.count("c(16)/c(1) = 1.50") == 2

    batches = tmp_path / "batches"
    argv = ["bench", "--prompts", str(_prompt_file(tmp_path)), "--limit", "2", "--max-new-tokens", "5", "--batch",
            "1,2", "--out", str(batches), "--no-progress"]
    assert cmd_bench(build_parser().parse_args(argv), loaded=tiny_prepared) == 0
    printed = capsys.readouterr().out
    doc = json.loads((batches / "bench.json").read_text())
    assert [(r["batch"], r["batches"], r["identical"]) for r in doc["batches"]] == [(1, 3, 3), (2, 1, 1)]  # exact
    for r in doc["batches"]:  # float32 may round a near-tie of the random model the other way
        assert r["speedup_vs_fp32_low"] <= r["speedup_vs_fp32_high"] and r["fp32_tokens_per_second"] > 0
        assert 0 <= r["fp32_identical"] <= r["batches"]
    assert "float32 model.generate (" in printed and "x generate fp32" in printed
    md = (batches / "bench.md").read_text()
    assert "| x generate fp32 [95% interval] |" in md and "peak memory: " in md


def test_batches_without_a_reference_have_no_float32_figures(tiny):
    from probe_mtp import ProbeDecoder
    from probe_mtp.report.batches import markdown_batch_table, measure_batches

    model, tokenizer = tiny
    with torch.no_grad():
        rows = measure_batches(model, ProbeDecoder(model, tokenizer), [torch.tensor([[1, 2, 3]])] * 2, [2], 3)
    assert rows[0].fp32 is None and rows[0].as_dict()["speedup_vs_fp32"] is None
    assert "fp32" not in markdown_batch_table(rows)
