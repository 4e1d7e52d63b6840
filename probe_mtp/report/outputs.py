"""Writing a report: report.json, records.csv, summary.md, PNG plots, and the terminal tables.

Every output opens with the default configuration (the verdict line, then its table against the
two baselines), then the equal-budget comparison of every drafter.  :func:`write_outputs` writes
into a temporary folder beside the destination and moves the files into place only when all of
them were written, so a failure never leaves a half-written output folder.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import tempfile
from pathlib import Path

from .baselines import GREEDY_FP32
from .harness import GREEDY, HF_PLD, Report
from .summary import INTERVAL_METHOD, OVERALL, fixed_budget_note, fp32_agreement, pass_sizes, verdict

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
    "ask",
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
    "memory",
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


def kernels_line(report: Report) -> str | None:
    """The kernels the model computed with, the processor's bf16 matrix units and the float32
    baseline's kernels (None for a report that predates them)."""
    env = report.environment
    if not env.get("kernels"):
        return None
    line = f"kernels: {env['kernels']}; bf16 matrix units: {env.get('matrix_units') or 'none'}"
    if env.get("fp32_reference"):
        line += f"; {GREEDY_FP32}: {env['fp32_reference']}"
    return line


def has_fp32(report: Report) -> bool:
    """Whether the run measured the float32 baseline (a prepared model)."""
    return GREEDY_FP32 in report.methods


TASK_SHORT = {"mt_bench": "mt", "translation": "trans", "summarization": "summ", "qa": "qa",
              "math_reasoning": "math", "rag": "rag", OVERALL: "all"}


def memory_sentence(memory: list | tuple | str | None) -> str:
    """What the memory mode(s) of a report mean."""
    modes = [memory] if isinstance(memory, str) else list(memory or ["warm"])
    parts = []
    if "warm" in modes:
        parts.append("warm: one ProbeDecoder per method serves the whole prompt stream in order, as a user's "
                     "long-running process would (its drafting memory learns from every earlier prompt; the untimed "
                     "warm-up is forgotten first)")
    if "cold" in modes:
        parts.append("cold: every prompt starts with an empty drafting memory (ProbeDecoder(memory=False), as a fresh "
                     "decoder per prompt would)")
    return "; ".join(parts)


def pass_sizes_sentence(sizes: dict) -> str:
    """``budget 'auto' chose passes of 1-24 inputs (median 9)`` from ``{inputs: passes}``."""
    counts = {int(k): int(v) for k, v in (sizes or {}).items()}
    total = sum(counts.values())
    if not total:
        return "no decoding step after the prefill"
    sizes_sorted = sorted(counts)
    seen, median = 0, sizes_sorted[-1]
    for size in sizes_sorted:
        seen += counts[size]
        if seen * 2 >= total:
            median = size
            break
    single = counts.get(1, 0) / total
    return (f"budget 'auto' chose passes of {sizes_sorted[0]}-{sizes_sorted[-1]} inputs (median {median}; "
            f"one-token steps {single:.0%} of {total})")


def _default_rows(report: Report, summary: list[dict]) -> tuple[list[str], list[str], dict]:
    labels = report.default_labels
    by = {(row["task"], row["label"]): row for row in summary}
    return labels, _tasks([r for r in summary if r["label"] in labels]), by


def _interval(row: dict | None, key: str = "speedup_vs_greedy") -> str:
    if not row or row.get(f"{key}_low") is None:
        return "n/a"
    return f"{row[f'{key}_low']:.2f}-{row[f'{key}_high']:.2f}"


def verdict_lines(report: Report, summary: list[dict] | None = None) -> list[str]:
    """One verdict line per default row (one, unless both memory modes were measured)."""
    summary = report.summary if summary is None else summary
    records_memory = {r["label"]: r.get("memory") for r in report.records}
    lines = [verdict(summary, label, records_memory.get(label)) for label in report.default_labels]
    return [line for line in lines if line]


def default_description(report: Report) -> str:
    """The configuration of the default row: what it is, which masks and budgets it used."""
    parts = []
    for label in report.default_labels:
        mine = [r for r in report.records if r["label"] == label]
        masks = sorted({r["masks"] for r in mine if r.get("masks")})
        memory = sorted({r["memory"] for r in mine if r.get("memory")})
        parts.append(f"{label}: masks {', '.join(masks) or 'n/a'}, memory {', '.join(memory) or 'n/a'}, "
                     f"{pass_sizes_sentence(pass_sizes(mine))}")
    return "; ".join(parts)


