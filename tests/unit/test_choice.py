"""``dtype="auto"``'s choice (probe_mtp.choice): the criterion on given cost curves, the one log line
and what describe() says, the disk cache (a second load measures nothing and loads only the chosen
configuration), and the refusals (a model optimize refuses, a processor whose oneDNN runs no bf16,
a device other than the CPU).  Tiny random Llamas and given curves: nothing here is timed."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import probe_mtp
from probe_mtp import choice as auto
from probe_mtp.choice import (CONFIDENT_SHARE, CONFIDENT_TAU, PACKED_WIDE_FP32, PACKED_WIDE_FP32_ONEDNN,
                              PREPARED_BF16, PREPARED_FP32, PROMPT_RATIOS, STOCK_FP32, WEAK_TAU, AutoChoice, Candidate,
                              Loader, choose, load_fastest, seconds_per_token, shortfalls)
from probe_mtp.cost import CostCurve
from probe_mtp.kernels import Processor, processor
from probe_mtp.optimize import AUTO_ATTRIBUTE
from probe_mtp.wide import wide_kernel

# every linear layer 64 x 64: optimize checks one weight shape (each shape costs it about a second)
STD = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
           vocab_size=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=None, eos_token_id=None)
WHERE = "Test CPU (AMX), 2 threads"


def curve(ms: dict) -> CostCurve:
    return CostCurve.from_mapping({n: t / 1e3 for n, t in ms.items()}, label="given")


# made up, shaped like the Xeon's (design.md section 10): stock float32 steep, prepared bf16 flat
STEEP = curve({1: 34.0, 2: 50.0, 4: 52.0, 8: 63.0, 16: 69.0, 32: 84.0})
PACKED_FP32 = curve({1: 31.0, 2: 42.0, 4: 45.0, 8: 52.0, 16: 60.0, 32: 78.0})
FLAT_BF16 = curve({1: 32.0, 2: 36.0, 4: 38.0, 8: 39.0, 16: 41.0, 32: 49.0})
# bf16 without bf16 units (an AVX2 processor, scripts/cost_curves.py): a lone row padded to two, wide
# passes computed slowly; the first as SmolLM2's, the second as Gemma 3's (the output layer dominates)
SLOW_WIDE_BF16 = curve({1: 53.0, 2: 52.7, 4: 64.0, 8: 98.5, 16: 174.0, 32: 310.0})
GEMMA_LIKE_BF16 = curve({1: 63.0, 2: 61.3, 4: 90.5, 8: 150.6, 16: 266.7, 32: 505.9})
GEMMA_LIKE_FP32 = curve({1: 61.5, 2: 95.2, 4: 99.2, 8: 106.5, 16: 131.1, 32: 191.4})


WIDE = (PACKED_WIDE_FP32, PACKED_WIDE_FP32_ONEDNN)
ALL = [STOCK_FP32, *WIDE, PREPARED_BF16, PREPARED_FP32]


def tiny(config: str = "LlamaConfig", dtype: torch.dtype = torch.float32, **kwargs):
    torch.manual_seed(0)
    config = getattr(transformers, config)(**{**STD, **kwargs})
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().to(dtype)


class Curves:
    """A stand-in for measuring: the given curve of each configuration, counted per call."""

    def __init__(self, **by_name: CostCurve):
        self.by_name = by_name
        self.measured: list[str] = []

    def __call__(self, model) -> CostCurve:
        name = configuration(model)
        self.measured.append(name)
        return self.by_name[name]


def configuration(model) -> str:
    if probe_mtp.is_packed_wide(model):
        return PACKED_WIDE_FP32_ONEDNN if wide_kernel(model) == "onednn" else PACKED_WIDE_FP32
    if not probe_mtp.is_optimized(model):
        return STOCK_FP32
    return PREPARED_BF16 if model.dtype == torch.bfloat16 else PREPARED_FP32


def loader(tmp_path, curves: Curves, config: str = "LlamaConfig", device: str = "cpu", cpu: Processor | None = None,
           **kwargs) -> Loader:
    def load(dtype):
        return tiny(config, dtype, **kwargs), None

    watch = kwargs.pop("watch", None)  # measured once, unwatched (the test processes contend for the cores)
    return Loader(load, {"source": f"tiny {config}"}, torch.device(device), "sdpa", curves, tmp_path, None,
                  cpu=cpu or processor(), watch=watch)


def auto_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "probe_mtp" and r.getMessage().startswith("dtype auto")]


# ------------------------------------------------------------------------------- the criterion
def test_seconds_per_token_mixes_narrow_steps_with_confident_wide_ones_and_plain_decoding_is_the_floor():
    """Most steps run the narrow pass that costs least per token (one input, or two accepting 1.3
    tokens); CONFIDENT_SHARE of them the width that suits the curve, accepting CONFIDENT_TAU tokens:
    a curve whose one-input pass is dear pays on every step."""
    assert CONFIDENT_SHARE == 0.3 and CONFIDENT_TAU == {2: 1.9, 4: 2.3, 8: 2.9, 16: 3.3, 32: 3.6}
    assert WEAK_TAU == {1: 1.0, 2: 1.3}
    assert seconds_per_token(STEEP) == pytest.approx(((0.7 * 34.0 + 0.3 * 69.0) / (0.7 + 0.3 * 3.3) / 1e3, 16, 1))
    # a two-input pass costing under 1.3 one-input passes: the weak steps take it
    assert seconds_per_token(FLAT_BF16) == pytest.approx(
        ((0.7 * 36.0 + 0.3 * 41.0) / (0.7 * 1.3 + 0.3 * 3.3) / 1e3, 16, 2))
    very_steep = curve({1: 30.0, 2: 60.0, 4: 80.0, 8: 120.0, 16: 200.0, 32: 400.0})
    assert seconds_per_token(very_steep) == pytest.approx((30.0 / 1e3, 0, 1))  # no wide pass pays: plain decoding
    assert seconds_per_token(very_steep).describe() == "plain, N=1"
    # pack_wide by oneDNN on the AMD EPYC held to AVX2: lone rows stock, pairs packed and cheaper
    cheaper_pairs = curve(EPYC_AVX2_SMOLLM2[PACKED_WIDE_FP32_ONEDNN])
    found = seconds_per_token(cheaper_pairs)
    assert (found.wide, found.narrow) == (8, 2) and found.describe() == "N=8, weak steps at N=2"
    assert found.seconds == pytest.approx((0.7 * 44.3 + 0.3 * 57.7) / (0.7 * 1.3 + 0.3 * 2.9) / 1e3)


# dtype auto's curves (ms) and prompt reading (ms a token) on the 2-core AMD EPYC held to AVX2, SmolLM2
# (docs/benchmarks.md, 2026-12-06): prepared bf16 halves the one-input pass and reads prompts at a
# third of float32's speed; the default decoder ran 1.32x float32 generate with it (summarization
# 0.87x) and 1.69x with float32 packed for wide passes by oneDNN (every task 1.44x or more)
EPYC_AVX2_SMOLLM2 = {
    STOCK_FP32: {1: 57.8, 2: 88.4, 4: 80.1, 8: 78.2, 16: 90.5, 32: 123.3, 64: 184.8},
    PACKED_WIDE_FP32: {1: 58.7, 2: 76.3, 4: 83.0, 8: 94.5, 16: 108.8, 32: 138.2, 64: 197.7},
    PACKED_WIDE_FP32_ONEDNN: {1: 57.8, 2: 44.3, 4: 50.0, 8: 57.7, 16: 74.2, 32: 107.1, 64: 175.7},
    PREPARED_BF16: {1: 30.8, 2: 38.5, 4: 55.6, 8: 90.3, 16: 159.3, 32: 294.2, 64: 569.3},
    PREPARED_FP32: {1: 95.2, 2: 96.2, 4: 96.8, 8: 97.0, 16: 116.6, 32: 161.6, 64: 254.8}}
EPYC_AVX2_SMOLLM2_PROMPT = {STOCK_FP32: 2.72, PACKED_WIDE_FP32: 2.93, PACKED_WIDE_FP32_ONEDNN: 2.2,
                            PREPARED_BF16: 7.1, PREPARED_FP32: 3.71}


def test_the_least_worst_shortfall_over_prompt_ratios_wins_and_the_reason_names_every_candidate():
    found = choose([Candidate(STOCK_FP32, STEEP), Candidate(PREPARED_BF16, FLAT_BF16),
                    Candidate(PREPARED_FP32, PACKED_FP32)], WHERE)
    assert found.name == PREPARED_BF16 and found.dtype == torch.bfloat16 and found.prepared
    assert PROMPT_RATIOS == (0.5, 1.0, 2.0, 4.0, 8.0)
    assert found.reason == (
        "the fastest from 0.5 to 8 prompt tokens per new token, expected 20.2-27.9 ms/token: decoding at c(2) "
        "36.0 ms, 30% of steps at N=16 (c(16) 41.0 ms / tau 3.3), prompts at 1.0 ms a token; against stock "
        "float32 26.3 ms/token (N=16) + 1.8 ms a prompt token, up to 38% behind, prepared float32 23.5 ms/token "
        "(N=16) + 1.8 ms a prompt token, up to 35% behind; Test CPU (AMX), 2 threads")
    assert "\n" not in found.line()
    no_bf16 = choose([Candidate(STOCK_FP32, STEEP), Candidate(PREPARED_BF16, refused="oneDNN runs no bf16 here"),
                      Candidate(PREPARED_FP32, PACKED_FP32)], WHERE)
    assert no_bf16.name == PREPARED_FP32 and no_bf16.dtype == torch.float32 and no_bf16.prepared
    assert "prepared bfloat16 not measured (oneDNN runs no bf16 here)" in no_bf16.reason
    slow_prepared = choose([Candidate(STOCK_FP32, STEEP), Candidate(PREPARED_FP32, curve({1: 90.0, 32: 400.0}))], WHERE)
    assert slow_prepared.name == STOCK_FP32 and not slow_prepared.prepared
    tie = choose([Candidate(STOCK_FP32, STEEP), Candidate(PREPARED_FP32, STEEP)], WHERE)
    assert tie.name == STOCK_FP32 and tie.reason.startswith("the fastest from 0.5 to 8")  # the stock model
    assert "prepared float32 26.3 ms/token (N=16) + 1.8 ms a prompt token, up to 5% behind" in tie.reason
    a_little_faster = curve({n: t * 0.96 for n, t in zip(STEEP.sizes, (s * 1e3 for s in STEEP.seconds))})
    assert choose([Candidate(PREPARED_BF16, a_little_faster), Candidate(STOCK_FP32, STEEP)], WHERE).name == STOCK_FP32
    faster = curve({n: t * 0.9 for n, t in zip(STEEP.sizes, (s * 1e3 for s in STEEP.seconds))})
    assert choose([Candidate(PREPARED_BF16, faster), Candidate(STOCK_FP32, STEEP)], WHERE).name == PREPARED_BF16
    # the Xeon held to AVX2, Gemma 3 (docs/benchmarks.md, 2026-12-05): float32 packed by MKL ran 1.70x float32
    # generate, stock float32 1.46x; prepared float32's one-input pass costs 1.5x stock's.  Prompts: 2.5 ms a token
    # as measured there for MKL's packing, the other float32 configurations taken as alike; bf16's from its curve
    xeon = {STOCK_FP32: {1: 56.1, 2: 98.7, 4: 104.8, 8: 114.4, 16: 136.5, 32: 186.7, 64: 270.1},
            PACKED_WIDE_FP32: {1: 56.7, 2: 69.2, 4: 75.2, 8: 86.6, 16: 110.5, 32: 204.3, 64: 337.9},
            PACKED_WIDE_FP32_ONEDNN: {1: 57.8, 2: 87.9, 4: 97.2, 8: 116.5, 16: 134.5, 32: 232.5, 64: 370.2},
            PREPARED_BF16: {1: 63.2, 2: 78.1, 4: 114.5, 8: 168.3, 16: 275.2, 32: 520.3, 64: 1003.3},
            PREPARED_FP32: {1: 81.7, 2: 82.8, 4: 85.7, 8: 89.0, 16: 112.6, 32: 208.5, 64: 301.8}}
    on_xeon = [Candidate(name, curve(ms), prompt=None if name == PREPARED_BF16 else 0.0025)
               for name, ms in xeon.items()]
    assert choose(on_xeon, WHERE).name == PACKED_WIDE_FP32


def test_a_configuration_slow_on_long_prompts_loses_to_one_a_little_slower_on_short_ones():
    """The AMD EPYC held to AVX2 (SmolLM2, as measured): prepared bf16 is expected to decode fastest, but
    it reads prompts at a third of float32's speed, and at 8 prompt tokens per new token (summarization,
    RAG) it falls far behind float32 packed by oneDNN, which is chosen."""
    candidates = [Candidate(name, curve(ms), prompt=EPYC_AVX2_SMOLLM2_PROMPT[name] / 1e3)
                  for name, ms in EPYC_AVX2_SMOLLM2.items()]
    by_name = {c.name: c for c in candidates}
    bf16, packed = by_name[PREPARED_BF16], by_name[PACKED_WIDE_FP32_ONEDNN]
    assert bf16.decoding().seconds < packed.decoding().seconds and bf16.expected(8.0) > 1.5 * packed.expected(8.0)
    behind = shortfalls(candidates)
    assert behind[PACKED_WIDE_FP32_ONEDNN] < 0.05 and behind[PREPARED_BF16] > 0.5
    found = choose(candidates, WHERE)
    assert found.name == PACKED_WIDE_FP32_ONEDNN and not found.prepared and found.dtype == torch.float32
    bf16_line = "prepared bfloat16 26.0 ms/token (N=2, weak steps at N=2) + 7.1 ms a prompt token"
    assert f"{bf16_line}, up to {behind[PREPARED_BF16]:.0%} behind" in found.reason


def test_prompt_reading_as_measured_replaces_the_curves_estimate():
    """The curve's 64-input pass computes logits at every input; a prompt pass only at its last, so
    where the output layer is dear when wide (bf16 without bf16 units) the curve overcharges prompt
    reading.  A candidate's measured prompt cost, where given, is what it is charged."""
    dear_wide = curve({1: 30.0, 2: 50.0, 4: 70.0, 8: 110.0, 16: 190.0, 32: 350.0, 64: 670.0})
    estimated = Candidate(PREPARED_BF16, dear_wide)
    measured = Candidate(PREPARED_BF16, dear_wide, prompt=0.002)
    assert estimated.prompt_seconds() == pytest.approx(0.670 / 64)
    assert measured.expected(2.0) == pytest.approx(estimated.expected(2.0) - 2.0 * (0.670 / 64 - 0.002))
    assert choose([Candidate(STOCK_FP32, STEEP), estimated], WHERE).name == STOCK_FP32
    found = choose([Candidate(STOCK_FP32, STEEP, prompt=0.004), measured], WHERE)
    assert found.name == PREPARED_BF16 and "prompts at 2.0 ms a token" in found.reason
    again = Candidate.from_dict(json.loads(json.dumps(measured.as_dict())))
    assert again == measured


