"""PNG figures of a report, drawn on matplotlib's Agg canvas without pyplot (no global backend or
figure state is touched, so this is safe inside notebooks and servers).

The first figure, ``default_speedup.png``, is the default configuration beside transformers'
prompt lookup (and ``model.generate`` on the float32 model, beside a prepared one): speedup over
``model.generate`` per task and overall, with 95% intervals; the others (tau, speedup, accepted
lengths) show every method, the default configuration right after the baselines."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .baselines import GREEDY_FP32
from .harness import GREEDY, HF_PLD, Report
from .summary import OVERALL, accepted_length_counts


def _grouped_bars(ax, tasks: list[str], labels: list[str], value, reference: float | None = None) -> None:
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        xs, ys = [], []
        for i, task in enumerate(tasks):
            v = value(task, label)
            if v is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(v)
        bars = ax.bar(xs, ys, width=width, label=label)
        if len(tasks) * len(labels) <= 40:
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    if reference is not None:
        ax.axhline(reference, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(tasks)))
    ax.set_xticklabels(tasks, rotation=20, ha="right")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")


def _default_plot(report: Report, summary: list[dict], title: str, out_dir: Path) -> Path | None:
    labels = report.default_labels
    if not labels:
        return None
    by = {(row["task"], row["label"]): row for row in summary}
    tasks: list[str] = []
    for row in summary:
        if row["label"] in labels and row["task"] not in tasks:
            tasks.append(row["task"])
    shown = [HF_PLD, *([GREEDY_FP32] if GREEDY_FP32 in report.methods else []), *labels]
    fig = Figure(figsize=(max(7, 1.2 * len(tasks) + 2), 4.5))
    ax = fig.add_subplot()
    width = 0.8 / len(shown)
    for j, label in enumerate(shown):
        xs, ys, errs = [], [], [[], []]
        for i, task in enumerate(tasks):
            row = by.get((task, label))
            if row is None or row.get("speedup_vs_greedy") is None:
                continue
            value = row["speedup_vs_greedy"]
            low, high = row.get("speedup_vs_greedy_low"), row.get("speedup_vs_greedy_high")
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(value)
            errs[0].append(max(0.0, value - low) if low is not None else 0.0)
            errs[1].append(max(0.0, high - value) if high is not None else 0.0)
        name = {HF_PLD: "transformers' prompt lookup", GREEDY_FP32: "model.generate, float32 model"}.get(
            label, f"probe-mtp {label}")
        bars = ax.bar(xs, ys, width=width, yerr=errs, capsize=3, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(tasks)))
    ax.set_xticklabels([f"{t}" if t != OVERALL else "overall" for t in tasks], rotation=20, ha="right")
    ax.set_ylabel("speedup over model.generate greedy (95% interval)")
    ax.set_title(f"default configuration ({title}; model.generate = 1)", fontsize="medium")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, out_dir / "default_speedup.png")


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write_plots(report: Report, out_dir: Path) -> list[Path]:
    summary = report.summary
    tasks: list[str] = []
    for row in summary:
        if row["task"] not in tasks:
            tasks.append(row["task"])
    by = {(row["task"], row["label"]): row for row in summary}
    others = [m for m in report.methods if m != GREEDY]
    title = (f"{report.settings['model']} ({report.dtype_label}) on {report.device_label}, "
             f"{report.settings['max_new_tokens']} new tokens")
    written = []
    first = _default_plot(report, summary, title, out_dir)
    if first is not None:
        written.append(first)

    def get(key):
        return lambda task, label: (by.get((task, label)) or {}).get(key)

    tau_labels = [m for m in others if any(get("tau")(t, m) is not None for t in tasks)]
    fig = Figure(figsize=(max(7, 1.2 * len(tasks) + 2), 4.5))
    ax = fig.add_subplot()
    _grouped_bars(ax, tasks, tau_labels, get("tau"), reference=1.0)
    ax.set_ylabel("mean accepted length tau (tokens / step)")
    ax.set_title(f"tau per task ({title}; model.generate = 1)", fontsize="medium")
    written.append(_save(fig, out_dir / "tau_per_task.png"))

    fig = Figure(figsize=(max(7, 1.2 * len(tasks) + 2), 4.5))
    ax = fig.add_subplot()
    _grouped_bars(ax, tasks, others, get("speedup_vs_greedy"), reference=1.0)
    ax.set_ylabel("speedup over model.generate greedy")
    ax.set_title(f"speedup per task ({title})", fontsize="medium")
    written.append(_save(fig, out_dir / "speedup_per_task.png"))

    counts = accepted_length_counts(report.records)
    hist_labels = [m for m in others if m in counts]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    longest = max((max(h) for h in counts.values() if h), default=1)
    width = 0.8 / max(1, len(hist_labels))
    for j, label in enumerate(hist_labels):
        h = counts[label]
        total = sum(h.values())
        xs = list(range(1, longest + 1))
        ax.bar([x - 0.4 + width * (j + 0.5) for x in xs], [h.get(x, 0) / total for x in xs], width=width, label=label)
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("tokens committed by one decoding step (accepted drafts + 1)")
    ax.set_ylabel("fraction of steps")
    ax.set_title(f"accepted lengths ({title})", fontsize="medium")
    ax.grid(axis="y", alpha=0.3)
    if hist_labels:
        ax.legend(fontsize="small")
    written.append(_save(fig, out_dir / "accepted_lengths.png"))
    return written
