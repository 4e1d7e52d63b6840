"""Aggregation of per-prompt records, per Spec-Bench task and overall.

For a method (a record ``label``) over a set of prompt turns:

- ``tau`` (mean accepted length) = sum of all accepted lengths / number of decoding steps, pooled
  over the turns; the prefill pass and its first token are excluded, as in
  :class:`probe_mtp.decoder.DecodeStats` (None where a record has no accepted lengths);
- ``tokens_per_pass`` = new tokens / forward passes (prefill included);
- ``tokens_per_second`` = new tokens / seconds (prefill included);
- ``speedup_vs_greedy`` / ``speedup_vs_hf_pld`` / ``speedup_vs_fp32`` = total seconds of the
  baseline (``model.generate``, transformers' prompt lookup, ``model.generate`` on the unprepared
  float32 model beside a prepared one: None without its records) over the same prompt turns / total
  seconds of the method (turns the baseline lacks are left out of both sums);
  ``*_low`` / ``*_high``: its 95% interval over prompt turns, a paired percentile bootstrap
  (:func:`ratio_interval`: resample the turns with replacement, the ratio of the summed times of
  each resample; 2000 resamples, seed 0), so the interval reflects how much the speedup varies
  from prompt to prompt (not the timing noise of one turn, which the rotated order spreads);
- ``identical`` = turns whose output equals ``model.generate`` greedy's, out of ``n``;
- ``agreement`` = tokens equal to greedy's at the same position / tokens compared (the longer of
  the two outputs per turn), pooled over the turns: 1.0 for lossless methods, what a lossy rule
  such as ConfAdapt costs otherwise (None where a record lacks the counts).
"""

from __future__ import annotations

import numpy as np

from .baselines import DEFAULT, GREEDY, GREEDY_FP32, HF_PLD

OVERALL = "overall"
INTERVAL_LEVEL = 0.95
RESAMPLES = 2000
INTERVAL_SEED = 0
INTERVAL_METHOD = (
    "95% paired percentile bootstrap over prompt turns: the turns are resampled with replacement "
    f"({RESAMPLES} resamples, seed {INTERVAL_SEED}) and each resample's speedup is the ratio of its summed times"
)


def record_key(r: dict) -> tuple:
    """Which prompt turn a record measures (``ask``: the second ask of a repeated prompt)."""
    return (r["task"], r["category"], r["question_id"], r["turn"], r.get("ask", 1))


def ratio_interval(pairs: list[tuple[float, float]], level: float = INTERVAL_LEVEL, resamples: int = RESAMPLES,
                   seed: int = INTERVAL_SEED) -> tuple[float, float] | None:
    """The ``level`` interval of ``sum(baseline) / sum(method)`` over ``pairs`` of
    ``(baseline seconds, method seconds)``, one pair per prompt turn: a paired percentile bootstrap
    (resample the turns with replacement, ratio of the sums).  None for fewer than two pairs (one
    turn says nothing of how the speedup varies between prompts)."""
    if len(pairs) < 2:
        return None
    base = np.array([b for b, _ in pairs], dtype=float)
    own = np.array([m for _, m in pairs], dtype=float)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(pairs), size=(resamples, len(pairs)))
    ratios = base[picks].sum(axis=1) / own[picks].sum(axis=1)
    tail = (1.0 - level) / 2
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return float(low), float(high)


def _baseline_seconds(records: list[dict], label: str) -> dict[tuple, float]:
    return {record_key(r): float(r["seconds"]) for r in records if r["label"] == label}


def _ratio(baseline: dict[tuple, float], rs: list[dict]) -> float | None:
    matched = [r for r in rs if record_key(r) in baseline]
    own = sum(float(r["seconds"]) for r in matched)
    if not matched or own <= 0:
        return None
    return sum(baseline[record_key(r)] for r in matched) / own


def _interval(baseline: dict[tuple, float], rs: list[dict]) -> tuple[float | None, float | None]:
    pairs = [(baseline[record_key(r)], float(r["seconds"])) for r in rs if record_key(r) in baseline]
    if any(m <= 0 for _, m in pairs):
        return None, None
    return ratio_interval(pairs) or (None, None)