def test_auto_measures_each_candidates_prompt_reading_when_asked(tmp_path):
    given = {STOCK_FP32: STEEP, PREPARED_FP32: PACKED_FP32, PREPARED_BF16: FLAT_BF16, PACKED_WIDE_FP32: STEEP,
             PACKED_WIDE_FP32_ONEDNN: STEEP}
    prompts = []

    def prompt(model):
        prompts.append(configuration(model))
        return 0.001

    first = loader(tmp_path, Curves(**given), cpu=Processor("Test CPU", frozenset({"amx_bf16"}), True))
    first.measure_prompt = prompt
    model, _ = load_fastest(first)
    assert sorted(prompts) == sorted(ALL)
    kept = model.__dict__[AUTO_ATTRIBUTE]
    assert all(c.prompt == 0.001 for c in kept.candidates if c.curve is not None)


def test_prompt_reading_is_measured_with_logits_at_the_last_input_only():
    """On a real (tiny) model: a positive time per prompt token, from a pass whose output layer ran
    on one row (counted by a hook on it)."""
    model = tiny(vocab_size=512)
    rows = []
    model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[-2]))
    seconds = auto.measure_prompt_reading(model)
    assert 0 < seconds < 1 and rows and set(rows) == {1}


def test_a_choice_round_trips_through_its_dictionary():
    found = choose([Candidate(STOCK_FP32, STEEP), Candidate(PREPARED_BF16, refused="no")], WHERE)
    again = AutoChoice.from_dict(json.loads(json.dumps(found.as_dict())), "somewhere.json")
    assert (again.name, again.reason, again.candidates, again.cached, again.path) == (
        found.name, found.reason, found.candidates, True, "somewhere.json")


