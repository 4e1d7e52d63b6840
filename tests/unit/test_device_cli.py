"""``--device`` on ``probe-mtp report``, ``bench`` and ``generate``: accepted for the CPU, a device
this machine lacks is a clear error with exit status 2 (before any model is loaded, no
traceback), the device reaches :func:`probe_mtp.load_model`, and a report says where it ran (its
environment, its headers).  Runs on a tiny random Llama."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from probe_mtp.cli import build_parser, main
from probe_mtp.cost import CostCurve
from probe_mtp.loading import available_devices
from probe_mtp.report.batches import left_padded
from probe_mtp.report.cli import cmd_report
from probe_mtp.report.harness import device_fields, device_label
from probe_mtp.report.timing import wall_seconds

COMMANDS = (["report"], ["bench"], ["generate", "Why is the sky blue?"])
MISSING = [d for d in ("cuda", "xpu", "cuda:7") if not any(d in (a, a.split(":")[0]) for a in available_devices())]


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


def _no_model(monkeypatch):
    import probe_mtp.loading

    monkeypatch.setattr(probe_mtp.loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_device_defaults_to_the_cpu_and_takes_any_name(command):
    parser = build_parser()
    assert parser.parse_args(command).device == "cpu"
    assert parser.parse_args(command + ["--device", "cuda:1"]).device == "cuda:1"  # checked when used


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("device", MISSING + ["cudaa"])
def test_a_device_this_machine_lacks_fails_clearly_before_loading(command, device, monkeypatch, capsys, tmp_path):
    _no_model(monkeypatch)
    out = [] if command[0] == "generate" else ["--out", str(tmp_path / "rep")]
    assert _exit_code(command + ["--device", device] + out) == 2
    err = capsys.readouterr().err
    assert err.startswith("probe-mtp: error:") and f"{device!r}" in err and "available: cpu" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_bench_memory_is_measured_on_the_cpu_only(monkeypatch, capsys):
    _no_model(monkeypatch)
    assert _exit_code(["bench", "--device", "cuda", "--memory-tokens", "8", "--out", "-"]) == 2
    assert "--memory-tokens measures the resident memory of CPU processes" in capsys.readouterr().err


def test_the_device_reaches_load_model(monkeypatch, tmp_path):
    import probe_mtp.loading
    from probe_mtp.report.cli import prepare_run

    loads = []

    def fake_load(name, dtype=torch.float32, device="cpu", **kwargs):
        loads.append(device)
        return _tiny_llama(), None

    monkeypatch.setattr(probe_mtp.loading, "load_model", fake_load)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["x"]}) + "\n")
    argv = ["report", "--prompts", str(prompts), "--limit", "1", "--out", "-", "--device", "cpu"]
    prepare_run(build_parser().parse_args(argv))
    assert loads == [torch.device("cpu")]


# --------------------------------------------------------------------------- a run on a tiny model


class CharTokenizer:
    """One token per character, ids 1-13 (15 is EOS), no chat template."""

    chat_template = None

    def __call__(self, text, return_tensors="pt"):
        return {"input_ids": torch.tensor([[1 + ord(c) % 13 for c in text]], device="cpu")}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(i) % 26) for i in ids)


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=16, max_position_embeddings=256,
                         attn_implementation="sdpa", bos_token_id=0, eos_token_id=15, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny(monkeypatch, tmp_path, test_device):
    """A tiny random Llama on the test device, a tokenizer, a fixed cost curve (nothing measured)."""
    import probe_mtp.decoder

    curve = CostCurve((1, 8, 16, 32, 64), (1.0, 1.2, 1.5, 2.0, 3.0))
    monkeypatch.setattr(probe_mtp.decoder, "cost_curve_for", lambda *a, **k: curve)
    monkeypatch.setenv("PROBE_MTP_CACHE_DIR", str(tmp_path / "cache"))
    return _tiny_llama().to(test_device), CharTokenizer()


def test_a_report_says_where_it_ran(tiny, tmp_path, capsys, test_device):
    model, _ = tiny
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [t]}) + "\n"
                               for i, t in enumerate(["abab abab", "tell y y"])))
    out = tmp_path / "rep"
    argv = ["report", "--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "4", "--warmup-tokens", "2",
            "--methods", "none", "--out", str(out), "--no-progress", "--no-plots", "--device", str(test_device)]
    assert cmd_report(build_parser().parse_args(argv), loaded=tiny) == 0
    printed = capsys.readouterr().out
    env = json.loads((out / "report.json").read_text())["environment"]
    assert env["device"] == str(model.device)
    assert (env["accelerator"] is None) == (model.device.type == "cpu")
    label = device_label(env)
    assert f") on {label}, 4 new tokens" in printed and f") on {label}, 4 new tokens" in (out / "summary.md").read_text()


def test_device_labels_name_the_accelerator():
    assert device_label({}) == "cpu"  # a report from before devices were recorded
    assert device_label(device_fields(_tiny_llama())) == "cpu"
    env = {"device": "cuda:0", "accelerator": "cuda: NVIDIA H100 80GB HBM3, capability 9.0, CUDA 12.8"}
    assert device_label(env) == "cuda:0 (NVIDIA H100 80GB HBM3, capability 9.0, CUDA 12.8)"
    assert device_label({"device": "xpu:0", "accelerator": "xpu"}) == "xpu:0"
    assert device_fields(None) == {"device": None, "accelerator": None}


def test_batches_and_timings_are_put_on_the_models_device(test_device):
    ids, mask = left_padded([torch.tensor([[3, 4]]), torch.tensor([[5]])], 0, test_device)
    assert ids.device.type == mask.device.type == torch.device(test_device).type
    assert ids.cpu().tolist() == [[3, 4], [0, 5]] and mask.cpu().tolist() == [[1, 1], [0, 1]]
    result, seconds = wall_seconds(test_device, lambda x: x + 1, 1)
    assert result == 2 and seconds >= 0
