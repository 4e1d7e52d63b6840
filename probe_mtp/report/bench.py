"""``probe-mtp bench``: wall-clock speed with its spread, next to the bound the cost curve allows.

The report harness runs every method over the same prompts, prompt-major with a rotated order; the
bench repeats that ``repeats`` times and reports, per task and overall, the median, min and max of
each method's speedup over ``model.generate`` greedy (total time of the task's prompts, ratio taken
within one repetition, so slow phases of a shared machine cancel).  For the probe methods it adds:

- ``overhead``: the share of the decoding steps' time spent outside the model's forward pass;
- ``bound``: the speedup the method's own passes allow on this machine's cost curve,
  ``(new tokens - 1) / sum_i c(N_i) / c(1)`` over its passes of ``N_i`` inputs (for a fixed budget
  this is ``tau / (c(BC) / c(1))``), and the share of it that was realised.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .harness import GREEDY, HF_PLD, Report

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

    @property
    def median(self) -> float:
        return statistics.median(self.speedups)

    @property
    def realised(self) -> float | None:
        return self.median / self.bound if self.bound else None

    def as_dict(self) -> dict:
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
        }


def _bound(records: list[dict], relative_cost) -> float | None:
    steps_cost = 0.0
    tokens = 0
    for r in records:
        if not r.get("inputs_per_pass"):
            return None
        steps_cost += sum(relative_cost(n) for n in r["inputs_per_pass"])
        tokens += r["new_tokens"] - 1
    return tokens / steps_cost if steps_cost > 0 else None


def _overhead(records: list[dict]) -> float | None:
    forward = sum(r.get("forward_seconds") or 0.0 for r in records)
    steps = sum(r["seconds"] - (r.get("prefill_seconds") or 0.0) for r in records)
    if forward <= 0 or steps <= 0:
        return None
    return max(0.0, 1.0 - forward / steps)


def speed_rows(reports: list[Report], relative_cost=None) -> list[SpeedRow]:
    """Per task (and overall) and method: speedups over the repetitions, tau, overhead, bound."""
    first = reports[0]
    labels = first.methods
    tasks: list[str] = []
    for r in first.records:
        if r["task"] not in tasks:
            tasks.append(r["task"])
    rows = []
    for task in tasks + [OVERALL]:
        def pick(report, label):
            return [r for r in report.records if r["label"] == label and (task == OVERALL or r["task"] == task)]

        for label in labels:
            speedups, vs_pld = [], []
            for rep in reports:
                mine = sum(r["seconds"] for r in pick(rep, label))
                speedups.append(sum(r["seconds"] for r in pick(rep, GREEDY)) / mine)
                vs_pld.append(sum(r["seconds"] for r in pick(rep, HF_PLD)) / mine)
            recs = pick(first, label)
            kind = recs[0]["kind"]
            accepted = [a for r in recs for a in (r["accepted_lengths"] or [])]
            tau = sum(accepted) / len(accepted) if accepted else None
            probe = kind == "probe"
            rows.append(
                SpeedRow(
                    task,
                    label,
                    kind,
                    speedups,
                    vs_pld,
                    tau,
                    _overhead(recs) if probe else None,
                    _bound(recs, relative_cost) if probe and relative_cost else None,
                    all(r["identical_to_greedy"] for rep in reports for r in pick(rep, label)),
                )
            )
    return rows


def rich_speed_table(rows: list[SpeedRow], title: str):
    from rich.table import Table

    table = Table(title=title)
    for col in ("task", "method", "tau", "speedup median [min, max]", "vs hf-pld", "overhead", "bound", "of bound", "lossless"):
        table.add_column(col, justify="left" if col in ("task", "method") else "right")
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for row in rows:
        table.add_row(
            row.task,
            row.label,
            fmt(row.tau, ".2f"),
            f"{row.median:.2f}x [{min(row.speedups):.2f}, {max(row.speedups):.2f}]",
            f"{statistics.median(row.vs_hf_pld):.2f}x",
            fmt(row.overhead, ".0%"),
            fmt(row.bound, ".2f"),
            fmt(row.realised, ".0%"),
            "yes" if row.identical else "NO",
        )
    return table


def markdown_speed_table(rows: list[SpeedRow]) -> str:
    lines = [
        "| task | method | tau | speedup median | min | max | vs hf-pld | overhead | bound | of bound | lossless |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for row in rows:
        lines.append(
            f"| {row.task} | {row.label} | {fmt(row.tau, '.2f')} | {row.median:.2f}x | {min(row.speedups):.2f}x | "
            f"{max(row.speedups):.2f}x | {statistics.median(row.vs_hf_pld):.2f}x | {fmt(row.overhead, '.0%')} | "
            f"{fmt(row.bound, '.2f')} | {fmt(row.realised, '.0%')} | {'yes' if row.identical else 'NO'} |"
        )
    return "\n".join(lines) + "\n"