# ------------------------------------------------------------------------------- loading, the cache
@pytest.mark.cpu_only  # prepares on this processor
@pytest.mark.parametrize("winner", [PREPARED_BF16, PREPARED_FP32, STOCK_FP32, *WIDE])
def test_auto_loads_the_winner_says_why_once_and_later_loads_measure_nothing(tmp_path, caplog, winner):
    given = {STOCK_FP32: STEEP, PREPARED_FP32: PACKED_FP32, PREPARED_BF16: FLAT_BF16, PACKED_WIDE_FP32: STEEP,
             PACKED_WIDE_FP32_ONEDNN: STEEP}
    given[winner] = curve({1: 10.0, 32: 12.0})  # whichever is to win is far faster
    curves = Curves(**given)
    first = loader(tmp_path, curves, cpu=Processor("Test CPU", frozenset({"amx_bf16"}), True))
    with caplog.at_level(logging.INFO, logger="probe_mtp"):
        model, _ = load_fastest(first)
    assert configuration(model) == winner
    assert sorted(curves.measured) == sorted(ALL)
    # float32 loaded once; stock or packed float32 after the float32 model was prepared in place: loaded again
    assert first.loads == [torch.float32] * (2 if winner in (STOCK_FP32, *WIDE) else 1)
    lines = auto_lines(caplog)
    assert len(lines) == 1 and lines[0].startswith(f"dtype auto: {winner} (the fastest from 0.5 to 8 ")
    assert "curves measured now in" in lines[0] and str(tmp_path) in lines[0]
    assert not [r for r in caplog.records if r.getMessage().startswith("probe_mtp.optimize")]  # one line only
    assert f"; chosen by dtype auto: {winner} (the fastest " in probe_mtp.describe(model)
    assert len(list(tmp_path.glob("dtype-choice-*.json"))) == 1

    caplog.clear()
    again = loader(tmp_path, curves, cpu=first.cpu)
    with caplog.at_level(logging.INFO, logger="probe_mtp"):
        model, _ = load_fastest(again)
    assert len(curves.measured) == len(ALL)  # nothing measured again
    assert again.loads == [torch.bfloat16 if winner == PREPARED_BF16 else torch.float32]  # only the winner
    assert configuration(model) == winner
    lines = auto_lines(caplog)
    assert len(lines) == 1 and "curves measured at the first load" in lines[0] and "read from" in lines[0]


