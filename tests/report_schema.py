"""The JSON schema of ``probe-mtp report``'s report.json: the types of its settings, environment,
records and summary rows, and ``check_schema`` (shared by tests/unit/test_report.py and
tests/models/test_report_end_to_end.py)."""

from __future__ import annotations

from probe_mtp.report import GREEDY, GREEDY_FP32, HF_PLD
from probe_mtp.report.harness import SCHEMA
from probe_mtp.report.outputs import RECORD_FIELDS

SETTINGS_TYPES = {
    "model": str,
    "dtype": str,
    "prompts": str,
    "tasks": (list, type(None)),
    "limit": int,
    "max_new_tokens": int,
    "methods": list,
    "budgets": list,
    "num_masks": int,
    "seed": int,
    "warmup_tokens": int,
    "hf_pld_tokens": int,
    "masks": list,
    "acceptance": list,
    "threshold": float,
    "knobs": dict,
    "default": bool,
    "memory": list,
    "stream": str,
    "method_limit": (int, type(None)),
    "full": bool,
}
ENVIRONMENT_TYPES = {
    "dtype": str,  # what the model computed in: "float32", "bfloat16 prepared", ... (settings: what was asked)
    "kernels": str,
    "matrix_units": (str, type(None)),
    "fp32_reference": (str, type(None)),  # the float32 baseline's kernels, beside a prepared model
    "torch_threads": int,
    "torch_interop_threads": int,
    "cpu_count": (int, type(None)),
    "processor": (str, type(None)),
    "python": str,
    "platform": str,
    "torch": str,
    "transformers": str,
    "numpy": str,
    "probe_mtp": str,
    "load_average": (list, type(None)),
    "load_average_after": (list, type(None)),
}
OPT_INT = (int, type(None))
OPT_NUM = (int, float, type(None))
RECORD_TYPES = {
    "method": str,
    "label": str,
    "kind": str,
    "budget": (int, str, type(None)),
    "num_masks": OPT_INT,
    "task": str,
    "category": str,
    "question_id": int,
    "turn": int,
    "ask": int,
    "order": int,
    "prompt_tokens": int,
    "new_tokens": int,
    "forward_passes": OPT_INT,
    "first_pass_tokens": OPT_INT,
    "accepted_lengths": (list, type(None)),
    "mean_accepted_length": OPT_NUM,
    "seconds": (int, float),
    "prefill_seconds": OPT_NUM,
    "forward_seconds": OPT_NUM,
    "inputs_per_pass": (list, type(None)),
    "tokens_per_second": OPT_NUM,
    "identical_to_greedy": bool,
    "first_mismatch": OPT_INT,
    "masks": (str, type(None)),
    "memory": (str, type(None)),
    "acceptance": str,
    "matching_tokens": int,
    "compared_tokens": int,
    "agreement": (int, float),
}
SUMMARY_KEYS = {
    "task", "label", "method", "kind", "budget", "num_masks", "n", "new_tokens", "forward_passes", "steps",
    "tau", "tokens_per_pass", "seconds", "tokens_per_second", "speedup_vs_greedy", "speedup_vs_hf_pld",
    "identical", "all_identical", "agreement", "speedup_vs_greedy_low", "speedup_vs_greedy_high",
    "speedup_vs_hf_pld_low", "speedup_vs_hf_pld_high", "speedup_vs_fp32", "speedup_vs_fp32_low",
    "speedup_vs_fp32_high",
}
DEFAULT_KEYS = {"configuration", "labels", "budget", "memory", "masks", "pass_sizes", "verdict", "fp32_agreement",
                "runs", "interval", "summary"}
BATCH_KEYS = {"batch", "batches", "tokens", "generate_tokens_per_second", "probe_tokens_per_second", "speedup",
              "speedup_low", "speedup_high", "tau", "identical", "fp32_tokens_per_second", "speedup_vs_fp32",
              "speedup_vs_fp32_low", "speedup_vs_fp32_high", "fp32_identical"}