def _markdown_default(report: Report, summary: list[dict]) -> list[str]:
    labels, tasks, by = _default_rows(report, summary)
    if not labels:
        return []
    fp32 = has_fp32(report)
    agreement = fp32_agreement(summary)
    lines = [
        "",
        "## The default configuration",
        "",
        "`probe_mtp.generate(model, ids)` as it comes: `ProbeDecoder(model, tokenizer)`, drafter `hybrid`, "
        "`budget=\"auto\"`, `masks=\"auto\"`, a drafting memory kept across requests; no option of the command "
        "line changes it. " + default_description(report) + ".",
        "",
        f"Memory: {memory_sentence(report.settings.get('memory'))}.",
        *(["", f"{agreement[0].upper()}{agreement[1:]}."] if agreement else []),
        "",
        "| task | method | turns | tau | speedup vs generate | 95% interval | speedup vs hf-pld | "
        + ("speedup vs generate fp32 | 95% interval | " if fp32 else "") + "identical to greedy |",
        "| --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if fp32 else "") + " --- |",
    ]
    for task in tasks:
        for label in [HF_PLD, *([GREEDY_FP32] if fp32 else []), *labels]:
            row = by.get((task, label))
            if row is None:
                continue
            baseline = label in (HF_PLD, GREEDY_FP32)
            cells = [task, label, str(row["n"]), fmt(row["tau"]), fmt(row["speedup_vs_greedy"], suffix="x"),
                     _interval(row), "" if baseline else fmt(row["speedup_vs_hf_pld"], suffix="x")]
            if fp32:
                cells += ["", ""] if baseline else [fmt(row["speedup_vs_fp32"], suffix="x"),
                                                    _interval(row, "speedup_vs_fp32")]
            lines.append("| " + " | ".join(cells + [_identical(row)]) + " |")
    lines += ["", f"Intervals: {INTERVAL_METHOD}."]
    return lines


def memory_lines(memories: dict) -> list[str]:
    """One line per warm decoder: its drafting memory after the stream and the save/load round trip."""
    return [f"memory after the stream, {label}: {m['requests']} requests, {m['corpus_tokens']} corpus tokens, "
            f"{m['bytes'] / 2**20:.1f} MB of {m['max_bytes'] / 2**20:.0f} MB; file {m['file_bytes'] / 2**20:.1f} MB, "
            f"save {1000 * m['save_seconds']:.0f} ms, load {1000 * m['load_seconds']:.0f} ms"
            for label, m in memories.items()]


def _markdown_batches(rows: list[dict]) -> list[str]:
    """``--batch``: the default decoder on left-padded batches (ratios; the tokens/s are in report.json)."""
    if not rows:
        return []
    fp32 = any(r.get("speedup_vs_fp32") is not None for r in rows)
    lines = ["", "## Batches", "",
             "The prompts' first turns as left-padded batches, the default decoder against `model.generate` on "
             "the same batches (greedy, row for row identical is checked per batch)"
             + (", and against `model.generate` on the float32 model" if fp32 else "") + ".", "",
             "| batch | batches | speedup [95% interval] | " + ("vs generate fp32 [95% interval] | " if fp32 else "")
             + "tau | identical |", "| --- | --- | --- | --- | --- |" + (" --- |" if fp32 else "")]
    for r in rows:
        vs_fp32 = (f" {r['speedup_vs_fp32']:.2f}x [{r['speedup_vs_fp32_low']:.2f}, {r['speedup_vs_fp32_high']:.2f}] |"
                   if fp32 else "")
        lines.append(f"| {r['batch']} | {r['batches']} | {r['speedup']:.2f}x [{r['speedup_low']:.2f}, "
                     f"{r['speedup_high']:.2f}] |{vs_fp32} {r['tau']:.2f} | {r['identical']}/{r['batches']} |")
    return lines