def aggregate(rs: list[dict], greedy_seconds: dict[tuple, float], pld_seconds: dict[tuple, float],
              fp32_seconds: dict[tuple, float] | None = None) -> dict:
    """One summary row for the records ``rs`` of one method (see the module docstring);
    ``fp32_seconds``: the float32 baseline's seconds per turn (None or empty: no such baseline)."""
    fp32_seconds = fp32_seconds or {}
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
    greedy_low, greedy_high = _interval(greedy_seconds, rs)
    pld_low, pld_high = _interval(pld_seconds, rs)
    fp32_low, fp32_high = _interval(fp32_seconds, rs)
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
        "speedup_vs_greedy_low": greedy_low,
        "speedup_vs_greedy_high": greedy_high,
        "speedup_vs_hf_pld": _ratio(pld_seconds, rs),
        "speedup_vs_hf_pld_low": pld_low,
        "speedup_vs_hf_pld_high": pld_high,
        "speedup_vs_fp32": _ratio(fp32_seconds, rs),
        "speedup_vs_fp32_low": fp32_low,
        "speedup_vs_fp32_high": fp32_high,
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
        fp32 = _baseline_seconds(subset, GREEDY_FP32)
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
                    **aggregate(rs, greedy, pld, fp32),
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


def pass_sizes(records: list[dict]) -> dict[int, int]:
    """``{inputs of a pass: passes}`` over the decoding steps of ``records`` (the prefill left out):
    the budgets an adaptive budget chose."""
    out: dict[int, int] = {}
    for r in records:
        for n in r.get("inputs_per_pass") or []:
            out[int(n)] = out.get(int(n), 0) + 1
    return dict(sorted(out.items()))


def _versus(low, high) -> str:
    """``faster`` / ``slower`` where the interval lies wholly above / below 1, else ``unclear``."""
    if low is None or high is None:
        return "unclear"
    if low > 1:
        return "faster"
    if high < 1:
        return "slower"
    return "unclear"


_PHRASES = {"faster": "faster than {}", "slower": "slower than {}", "unclear": "not clearly faster or slower than {}"}


_ALL = {2: ("both", "either"), 3: ("all three", "any of them")}


def _in_words(versus: list[tuple[str, str]]) -> str:
    """``[("faster", "model.generate"), ...]`` -> ``faster than both`` (``all three``) and the like."""
    kinds = {kind for kind, _ in versus}
    if len(versus) in _ALL and len(kinds) == 1:
        every, each = _ALL[len(versus)]
        return {"faster": f"faster than {every}", "slower": f"slower than {every}",
                "unclear": f"not clearly faster or slower than {each}"}[kinds.pop()]
    return ", ".join(_PHRASES[kind].format(name) for kind, name in versus)


def _span(row: dict, key: str) -> str:
    """`` (95% interval 1.22-1.40)`` for ``row[key]``'s interval, empty without one."""
    low, high = row.get(f"{key}_low"), row.get(f"{key}_high")
    return f" (95% interval {low:.2f}-{high:.2f})" if low is not None and high is not None else ""


def verdict(summary: list[dict], label: str = DEFAULT, memory: str | None = None) -> str | None:
    """The verdict line of the default configuration, from its overall summary row, e.g.
    ``default decoder: 1.31x model.generate (95% interval 1.22-1.40), identical on 12/12; 1.18x
    transformers' prompt lookup: faster than both``.  "Faster" / "slower" only where the 95%
    interval lies wholly above / below 1 (none for a single prompt turn);
    ``memory`` ("warm" / "cold") is named after "default decoder".  With a float32 baseline (a
    prepared model) it adds e.g. ``; 2.10x float32 model.generate (95% interval 1.95-2.25)``.
    None when the summary has no overall row for ``label``."""
    row = next((r for r in summary if r["task"] == OVERALL and r["label"] == label), None)
    if row is None or row["speedup_vs_greedy"] is None:
        return None
    name = "default decoder" if label.startswith(DEFAULT) else label
    if memory:
        name += f" ({memory})"
    span = _span(row, "speedup_vs_greedy")
    text = f"{name}: {row['speedup_vs_greedy']:.2f}x model.generate{span}, identical on {row['identical']}/{row['n']}"
    versus = [(_versus(row.get("speedup_vs_greedy_low"), row.get("speedup_vs_greedy_high")), "model.generate")]
    for key, baseline, interval in (("speedup_vs_hf_pld", "transformers' prompt lookup", False),
                                    ("speedup_vs_fp32", "float32 model.generate", True)):
        if row.get(key) is not None:
            text += f"; {row[key]:.2f}x {baseline}" + (_span(row, key) if interval else "")
            versus.append((_versus(row.get(f"{key}_low"), row.get(f"{key}_high")), baseline))
    return f"{text}: {_in_words(versus)}"