def test_the_cache_folder_is_probe_mtp_cache_dir_and_a_damaged_file_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("PROBE_MTP_CACHE_DIR", str(tmp_path / "cache"))
    curves = Curves(**{STOCK_FP32: STEEP, PREPARED_FP32: PACKED_FP32, PREPARED_BF16: FLAT_BF16,
                       PACKED_WIDE_FP32: STEEP, PACKED_WIDE_FP32_ONEDNN: STEEP})
    load_fastest(loader(None, curves))
    (kept,) = (tmp_path / "cache").glob("dtype-choice-*.json")
    kept.write_text("{not json")
    load_fastest(loader(None, curves))
    assert len(curves.measured) == 2 * len(set(curves.measured))  # measured again, and written again
    assert json.loads(kept.read_text())["format"] == auto.CHOICE_FORMAT


def test_a_configuration_measured_while_other_work_took_its_cores_is_measured_again(tmp_path):
    """The watch says other work took the cores: that configuration is measured again, up to
    MEASURE_TRIES times, each size keeping its fastest time; a try found quiet ends it, and one
    that never is says so in the candidate's summary and, when it wins, in the choice's reason."""
    slow_first = {STOCK_FP32: [curve({1: 90.0, 32: 200.0}), curve({1: 40.0, 32: 300.0})]}
    busy = {STOCK_FP32: [0.4, 0.0], PREPARED_BF16: [0.5, 0.3, 0.2]}
    tries: list[str] = []

    class Measure(Curves):
        def __call__(self, model):
            name = configuration(model)
            self.measured.append(name)
            found = slow_first.get(name)
            return found[self.measured.count(name) - 1] if found else self.by_name[name]

    def watch(run, threads):  # the share other work took in this try of the configuration just measured
        result = run()
        return result, busy.get(tries[-1], [0.0])[tries.count(tries[-1]) - 1]

    measure = Measure(**{STOCK_FP32: None, PREPARED_FP32: PACKED_FP32, PREPARED_BF16: curve({1: 5.0, 32: 9.0}),
                         PACKED_WIDE_FP32: STEEP, PACKED_WIDE_FP32_ONEDNN: STEEP})

    def counted(model):  # the measure call records which configuration the watch is watching
        tries.append(configuration(model))
        return measure(model)

    found = loader(tmp_path, counted, watch=watch, cpu=Processor("Test CPU", frozenset({"amx_bf16"}), True))
    model, _ = load_fastest(found)
    assert tries.count(STOCK_FP32) == 2 and tries.count(PREPARED_BF16) == auto.MEASURE_TRIES
    assert tries.count(PREPARED_FP32) == 1 and tries.count(PACKED_WIDE_FP32) == 1  # quiet at once
    choice = model.__dict__[AUTO_ATTRIBUTE]
    stock = next(c for c in choice.candidates if c.name == STOCK_FP32)
    assert stock.curve.seconds == curve({1: 40.0, 32: 200.0}).seconds and stock.contended is None
    bf16 = next(c for c in choice.candidates if c.name == PREPARED_BF16)
    assert bf16.contended == pytest.approx(0.2) and choice.name == PREPARED_BF16
    assert "(measured while other work took 20% of its cores)" in choice.reason
    assert "measured while other work" not in stock.summary()
    assert Candidate.from_dict(json.loads(json.dumps(bf16.as_dict()))) == bf16