def markdown_summary(report: Report) -> str:
    """Ratios only (tau, tokens per pass, speedups, lossless counts): absolute speeds depend on the
    machine and are kept in report.json.  The default configuration first, then the equal-budget
    comparison."""
    s, env = report.settings, report.environment
    summary = report.summary
    n_turns = len({(r["task"], r["category"], r["question_id"], r["turn"], r.get("ask", 1)) for r in report.records})
    fixed = report.fixed_labels
    lines = ["# probe-mtp report", ""]
    lines += [f"**{line}**" for line in verdict_lines(report, summary)]
    lines += [
        "",
        f"- model: `{s['model']}` ({report.dtype_label}) on {report.device_label}, {s['max_new_tokens']} new tokens per turn, "
        f"{n_turns} prompt turns (up to {s['limit'] or 'all'} prompts per task"
        + (f"; the equal-budget methods on the first {s['method_limit']} per task" if s.get("method_limit") else "")
        + f"), seed {s['seed']}" + (", `--full`" if s.get("full") else ""),
        f"- methods: {', '.join(report.methods)}; budgets (BC) of the equal-budget comparison: "
        f"{', '.join(str(b) for b in s['budgets'])}; masks per node k = {s['num_masks']}",
        f"- reference: `{GREEDY}` is `model.generate(do_sample=False)`; `{HF_PLD}` is transformers' prompt lookup "
        f"(`prompt_lookup_num_tokens={s['hf_pld_tokens']}`)"
        + (f"; `{GREEDY_FP32}` is `model.generate(do_sample=False)` on the unprepared float32 model" if has_fp32(report)
           else "") + "; all measured in this run, on the same prompts",
        *([f"- {kernels_line(report)}"] if kernels_line(report) else []),
        f"- memory: {memory_sentence(s.get('memory'))}",
        f"- torch {env['torch']} ({env['torch_threads']} threads), transformers {env['transformers']}, "
        f"probe-mtp {env['probe_mtp']}, python {env['python']}"
        + (f", processor {env['processor']}" if env.get("processor") else ""),
        "- tau: accepted tokens per decoding step (prefill excluded); tokens/pass: new tokens per forward "
        "pass (prefill included); speedups: total time of the baseline / total time of the method over the "
        "same turns (prefill included, one warm-up per method, method order rotated per turn); "
        "identical: outputs equal to `model.generate` greedy; agreement: tokens equal to greedy's at the same "
        "position (1.00 for every lossless method; `confadapt` is lossy).",
    ]
    lines += _markdown_default(report, summary)
    lines += _markdown_batches(report.batches)
    if report.memories:
        lines += ["", "## Drafting memory", ""] + [f"- {line}" for line in memory_lines(report.memories)]
    lines += [
        "",
        "## Equal block complexity",
        "",
        fixed_budget_note(report.pass_costs) if fixed else "(no drafter at a fixed budget in this run)",
        "",
        "## Overall",
        "",
        "| method | tau | tokens/pass | speedup vs generate | speedup vs hf-pld | "
        + ("speedup vs generate fp32 | " if has_fp32(report) else "") + "identical to greedy | agreement |",
        "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if has_fp32(report) else ""),
    ]
    for row in summary:
        if row["task"] == OVERALL:
            vs_fp32 = f" {fmt(row.get('speedup_vs_fp32'), suffix='x')} |" if has_fp32(report) else ""
            lines.append(
                f"| {row['label']} | {fmt(row['tau'])} | {fmt(row['tokens_per_pass'])} | "
                f"{fmt(row['speedup_vs_greedy'], suffix='x')} | {fmt(row['speedup_vs_hf_pld'], suffix='x')} |{vs_fp32} "
                f"{_identical(row)} | {fmt(row.get('agreement'), 3)} |"
            )
    tasks = _tasks(summary)
    labels = _labels(summary)
    by = {(row["task"], row["label"]): row for row in summary}
    per_task = [
        ("Mean accepted length (tau) per task", "tau", ""),
        ("Speedup over model.generate greedy per task", "speedup_vs_greedy", "x"),
        ("Speedup over transformers' prompt lookup per task", "speedup_vs_hf_pld", "x"),
        ("Identical to greedy per task", None, ""),
        ("Agreement with greedy per task (fraction of equal tokens)", "agreement", ""),
    ]
    if has_fp32(report):
        per_task.insert(3, ("Speedup over model.generate on the float32 model per task", "speedup_vs_fp32", "x"))
    for title, key, suffix in per_task:
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


OUTPUT_NAMES = ("report.json", "records.csv", "summary.md")