def fp32_agreement(summary: list[dict]) -> str | None:
    """How often ``model.generate`` on the unprepared float32 model gave what it gives on the
    prepared bf16 model (the float32 baseline's overall row), in words; None without that baseline."""
    row = next((r for r in summary if r["task"] == OVERALL and r["label"] == GREEDY_FP32), None)
    if row is None:
        return None
    agreement = row.get("agreement")
    share = f", {agreement:.3f} of tokens equal at the same position" if agreement is not None else ""
    return (f"stock float32 against prepared bf16: model.generate on the float32 model is identical to model.generate "
            f"on the prepared model on {row['identical']}/{row['n']} turns{share} (rounding differences; probe-mtp is "
            "judged against, and exact on, the prepared model)")


DEFAULT_CONFIGURATION = (
    "ProbeDecoder(model, tokenizer), as probe_mtp.generate(model, ids) runs it: drafter 'hybrid', "
    "budget 'auto', masks 'auto', a drafting memory kept across requests"
)


def default_section(records: list[dict], summary: list[dict], labels: list[str]) -> dict | None:
    """report.json's ``default`` section: the default configuration beside the baselines (the
    float32 one too on a prepared model, with ``fp32_agreement``), per task and overall, with the
    verdict line, the budgets the adaptive budget chose, the masks
    and the memory the decoder used."""
    if not labels:
        return None
    rows = [r for r in summary if r["label"] in (GREEDY, HF_PLD, GREEDY_FP32, *labels)]
    runs = {}
    for label in labels:
        mine = [r for r in records if r["label"] == label]
        runs[label] = {
            "budget": _one({r.get("budget") for r in mine}),
            "memory": _one({r.get("memory") for r in mine}),
            "masks": _one({r.get("masks") for r in mine}),
            "pass_sizes": {str(k): v for k, v in pass_sizes(mine).items()},
        }
        runs[label]["verdict"] = verdict(summary, label, runs[label]["memory"])
    first = runs[labels[0]]
    return {
        "configuration": DEFAULT_CONFIGURATION,
        "labels": list(labels),
        "budget": first["budget"],
        "memory": first["memory"],
        "masks": first["masks"],
        "pass_sizes": first["pass_sizes"],
        "verdict": first["verdict"],
        "fp32_agreement": fp32_agreement(summary),
        "runs": runs,
        "interval": INTERVAL_METHOD,
        "summary": rows,
    }


def _one(values: set):
    values.discard(None)
    if not values:
        return None
    return next(iter(values)) if len(values) == 1 else sorted(map(str, values))


def fixed_budget_note(pass_costs: dict) -> str:
    """The sentence under the equal-budget table: why tau above 2 can still be slower than plain
    decoding (with this machine's measured cost of a wide pass, when known)."""
    if pass_costs:
        costs = ", ".join(f"a {bc}-input pass costs {ratio:.1f}x a one-token pass" for bc, ratio in sorted(pass_costs.items()))
        measured = f"on this machine {costs} (its measured cost curve)"
    else:
        measured = "on a CPU a pass over 30 inputs costs roughly 1.5-2.5x a one-token pass"
    return (
        "At a fixed block complexity every step verifies the whole budget in one pass, and "
        f"{measured}: a method beats plain decoding only when its tau (tokens per step) exceeds that cost "
        "ratio plus its drafting time, so tau above 2 can still be slower than model.generate. "
        "The default budget='auto' (first table) sizes every pass to what pays on the machine."
    )


def equal_budget_section(summary: list[dict], labels: list[str], settings: dict, pass_costs: dict) -> dict | None:
    """report.json's ``equal_budget`` section: the methods at a fixed block complexity and the
    cost of such a pass against a one-token pass."""
    if not labels:
        return None
    return {
        "budgets": list(settings.get("budgets") or []),
        "labels": list(labels),
        "pass_cost_relative_to_one_token": {str(k): v for k, v in sorted(pass_costs.items())},
        "note": fixed_budget_note(pass_costs),
    }
