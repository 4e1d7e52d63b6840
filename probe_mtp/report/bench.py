"""``probe-mtp bench``: wall-clock speed with its spread, next to the bound the cost curve allows.

The report harness runs every method over the same prompts, prompt-major with a rotated order; the
bench repeats that ``repeats`` times and reports, per task and overall, the median, min and max of
each method's speedup over ``model.generate`` greedy (total time of the task's prompts, ratio taken
within one repetition, so slow phases of a shared machine cancel), and on a prepared model (a float32
reference measured beside it) the same over ``model.generate`` on the float32 model.  For the probe
methods it adds:

- ``overhead``: the share of the decoding steps' time spent outside the model's forward pass;
- ``bound``: the speedup the method's own passes allow on this machine's cost curve, and the share
  of it that was realised.  Each pass is costed at the context it ran at, ``c(N_i, L_i)``; plain
  decoding pays ``c(1, L)`` per token.  The curve's relative costs are put on the scale of the
  method's measured forward time ``F`` (the curve is timed in a tight loop and runs faster than
  passes inside decoding), ``s = F / sum_i c(N_i, L_i)``, and both sides pay the method's measured
  prefill ``P``, since the speedup is measured end to end:

      bound = (P + s * sum_t c(1, L_t)) / (P + F)

  Without the context and the prefill this is ``tau / (c(BC) / c(1))``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from .baselines import GREEDY_FP32
from .harness import GREEDY, HF_PLD, Report
from .summary import record_key

OVERALL = "overall"


@dataclass
class SpeedRow:
    task: str
    label: str
    kind: str
    speedups: list[float]  # one per repetition, over model.generate greedy
    vs_hf_pld: list[float]
    tau: float | None
    overhead: float | None
    bound: float | None
    identical: bool
    vs_fp32: list[float] | None = None  # one per repetition, over model.generate on the float32 model

    @property
    def median(self) -> float:
        return statistics.median(self.speedups)

    def fp32_spread(self) -> tuple[float, float, float] | None:
        """``(median, min, max)`` of the speedups over the float32 model.generate (None without it)."""
        if not self.vs_fp32:
            return None
        return statistics.median(self.vs_fp32), min(self.vs_fp32), max(self.vs_fp32)

    @property
    def lossless_text(self) -> str:
        """``yes`` / ``NO``; ``-`` for the float32 baseline (its differences from the prepared model's
        model.generate are rounding, not a loss)."""
        if self.label == GREEDY_FP32:
            return "-"
        return "yes" if self.identical else "NO"

    @property
    def realised(self) -> float | None:
        return self.median / self.bound if self.bound else None

    def as_dict(self) -> dict:
        fp32 = self.fp32_spread()
        return {
            "task": self.task,
            "label": self.label,
            "kind": self.kind,
            "speedup_median": self.median,
            "speedup_min": min(self.speedups),
            "speedup_max": max(self.speedups),
            "speedups": self.speedups,
            "vs_hf_pld_median": statistics.median(self.vs_hf_pld),
            "tau": self.tau,
            "overhead": self.overhead,
            "bound": self.bound,
            "realised_share_of_bound": self.realised,
            "identical_to_greedy": self.identical,
            "vs_fp32_median": fp32[0] if fp32 else None,
            "vs_fp32_min": fp32[1] if fp32 else None,
            "vs_fp32_max": fp32[2] if fp32 else None,
            "vs_fp32": self.vs_fp32,
        }


def _bound(records: list[dict], curve) -> float | None:
    """The end-to-end speedup bound of ``records`` on ``curve`` (see the module's docstring)."""
    plain = passes_cost = prefill = forward = 0.0
    for r in records:
        passes, accepted = r.get("inputs_per_pass"), r.get("accepted_lengths")
        if not passes or accepted is None or len(accepted) != len(passes):
            return None
        start = int(r["prompt_tokens"])
        contexts = start + np.concatenate([[0], np.cumsum(accepted[:-1])]).astype(int)
        passes_cost += sum(curve.cost(int(n), int(c)) for n, c in zip(passes, contexts))
        plain += sum(curve.cost(1, start + t) for t in range(int(r["new_tokens"]) - 1))
        prefill += r.get("prefill_seconds") or 0.0
        forward += r.get("forward_seconds") or 0.0
    if passes_cost <= 0:
        return None
    if forward <= 0:  # no timings recorded: the curve's own scale
        forward = passes_cost
    return (prefill + forward / passes_cost * plain) / (prefill + forward)


def _overhead(records: list[dict]) -> float | None:
    forward = sum(r.get("forward_seconds") or 0.0 for r in records)
    steps = sum(r["seconds"] - (r.get("prefill_seconds") or 0.0) for r in records)
    if forward <= 0 or steps <= 0:
        return None
    return max(0.0, 1.0 - forward / steps)


def speed_rows(reports: list[Report], curve=None) -> list[SpeedRow]:
    """Per task (and overall) and method: speedups over the repetitions, tau, overhead, bound."""
    first = reports[0]
    labels = first.methods
    fp32 = GREEDY_FP32 in labels
    tasks: list[str] = []
    for r in first.records:
        if r["task"] not in tasks:
            tasks.append(r["task"])
    rows = []
    for task in tasks + [OVERALL]:
        def pick(report, label):
            return [r for r in report.records if r["label"] == label and (task == OVERALL or r["task"] == task)]

        def ratio(rep, baseline, label):
            base = {record_key(r): r["seconds"] for r in pick(rep, baseline)}
            mine = [r for r in pick(rep, label) if record_key(r) in base]
            own = sum(r["seconds"] for r in mine)
            return sum(base[record_key(r)] for r in mine) / own if own > 0 else float("nan")

        for label in labels:
            recs = pick(first, label)
            if not recs:
                continue
            speedups = [ratio(rep, GREEDY, label) for rep in reports]
            vs_pld = [ratio(rep, HF_PLD, label) for rep in reports]
            kind = recs[0]["kind"]
            accepted = [a for r in recs for a in (r["accepted_lengths"] or [])]
            tau = sum(accepted) / len(accepted) if accepted else None
            probe = kind in ("probe", "default")
            rows.append(
                SpeedRow(
                    task,
                    label,
                    kind,
                    speedups,
                    vs_pld,
                    tau,
                    _overhead(recs) if probe else None,
                    _bound(recs, curve) if probe and curve is not None else None,
                    all(r["identical_to_greedy"] for rep in reports for r in pick(rep, label)),
                    [ratio(rep, GREEDY_FP32, label) for rep in reports] if fp32 else None,
                )
            )
    return rows


def rich_speed_table(rows: list[SpeedRow], title: str):
    from rich.table import Table

    table = Table(title=title)
    fp32 = any(row.vs_fp32 for row in rows)
    for col in ("task", "method", "tau", "speedup median [min, max]", "vs hf-pld",
                *(("x generate fp32 median [min, max]",) if fp32 else ()), "overhead", "bound", "of bound", "lossless"):
        table.add_column(col, justify="left" if col in ("task", "method") else "right")
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for row in rows:
        spread = row.fp32_spread()
        table.add_row(
            row.task,
            row.label,
            fmt(row.tau, ".2f"),
            f"{row.median:.2f}x [{min(row.speedups):.2f}, {max(row.speedups):.2f}]",
            f"{statistics.median(row.vs_hf_pld):.2f}x",
            *([f"{spread[0]:.2f}x [{spread[1]:.2f}, {spread[2]:.2f}]" if spread else "-"] if fp32 else []),
            fmt(row.overhead, ".0%"),
            fmt(row.bound, ".2f"),
            fmt(row.realised, ".0%"),
            row.lossless_text,
        )
    return table


def markdown_speed_table(rows: list[SpeedRow]) -> str:
    fp32 = any(row.vs_fp32 for row in rows)
    lines = [
        "| task | method | tau | speedup median | min | max | vs hf-pld | "
        + ("x generate fp32 median | min | max | " if fp32 else "") + "overhead | bound | of bound | lossless |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- | --- |" if fp32 else ""),
    ]
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for row in rows:
        vs_fp32 = ""
        if fp32:
            vs_fp32 = " | ".join(f"{x:.2f}x" for x in row.fp32_spread()) + " | " if row.vs_fp32 else "- | - | - | "
        lines.append(
            f"| {row.task} | {row.label} | {fmt(row.tau, '.2f')} | {row.median:.2f}x | {min(row.speedups):.2f}x | "
            f"{max(row.speedups):.2f}x | {statistics.median(row.vs_hf_pld):.2f}x | {vs_fp32}{fmt(row.overhead, '.0%')} | "
            f"{fmt(row.bound, '.2f')} | {fmt(row.realised, '.0%')} | {row.lossless_text} |"
        )
    return "\n".join(lines) + "\n"
