"""The JSON schema of ``probe-mtp report``'s report.json: the types of its settings, environment,
records and summary rows, and ``check_schema`` (shared by tests/unit/test_report.py and
tests/models/test_report_end_to_end.py)."""

from __future__ import annotations

from probe_mtp.report import GREEDY, HF_PLD
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
}
ENVIRONMENT_TYPES = {
    "torch_threads": int,
    "torch_interop_threads": int,
    "cpu_count": (int, type(None)),
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
    "acceptance": str,
    "matching_tokens": int,
    "compared_tokens": int,
    "agreement": (int, float),
}
SUMMARY_KEYS = {
    "task", "label", "method", "kind", "budget", "num_masks", "n", "new_tokens", "forward_passes", "steps",
    "tau", "tokens_per_pass", "seconds", "tokens_per_second", "speedup_vs_greedy", "speedup_vs_hf_pld",
    "identical", "all_identical", "agreement",
}


def check_schema(doc: dict) -> None:
    assert set(doc) == {"schema", "settings", "environment", "started_at", "total_seconds", "methods", "records", "summary"}
    assert doc["schema"] == SCHEMA
    assert isinstance(doc["started_at"], str) and isinstance(doc["total_seconds"], (int, float))
    assert doc["methods"][:2] == [GREEDY, HF_PLD]
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
