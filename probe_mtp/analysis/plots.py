"""Figures of an alignment study, drawn on matplotlib's Agg canvas without pyplot (no global state)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .study import AlignmentStudy
from .summaries import HitRates, layer_curve
from .table import AlignmentTable

PAPER_ACCEPTED = 0.45  # the paper's Fig. 2: cosine from about layer 15 on, accepted tokens
PAPER_REJECTED = 0.35  # ... and rejected ones


def save_figure(fig: Figure, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` as PNG (creating the folder) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return path


def _band(ax, curve, label, color, style="-"):
    ax.plot(curve.layers, curve.mean, style, color=color, label=f"{label} (n={int(curve.count.max())})")
    ax.fill_between(curve.layers, curve.mean - curve.sem, curve.mean + curve.sem, color=color, alpha=0.2)


def plot_cosine_by_layer(table: AlignmentTable, title: str = "") -> Figure:
    """The paper's Fig. 2 for this model: mean cosine per layer, accepted vs rejected proposals,
    one panel per mask index j (bands: one standard error), with the control (the same masks
    against the true hidden states of the continuation's other positions)."""
    masks = table.unique("mask")
    fig = Figure(figsize=(4.2 * len(masks), 3.6))
    axes = fig.subplots(1, len(masks), sharey=True, squeeze=False)[0]
    for ax, j in zip(axes, masks):
        rows = table.select(mask=j)
        if rows["accepted"].any():
            _band(ax, layer_curve(rows, accepted=True), "accepted", "tab:green")
        if (~rows["accepted"]).any():
            _band(ax, layer_curve(rows, accepted=False), "rejected", "tab:red")
        _band(ax, layer_curve(rows, column="control"), "control: other positions", "gray", "--")
        ax.axhline(PAPER_ACCEPTED, color="tab:green", linestyle=":", linewidth=0.9)
        ax.axhline(PAPER_REJECTED, color="tab:red", linestyle=":", linewidth=0.9)
        ax.set_title(f"mask j={j}")
        ax.set_xlabel("layer (0 = embeddings)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="lower center")
    axes[0].set_ylabel("cosine(mask, true token)")
    if title:
        fig.suptitle(title + "   (dotted: the paper's 0.45 / 0.35)")
    return fig


def plot_hit_rates(hits: HitRates, thresholds: dict[int, float] | None = None, title: str = "") -> Figure:
    """Top-K hit rate of the true token per bin of the cosine at one layer, with the number of masks
    per bin below and the fitted thresholds (hit rate 1/2) as vertical lines."""
    fig = Figure(figsize=(7.5, 5.2))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    centers = hits.centers
    colors = dict(zip(sorted(hits.rates), ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown"]))
    for k, rate in sorted(hits.rates.items()):
        top.plot(centers, rate, "o-", color=colors[k], label=f"top-{k}")
        t = (thresholds or {}).get(k)
        if t is not None and np.isfinite(t):
            top.axvline(t, color=colors[k], linestyle="--", linewidth=0.9)
            top.annotate(f"{t:.2f}", (t, 0.5), color=colors[k], fontsize=8, rotation=90, ha="right", va="center")
    top.axhline(0.5, color="black", linewidth=0.7, linestyle=":")
    top.set_ylim(-0.02, 1.02)
    top.set_ylabel("share of masks hitting the true token")
    top.grid(alpha=0.3)
    top.legend(fontsize="small", loc="upper left")
    bottom.bar(centers, hits.counts, width=np.diff(hits.edges) * 0.9, color="gray")
    bottom.set_ylabel("masks")
    bottom.set_xlabel(f"cosine at layer {hits.layer}")
    if title:
        top.set_title(title)
    return fig


def plot_mask_inits(study: AlignmentStudy, mask: int = 1, title: str = "") -> Figure:
    """Per mask setting: mean cosine per layer of mask ``mask`` (all proposals) and, beside it,
    the decoder's tau with that setting (pooled over the prompts)."""
    fig = Figure(figsize=(11, 3.8))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    labels = list(study.settings)
    for label in labels:
        rows = study.table.select(init=label, mask=mask)
        if len(rows):
            curve = layer_curve(rows)
            left.plot(curve.layers, curve.mean, label=label)
    left.set_xlabel("layer (0 = embeddings)")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.set_ylabel(f"mean cosine, mask j={mask}")
    left.grid(alpha=0.3)
    left.legend(fontsize="small")
    if study.tau.size:
        taus = [study.pooled_tau(label) for label in labels]
        bars = right.bar(range(len(labels)), taus, color="tab:blue")
        right.bar_label(bars, fmt="%.3f", fontsize=8)
        right.axhline(1.0, color="black", linewidth=0.7)
        right.set_ylim(0.95, max(taus) + 0.1)
        right.set_xticks(range(len(labels)))
        right.set_xticklabels(labels, rotation=25, ha="right")
        right.set_ylabel("tau (tokens per pass)")
    if title:
        fig.suptitle(title)
    return fig