FP32_BATCH_KEYS = {"fp32_tokens_per_second", "speedup_vs_fp32", "speedup_vs_fp32_low", "speedup_vs_fp32_high",
                   "fp32_identical"}
EQUAL_BUDGET_KEYS = {"budgets", "labels", "pass_cost_relative_to_one_token", "note"}


def check_schema(doc: dict) -> None:
    """Every key and type of report.json.  A report on a prepared model with its float32 reference
    (``environment.fp32_reference`` set) has the ``generate fp32`` baseline right after the two
    others, ``speedup_vs_fp32`` in every summary row, the float32 figures of every batch row and
    the agreement sentence; one without has none of them (the keys are there, None)."""
    assert set(doc) == {"schema", "settings", "environment", "started_at", "total_seconds", "methods", "default",
                        "equal_budget", "batches", "memories", "records", "summary"}
    assert doc["schema"] == SCHEMA
    fp32 = doc["environment"]["fp32_reference"] is not None
    for label, m in doc["memories"].items():  # every warm decoder's memory after the stream
        assert label in doc["methods"] and 0 < m["bytes"] <= m["max_bytes"] and m["file_bytes"] > 0
        assert m["save_seconds"] >= 0 and m["load_seconds"] >= 0
    for row in doc["batches"]:  # --batch
        assert set(row) == BATCH_KEYS and row["batch"] >= 1 and row["speedup_low"] <= row["speedup_high"]
        if fp32:
            assert row["speedup_vs_fp32_low"] <= row["speedup_vs_fp32_high"] and row["fp32_identical"] >= 0
        else:
            assert all(row[key] is None for key in FP32_BATCH_KEYS)
    assert isinstance(doc["started_at"], str) and isinstance(doc["total_seconds"], (int, float))
    baselines = [GREEDY, HF_PLD, GREEDY_FP32] if fp32 else [GREEDY, HF_PLD]
    assert doc["methods"][:len(baselines)] == baselines and GREEDY_FP32 not in doc["methods"][len(baselines):]
    for key, types in SETTINGS_TYPES.items():
        assert isinstance(doc["settings"][key], types), key
    assert set(doc["settings"]) == set(SETTINGS_TYPES)
    for key, types in ENVIRONMENT_TYPES.items():
        assert isinstance(doc["environment"][key], types), key
    assert set(RECORD_TYPES) == set(RECORD_FIELDS)
    assert doc["records"]
    for r in doc["records"]:
        assert set(r) == set(RECORD_TYPES)
        for key, types in RECORD_TYPES.items():
            assert isinstance(r[key], types), (key, r[key])
        if r["accepted_lengths"] is not None:
            assert all(isinstance(a, int) and a >= 1 for a in r["accepted_lengths"])
        assert r["label"] in doc["methods"]
    for row in doc["summary"]:
        assert set(row) == SUMMARY_KEYS
        assert (row["speedup_vs_fp32"] is not None) == fp32, row["label"]

    default = doc["default"]
    if doc["settings"]["default"]:
        assert set(default) == DEFAULT_KEYS
        assert default["budget"] == "auto"  # the adaptive budget, never a number it did not use
        assert default["memory"] in ("warm", "cold") or isinstance(default["memory"], list)
        assert isinstance(default["verdict"], str) and default["verdict"].startswith("default decoder")
        assert all(isinstance(k, str) and int(k) >= 1 and v >= 1 for k, v in default["pass_sizes"].items())
        for row in default["summary"]:
            assert set(row) == SUMMARY_KEYS and row["label"] in [*baselines, *default["labels"]]
        assert doc["methods"][len(baselines)] == default["labels"][0]  # the default configuration after the baselines
        assert ("x float32 model.generate" in default["verdict"]) == fp32
        assert isinstance(default["fp32_agreement"], str) == fp32
    else:
        assert default is None
    if doc["equal_budget"] is not None:
        assert set(doc["equal_budget"]) == EQUAL_BUDGET_KEYS
