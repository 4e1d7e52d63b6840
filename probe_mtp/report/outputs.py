"""Writing a report: report.json, records.csv, summary.md, PNG plots, and the terminal table."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from .harness import GREEDY, HF_PLD, Report
from .summary import OVERALL

RECORD_FIELDS = (
    "method",
    "label",
    "kind",
    "budget",
    "num_masks",
    "task",
    "category",
    "question_id",
    "turn",
    "order",
    "prompt_tokens",
    "new_tokens",
    "forward_passes",
    "first_pass_tokens",
    "accepted_lengths",
    "mean_accepted_length",
    "seconds",
    "prefill_seconds",
    "forward_seconds",
    "inputs_per_pass",
    "tokens_per_second",
    "identical_to_greedy",
    "first_mismatch",
    "masks",
    "acceptance",
    "matching_tokens",
    "compared_tokens",
    "agreement",
)


def _clean(value):
    """JSON-safe: NaN / inf become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(report: Report, path: Path) -> Path:
    path.write_text(json.dumps(_clean(report.as_dict()), indent=1) + "\n", encoding="utf-8")
    return path


def write_csv(report: Report, path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=RECORD_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in report.records:
            row = dict(r)
            for key in ("accepted_lengths", "inputs_per_pass"):
                seq = row.get(key)
                row[key] = "" if seq is None else " ".join(str(a) for a in seq)
            w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return path


def fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}f}{suffix}"


def _identical(row: dict) -> str:
    return f"{row['identical']}/{row['n']}"


def _tasks(summary: list[dict]) -> list[str]:
    out: list[str] = []
    for row in summary:
        if row["task"] not in out:
            out.append(row["task"])
    return out


def _labels(summary: list[dict]) -> list[str]:
    out: list[str] = []
    for row in summary:
        if row["label"] not in out:
            out.append(row["label"])
    return out


def markdown_summary(report: Report) -> str:
    """Ratios only (tau, tokens per pass, speedups, lossless counts): absolute speeds depend on the
    machine and are kept in report.json."""
    s, env = report.settings, report.environment
    summary = report.summary
    n_turns = len({(r["task"], r["category"], r["question_id"], r["turn"]) for r in report.records})
    lines = [
        "# probe-mtp report",
        "",
        f"- model: `{s['model']}` ({s['dtype']}), {s['max_new_tokens']} new tokens per turn, "
        f"{n_turns} prompt turns (up to {s['limit'] or 'all'} prompts per task), seed {s['seed']}",
        f"- methods: {', '.join(report.methods)}; budgets (BC): {', '.join(str(b) for b in s['budgets'])}; "
        f"masks per node k = {s['num_masks']}",
        f"- reference: `{GREEDY}` is `model.generate(do_sample=False)`; `{HF_PLD}` is transformers' prompt lookup "
        f"(`prompt_lookup_num_tokens={s['hf_pld_tokens']}`); both measured in this run, on the same prompts",
        f"- torch {env['torch']} ({env['torch_threads']} threads), transformers {env['transformers']}, "
        f"probe-mtp {env['probe_mtp']}, python {env['python']}",
        "- tau: accepted tokens per decoding step (prefill excluded); tokens/pass: new tokens per forward "
        "pass (prefill included); speedups: total time of the baseline / total time of the method over the "
        "same turns (prefill included, one warm-up per method, method order rotated per turn); "
        "identical: outputs equal to `model.generate` greedy; agreement: tokens equal to greedy's at the same "
        "position (1.00 for every lossless method; `confadapt` is lossy).",
        "",
        "## Overall",
        "",
        "| method | tau | tokens/pass | speedup vs generate | speedup vs hf-pld | identical to greedy | agreement |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in summary:
        if row["task"] == OVERALL:
            lines.append(
                f"| {row['label']} | {fmt(row['tau'])} | {fmt(row['tokens_per_pass'])} | "
                f"{fmt(row['speedup_vs_greedy'], suffix='x')} | {fmt(row['speedup_vs_hf_pld'], suffix='x')} | "
                f"{_identical(row)} | {fmt(row.get('agreement'), 3)} |"
            )
    tasks = _tasks(summary)
    labels = _labels(summary)
    by = {(row["task"], row["label"]): row for row in summary}
    for title, key, suffix in (
        ("Mean accepted length (tau) per task", "tau", ""),
        ("Speedup over model.generate greedy per task", "speedup_vs_greedy", "x"),
        ("Speedup over transformers' prompt lookup per task", "speedup_vs_hf_pld", "x"),
        ("Identical to greedy per task", None, ""),
        ("Agreement with greedy per task (fraction of equal tokens)", "agreement", ""),
    ):
        lines += ["", f"## {title}", "", "| method | " + " | ".join(tasks) + " |", "| --- |" + " --- |" * len(tasks)]
        for label in labels:
            cells = []
            for task in tasks:
                row = by.get((task, label))
                if row is None:
                    cells.append("")
                else:
                    cells.append(_identical(row) if key is None else fmt(row.get(key), 3 if key == "agreement" else 2, suffix))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_markdown(report: Report, path: Path) -> Path:
    path.write_text(markdown_summary(report), encoding="utf-8")
    return path


def write_outputs(report: Report, out_dir: str | Path, plots: bool = True) -> list[Path]:
    """Write report.json, records.csv, summary.md and (``plots``) the PNG figures into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [
        write_json(report, out / "report.json"),
        write_csv(report, out / "records.csv"),
        write_markdown(report, out / "summary.md"),
    ]
    if plots:
        from .plots import write_plots

        written += write_plots(report, out)
    return written


def rich_table(report: Report):
    """The terminal table: one section per task, overall last."""
    from rich.table import Table

    s = report.settings
    table = Table(
        title=f"probe-mtp report: {s['model']} ({s['dtype']}), {s['max_new_tokens']} new tokens per turn; "
        f"x generate / x hf-pld: speedup over model.generate greedy / transformers' prompt lookup, same run",
        title_justify="left",
    )
    for col, justify in (
        ("task", "left"),
        ("method", "left"),
        ("turns", "right"),
        ("tau", "right"),
        ("tok/pass", "right"),
        ("tok/s", "right"),
        ("x generate", "right"),
        ("x hf-pld", "right"),
        ("identical", "right"),
        ("agree", "right"),
    ):
        table.add_column(col, justify=justify, no_wrap=True)
    summary = report.summary
    tasks = _tasks(summary)
    for i, task in enumerate(tasks):
        if i:
            table.add_section()
        first = True
        for row in summary:
            if row["task"] != task:
                continue
            ident = _identical(row)
            if not row["all_identical"]:
                ident = f"[red]{ident}[/red]"
            speed = fmt(row["speedup_vs_greedy"], suffix="x")
            if row["speedup_vs_greedy"] is not None and row["label"] != GREEDY and row["speedup_vs_greedy"] > 1:
                speed = f"[green]{speed}[/green]"
            name = (f"[bold]{task}[/bold]" if task == OVERALL else task) if first else ""
            first = False
            table.add_row(
                name,
                row["label"],
                str(row["n"]),
                fmt(row["tau"]),
                fmt(row["tokens_per_pass"]),
                fmt(row["tokens_per_second"], 1),
                speed,
                fmt(row["speedup_vs_hf_pld"], suffix="x"),
                ident,
                fmt(row.get("agreement"), 3),
            )
    return table