def check_output_folder(out_dir: str | Path) -> Path:
    """Fail early (before any model is loaded) when ``out_dir`` cannot become the output folder:
    an existing file of that name, or a parent folder that cannot be written."""
    import os

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    if out.is_dir() and not os.access(out, os.W_OK):
        raise ValueError(f"--out {out}: the folder cannot be written")
    parent = next((p for p in out.absolute().parents if p.exists()), Path("."))
    if not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} is not a folder")
    try:
        probe = tempfile.mkdtemp(prefix=".probe-mtp-check-", dir=parent)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write in {parent} ({exc.strerror or exc})") from None
    Path(probe).rmdir()
    return out


def write_outputs(report: Report, out_dir: str | Path, plots: bool = True) -> list[Path]:
    """Write report.json, records.csv, summary.md and (``plots``) the PNG figures into ``out_dir``.

    Everything is written into a temporary folder beside ``out_dir`` first; only when every file
    was written are they moved into ``out_dir`` (created then; other files there are left alone).
    On a failure the temporary folder is removed and ``out_dir`` is as it was."""
    out = Path(out_dir)
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        written = [
            write_json(report, staging / "report.json"),
            write_csv(report, staging / "records.csv"),
            write_markdown(report, staging / "summary.md"),
        ]
        if plots:
            from .plots import write_plots

            written += write_plots(report, staging)
        out.mkdir(parents=True, exist_ok=True)
        final = []
        for path in written:
            target = out / path.name
            path.replace(target)
            final.append(target)
        return final
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _styled_speed(value, label: str) -> str:
    text = fmt(value, suffix="x")
    if value is not None and label != GREEDY and value > 1:
        return f"[green]{text}[/green]"
    return text


def _styled_identical(row: dict) -> str:
    ident = _identical(row)  # the float32 baseline's differences are rounding, not losses: never red
    return ident if row["all_identical"] or row["label"] == GREEDY_FP32 else f"[red]{ident}[/red]"


def default_table(report: Report, summary: list[dict] | None = None):
    """The first table: the default configuration beside model.generate and transformers' prompt
    lookup, per task and overall (None when the report has no default row)."""
    from rich.table import Table

    summary = report.summary if summary is None else summary
    labels, tasks, by = _default_rows(report, summary)
    if not labels:
        return None
    s = report.settings
    table = Table(
        title=f"probe-mtp default configuration (probe_mtp.generate as it comes: hybrid, budget auto, masks auto, "
        f"memory {'/'.join(s.get('memory') or ['warm'])}) against model.generate greedy and transformers' prompt lookup: "
        f"{s['model']} ({report.dtype_label}) on {report.device_label}, {s['max_new_tokens']} new tokens per turn, same prompts, same run"
        + (f"; {GREEDY_FP32}: model.generate on the unprepared float32 model" if has_fp32(report) else ""),
        title_justify="left",
    )
    many = len(labels) > 1
    fp32 = has_fp32(report)
    columns = [("task", "left")] + ([("decoder", "left")] if many else []) + [
        ("turns", "right"), ("generate tok/s", "right"), *([("generate fp32 tok/s", "right")] if fp32 else []),
        ("prompt lookup tok/s", "right"), ("default tok/s", "right"),
        ("tau", "right"), ("x generate", "right"), ("95% interval", "right"), ("x prompt lookup", "right"),
        *([("x generate fp32", "right")] if fp32 else []), ("identical", "right"),
    ]
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for task in tasks:
        if task == OVERALL:
            table.add_section()
        greedy, pld = by.get((task, GREEDY)) or {}, by.get((task, HF_PLD)) or {}
        reference = by.get((task, GREEDY_FP32)) or {}
        for label in labels:
            row = by.get((task, label))
            if row is None:
                continue
            name = f"[bold]{task}[/bold]" if task == OVERALL else task
            cells = [name] + ([label] if many else []) + [
                str(row["n"]),
                fmt(greedy.get("tokens_per_second"), 1),
                *([fmt(reference.get("tokens_per_second"), 1)] if fp32 else []),
                fmt(pld.get("tokens_per_second"), 1),
                fmt(row["tokens_per_second"], 1),
                fmt(row["tau"]),
                _styled_speed(row["speedup_vs_greedy"], label),
                _interval(row),
                fmt(row["speedup_vs_hf_pld"], suffix="x"),
                *([_styled_speed(row.get("speedup_vs_fp32"), label)] if fp32 else []),
                _styled_identical(row),
            ]
            table.add_row(*cells)
    return table


