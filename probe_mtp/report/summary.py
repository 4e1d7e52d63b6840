"""Aggregation of per-prompt records, per Spec-Bench task and overall.

For a method (a record ``label``) over a set of prompt turns:

- ``tau`` (mean accepted length) = sum of all accepted lengths / number of decoding steps, pooled
  over the turns; the prefill pass and its first token are excluded, as in
  :class:`probe_mtp.decoder.DecodeStats` (None where a record has no accepted lengths);
- ``tokens_per_pass`` = new tokens / forward passes (prefill included);
- ``tokens_per_second`` = new tokens / seconds (prefill included);
- ``speedup_vs_greedy`` / ``speedup_vs_hf_pld`` = total seconds of the baseline over the same
  prompt turns / total seconds of the method (turns the baseline lacks are left out of both sums);
- ``identical`` = turns whose output equals ``model.generate`` greedy's, out of ``n``;
- ``agreement`` = tokens equal to greedy's at the same position / tokens compared (the longer of
  the two outputs per turn), pooled over the turns: 1.0 for lossless methods, what a lossy rule
  such as ConfAdapt costs otherwise (None where a record lacks the counts).
"""

from __future__ import annotations

from .baselines import GREEDY, HF_PLD

OVERALL = "overall"


def record_key(r: dict) -> tuple:
    """Which prompt turn a record measures."""
    return (r["task"], r["category"], r["question_id"], r["turn"])


def _baseline_seconds(records: list[dict], label: str) -> dict[tuple, float]:
    return {record_key(r): float(r["seconds"]) for r in records if r["label"] == label}


def _ratio(baseline: dict[tuple, float], rs: list[dict]) -> float | None:
    matched = [r for r in rs if record_key(r) in baseline]
    own = sum(float(r["seconds"]) for r in matched)
    if not matched or own <= 0:
        return None
    return sum(baseline[record_key(r)] for r in matched) / own


def aggregate(rs: list[dict], greedy_seconds: dict[tuple, float], pld_seconds: dict[tuple, float]) -> dict:
    """One summary row for the records ``rs`` of one method (see the module docstring)."""
    n = len(rs)
    new_tokens = sum(int(r["new_tokens"]) for r in rs)
    seconds = sum(float(r["seconds"]) for r in rs)
    passes = [r["forward_passes"] for r in rs]
    forward_passes = None if any(p is None for p in passes) else sum(int(p) for p in passes)
    lengths = [r["accepted_lengths"] for r in rs]
    if rs and all(al is not None for al in lengths):
        steps = sum(len(al) for al in lengths)
        accepted = sum(sum(al) for al in lengths)
        tau = accepted / steps if steps else None
    else:
        steps, tau = None, None
    identical = sum(1 for r in rs if r["identical_to_greedy"])
    counts = [(r.get("matching_tokens"), r.get("compared_tokens")) for r in rs]
    agreement = None
    if rs and all(m is not None and c is not None for m, c in counts):
        compared = sum(c for _, c in counts)
        agreement = sum(m for m, _ in counts) / compared if compared else 1.0
    return {
        "n": n,
        "new_tokens": new_tokens,
        "forward_passes": forward_passes,
        "steps": steps,
        "tau": tau,
        "tokens_per_pass": new_tokens / forward_passes if forward_passes else None,
        "seconds": seconds,
        "tokens_per_second": new_tokens / seconds if seconds > 0 else None,
        "speedup_vs_greedy": _ratio(greedy_seconds, rs),
        "speedup_vs_hf_pld": _ratio(pld_seconds, rs),
        "identical": identical,
        "all_identical": identical == n,
        "agreement": agreement,
    }


def _ordered(values) -> list:
    out: list = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


def summarize(records: list[dict], labels: list[str] | None = None) -> list[dict]:
    """Rows ``{task, label, method, budget, num_masks, kind, **aggregate}``: per task in the order
    met, then ``overall``; within each, methods in ``labels`` order (default: order met)."""
    labels = list(labels) if labels else _ordered(r["label"] for r in records)
    labels += [lab for lab in _ordered(r["label"] for r in records) if lab not in labels]
    tasks = _ordered(r["task"] for r in records)
    rows = []
    for task in tasks + [OVERALL]:
        subset = records if task == OVERALL else [r for r in records if r["task"] == task]
        greedy = _baseline_seconds(subset, GREEDY)
        pld = _baseline_seconds(subset, HF_PLD)
        for label in labels:
            rs = [r for r in subset if r["label"] == label]
            if not rs:
                continue
            first = rs[0]
            rows.append(
                {
                    "task": task,
                    "label": label,
                    "method": first["method"],
                    "kind": first.get("kind"),
                    "budget": first.get("budget"),
                    "num_masks": first.get("num_masks"),
                    **aggregate(rs, greedy, pld),
                }
            )
    return rows


def accepted_length_counts(records: list[dict]) -> dict[str, dict[int, int]]:
    """``{label: {accepted length: steps}}`` over all records that carry accepted lengths."""
    out: dict[str, dict[int, int]] = {}
    for r in records:
        if r["accepted_lengths"] is None:
            continue
        hist = out.setdefault(r["label"], {})
        for a in r["accepted_lengths"]:
            hist[int(a)] = hist.get(int(a), 0) + 1
    return out