def test_the_fastest_of_two_curves_is_taken_size_by_size():
    fastest = auto.fastest_of(curve({1: 9.0, 8: 10.0}), curve({1: 7.0, 8: 12.0}))
    assert fastest.seconds == curve({1: 7.0, 8: 10.0}).seconds
    with pytest.raises(ValueError, match="same sizes"):
        auto.fastest_of(curve({1: 9.0, 8: 10.0}), curve({1: 7.0, 16: 12.0}))


def test_the_key_names_the_model_processor_torch_and_threads():
    key = auto.choice_key({"source": "m"}, "sdpa", torch.device("cpu"), processor())
    assert key["model"] == {"source": "m"} and key["processor"] == processor().name
    assert key["torch"] == torch.__version__ and key["threads"] == torch.get_num_threads()
    other = Processor("Another CPU", frozenset(), False)
    assert auto.choice_path(key) != auto.choice_path(auto.choice_key({"source": "m"}, "sdpa", torch.device("cpu"), other))


def test_kernels_held_back_by_the_environment_keep_their_own_choice(monkeypatch):
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "MKL_CBWR"):
        monkeypatch.delenv(name, raising=False)
    plain = auto.choice_key({"source": "m"}, "sdpa", torch.device("cpu"), processor())
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    held = auto.choice_key({"source": "m"}, "sdpa", torch.device("cpu"), processor())
    assert held["kernel_environment"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"} and plain["kernel_environment"] == {}
    assert auto.choice_path(held) != auto.choice_path(plain)


# ------------------------------------------------------------------------------- refusals
def test_a_model_optimize_refuses_stays_stock_float32_with_the_reason(tmp_path, caplog):
    curves = Curves(**{STOCK_FP32: STEEP, PACKED_WIDE_FP32: STEEP, PACKED_WIDE_FP32_ONEDNN: STEEP})
    moe = loader(tmp_path, curves, "Qwen3MoeConfig", head_dim=16, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=64)
    with caplog.at_level(logging.INFO, logger="probe_mtp"):
        model, _ = load_fastest(moe)
    assert configuration(model) == STOCK_FP32 and model.dtype == torch.float32
    # prepared ones refused: not loaded again; packed for wide passes measured (its attention and MLPs' linear layers)
    assert curves.measured == [STOCK_FP32, *WIDE] and moe.loads == [torch.float32]
    (line,) = auto_lines(caplog)
    assert line.startswith("dtype auto: stock float32 (the fastest from 0.5 to 8 prompt tokens per new token, expected "
                           "27.2-40.6 ms/token: decoding at c(1) 34.0 ms, 30% of steps at N=16")
    assert "prepared float32 not measured (Qwen3MoeForCausalLM computes with weights outside linear layers" in line
    assert "prepared bfloat16 not measured (Qwen3MoeForCausalLM computes with weights outside" in line


@pytest.mark.cpu_only  # prepares on this processor
@pytest.mark.parametrize("bf16, fp32, winner", [
    (SLOW_WIDE_BF16, STEEP, STOCK_FP32),
    (GEMMA_LIKE_BF16, GEMMA_LIKE_FP32, STOCK_FP32),
    (curve({n: 0.6 * t * 1e3 for n, t in zip(GEMMA_LIKE_FP32.sizes, GEMMA_LIKE_FP32.seconds)}), GEMMA_LIKE_FP32,
     PREPARED_BF16)])
def test_without_bf16_units_bf16_is_measured_too_and_kept_where_it_wins(tmp_path, bf16, fp32, winner):
    """bf16 halves a pass bound by reading the weights; without bf16 units it is slow when wide,
    prompts included, so it wins only where it is faster overall.  The curves as measured on the
    Xeon held to AVX2: SmolLM2 and Gemma 3 keep float32 (Gemma 3 in prepared bf16 decoded at 2.08
    tokens a pass yet ran 0.96x float32 generate, its long prompts read slowly); a curve 0.6x
    float32's everywhere takes bf16."""
    curves = Curves(**{STOCK_FP32: fp32, PREPARED_FP32: curve({1: 80.0, 32: 400.0}), PREPARED_BF16: bf16,
                       PACKED_WIDE_FP32: fp32, PACKED_WIDE_FP32_ONEDNN: fp32})
    old = loader(tmp_path, curves, cpu=Processor("Old CPU", frozenset(), False))
    model, _ = load_fastest(old)
    assert configuration(model) == winner
    assert sorted(curves.measured) == sorted(ALL)
    assert "Old CPU (no bf16 matrix units), " in probe_mtp.describe(model)


def test_a_kept_choice_refused_at_load_falls_back_to_stock_float32(tmp_path):
    """A choice kept for a model that optimize refuses now (a file of an older release): stock
    float32, saying why, never a failure."""
    curves = Curves()
    moe = loader(tmp_path, curves, "Qwen3MoeConfig", head_dim=16, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=64)
    key = auto.choice_key(moe.identity, moe.attn_implementation, moe.device, moe.cpu)
    auto.write_choice(key, AutoChoice(PREPARED_BF16, "kept earlier", (Candidate(PREPARED_BF16, FLAT_BF16),), 1.0),
                      tmp_path)
    model, _ = load_fastest(moe)
    assert configuration(model) == STOCK_FP32 and model.dtype == torch.float32 and curves.measured == []
    assert moe.loads == [torch.bfloat16, torch.float32]
    assert "the kept choice, prepared bfloat16, was refused now: Qwen3MoeForCausalLM" in probe_mtp.describe(model)


def test_off_the_cpu_auto_is_float32_without_measuring(tmp_path, caplog):
    curves = Curves()
    with caplog.at_level(logging.INFO, logger="probe_mtp"):
        model, _ = load_fastest(loader(tmp_path, curves, device="cuda"))
    assert configuration(model) == STOCK_FP32 and curves.measured == []
    (line,) = auto_lines(caplog)
    assert line.startswith("dtype auto: stock float32 (on cuda: ") and "probe_mtp.optimize(model)" in line
    assert not list(tmp_path.glob("dtype-choice-*.json"))


def test_preparing_a_model_auto_loaded_drops_the_note():
    """describe() reports what dtype auto chose only while that still describes the model."""
    model = tiny()
    model.__dict__[AUTO_ATTRIBUTE] = AutoChoice(STOCK_FP32, "kept earlier")
    assert probe_mtp.describe(model).endswith("; chosen by dtype auto: stock float32 (kept earlier)")
    probe_mtp.optimize(model, torch.float32)
    assert "dtype auto" not in probe_mtp.describe(model)


def test_without_mkl_packed_float32_by_mkl_is_not_measured_and_a_kept_mkl_choice_loads_stock(tmp_path, monkeypatch):
    """Where this torch carries no MKL (macOS, ARM), packing by MKL is refused with the reason, never
    attempted; oneDNN's packing is measured instead, and wins where it is faster.  A choice of MKL's
    packing kept by another build loads stock float32, saying why."""
    from probe_mtp import mkl_gemm

    monkeypatch.setattr(mkl_gemm, "available", lambda: False)
    curves = Curves(**{STOCK_FP32: STEEP, PREPARED_BF16: curve({1: 90.0, 32: 400.0}),
                       PREPARED_FP32: curve({1: 90.0, 32: 400.0}), PACKED_WIDE_FP32_ONEDNN: PACKED_FP32})
    model, _ = load_fastest(loader(tmp_path, curves, cpu=Processor("Test CPU", frozenset({"amx_bf16"}), True)))
    assert configuration(model) == PACKED_WIDE_FP32_ONEDNN and PACKED_WIDE_FP32 not in curves.measured
    assert "float32 packed for wide passes not measured (this torch carries no MKL" in probe_mtp.describe(model)
    assert "packed once by oneDNN (probe_mtp.pack_wide)" in probe_mtp.describe(model)

    other = loader(tmp_path / "other", Curves())
    key = auto.choice_key(other.identity, other.attn_implementation, other.device, other.cpu)
    auto.write_choice(key, AutoChoice(PACKED_WIDE_FP32, "kept earlier", (Candidate(PACKED_WIDE_FP32, STEEP),), 1.0),
                      tmp_path / "other")
    model, _ = load_fastest(other)
    assert configuration(model) == STOCK_FP32 and other.loads == [torch.float32]
    assert "the kept choice, float32 packed for wide passes, was refused now: this torch carries no MKL" in \
        probe_mtp.describe(model)


def test_without_mkl_or_onednn_neither_packing_is_measured(tmp_path, monkeypatch):
    from probe_mtp import mkl_gemm

    monkeypatch.setattr(mkl_gemm, "available", lambda: False)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    curves = Curves(**{STOCK_FP32: STEEP, PREPARED_BF16: curve({1: 90.0, 32: 400.0}),
                       PREPARED_FP32: curve({1: 90.0, 32: 400.0})})
    model, _ = load_fastest(loader(tmp_path, curves, cpu=Processor("Test CPU", frozenset(), False)))
    assert configuration(model) == STOCK_FP32 and not set(WIDE) & set(curves.measured)
    described = probe_mtp.describe(model)
    assert "float32 packed for wide passes by oneDNN not measured (this torch is built without oneDNN" in described