def equal_budget_table(report: Report, summary: list[dict] | None = None):
    """The second table: every method at a fixed block complexity (the baselines first): tau per
    task and overall, tokens per pass, tokens/s, speedups, identical outputs (None without such
    methods)."""
    from rich.table import Table

    summary = report.summary if summary is None else summary
    fixed = report.fixed_labels
    if not fixed:
        return None
    labels = [GREEDY, HF_PLD, *([GREEDY_FP32] if has_fp32(report) else []), *fixed]
    by = {(row["task"], row["label"]): row for row in summary}
    tasks = [t for t in _tasks([r for r in summary if r["label"] in fixed]) if t != OVERALL]
    s = report.settings
    table = Table(
        title=f"equal block complexity (BC {', '.join(str(b) for b in s['budgets'])}: every pass verifies that many "
        f"inputs): tau per task, {s['model']}, {s['max_new_tokens']} new tokens per turn",
        title_justify="left",
    )
    table.add_column("method", justify="left")
    for task in tasks:
        table.add_column(f"tau {TASK_SHORT.get(task, task[:8])}", justify="right")
    for col in ("tau", "tok/pass", "tok/s", "x generate", "x hf-pld", "identical", "agree"):
        table.add_column(col, justify="right")
    for label in labels:
        overall = by.get((OVERALL, label))
        if overall is None:
            continue
        table.add_row(
            label,
            *[fmt((by.get((task, label)) or {}).get("tau")) for task in tasks],
            fmt(overall["tau"]),
            fmt(overall["tokens_per_pass"]),
            fmt(overall["tokens_per_second"], 1),
            _styled_speed(overall["speedup_vs_greedy"], label),
            fmt(overall["speedup_vs_hf_pld"], suffix="x"),
            _styled_identical(overall),
            fmt(overall.get("agreement"), 3),
        )
    return table


def rich_table(report: Report):
    """Every method per task, overall last (the long form; ``probe-mtp report`` prints
    :func:`default_table` and :func:`equal_budget_table`)."""
    from rich.table import Table

    s = report.settings
    table = Table(
        title=f"probe-mtp report: {s['model']} ({report.dtype_label}) on {report.device_label}, {s['max_new_tokens']} new tokens per turn; "
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
            name = (f"[bold]{task}[/bold]" if task == OVERALL else task) if first else ""
            first = False
            table.add_row(
                name,
                row["label"],
                str(row["n"]),
                fmt(row["tau"]),
                fmt(row["tokens_per_pass"]),
                fmt(row["tokens_per_second"], 1),
                _styled_speed(row["speedup_vs_greedy"], row["label"]),
                fmt(row["speedup_vs_hf_pld"], suffix="x"),
                _styled_identical(row),
                fmt(row.get("agreement"), 3),
            )
    return table


def print_report(report: Report, console) -> None:
    """What ``probe-mtp report`` prints: the default configuration's table and verdict first, then
    the equal-budget table with the sentence that reads it."""
    summary = report.summary
    if kernels_line(report):
        console.print(f"{report.settings['model']}, {report.dtype_label}: {kernels_line(report)}", highlight=False)
    first = default_table(report, summary)
    if first is not None:
        console.print(first)
        for line in verdict_lines(report, summary):
            console.print(f"[bold]{line}[/bold]", highlight=False)
        if fp32_agreement(summary):
            console.print(f"{fp32_agreement(summary)}.", highlight=False)
        console.print(f"{default_description(report)}. Memory: {memory_sentence(report.settings.get('memory'))}. "
                      f"Intervals: {INTERVAL_METHOD}.", highlight=False)
    second = equal_budget_table(report, summary)
    if second is not None:
        console.print()
        console.print(second)
        console.print(fixed_budget_note(report.pass_costs), highlight=False)
    if first is None and second is None:
        console.print(rich_table(report))
    defaults = set(report.default_labels)  # the default configuration's memory (summary.md has every one)
    for line in memory_lines({k: v for k, v in report.memories.items() if k in defaults}):
        console.print(line, highlight=False)
