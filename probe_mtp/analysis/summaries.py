"""Aggregates of an :class:`~probe_mtp.analysis.table.AlignmentTable`: mean cosine per layer, the
target's top-K hit rate as a function of cosine, and the cosine where hits become likely."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .table import AlignmentTable


@dataclass(frozen=True)
class LayerCurve:
    """Mean cosine per layer (``layers[i]``) over ``count[i]`` masks, with its standard error."""

    layers: np.ndarray
    mean: np.ndarray
    sem: np.ndarray
    count: np.ndarray

    def at(self, layer: int) -> float:
        hit = np.flatnonzero(self.layers == layer)
        return float(self.mean[hit[0]]) if hit.size else float("nan")


def layer_curve(table: AlignmentTable, column: str = "cosine", **conditions) -> LayerCurve:
    """Mean of ``column`` (``"cosine"``, or ``"control"``: the cosine with unrelated positions) per
    layer over the rows matching ``conditions`` (as in ``table.select``)."""
    if column not in ("cosine", "control"):
        raise ValueError(f"column must be 'cosine' or 'control', got {column!r}")
    rows = table.select(**conditions) if conditions else table
    layers = np.unique(rows["layer"])
    means, sems, counts = [], [], []
    for layer in layers:
        c = rows[column][rows["layer"] == layer].astype(np.float64)
        means.append(c.mean())
        sems.append(c.std(ddof=1) / np.sqrt(c.size) if c.size > 1 else np.nan)
        counts.append(c.size)
    return LayerCurve(layers.astype(np.int64), np.array(means), np.array(sems), np.array(counts, dtype=np.int64))


OUTCOME_DTYPE = np.dtype(
    [
        ("mask", np.int8),
        ("layer", np.int16),
        ("accepted", np.float64),  # mean cosine of accepted proposals
        ("rejected", np.float64),  # mean cosine of rejected proposals
        ("control", np.float64),  # mean cosine of all these masks with unrelated positions' hidden states
        ("n_accepted", np.int64),
        ("n_rejected", np.int64),
    ]
)


def cosine_by_outcome(table: AlignmentTable, layers, **conditions) -> np.ndarray:
    """Mean cosine of accepted and of rejected proposals, per mask index and for each of ``layers``
    (negative indices count from the last layer), as rows of :data:`OUTCOME_DTYPE`."""
    rows = table.select(**conditions) if conditions else table
    last = rows.last_layer
    wanted = [last + 1 + int(l) if int(l) < 0 else int(l) for l in layers]
    out = []
    for mask in rows.unique("mask"):
        for layer in wanted:
            here = (rows["mask"] == mask) & (rows["layer"] == layer)
            sel, acc = rows["cosine"][here], rows["accepted"][here]
            out.append(
                (
                    mask,
                    layer,
                    sel[acc].mean() if acc.any() else np.nan,
                    sel[~acc].mean() if (~acc).any() else np.nan,
                    rows["control"][here].mean() if here.any() else np.nan,
                    int(acc.sum()),
                    int((~acc).sum()),
                )
            )
    return np.array(out, dtype=OUTCOME_DTYPE)


@dataclass(frozen=True)
class HitRates:
    """Share of masks whose target lies in their top-K, per cosine bin (``edges[i] .. edges[i+1]``).
    ``rates[K][i]`` is NaN for bins with fewer than ``min_count`` masks."""

    layer: int
    edges: np.ndarray
    counts: np.ndarray
    rates: dict[int, np.ndarray]

    @property
    def centers(self) -> np.ndarray:
        return (self.edges[:-1] + self.edges[1:]) / 2


def _one_layer(table: AlignmentTable, layer: int | None, conditions: dict) -> tuple[int, AlignmentTable]:
    rows = table.select(**conditions) if conditions else table
    layer = rows.last_layer if layer is None else int(layer)
    if layer < 0:
        layer = rows.last_layer + 1 + layer
    return layer, rows.select(layer=layer)


def hit_rates(
    table: AlignmentTable,
    layer: int | None = None,
    ks=(1, 5, 10),
    bin_width: float = 0.05,
    min_count: int = 10,
    **conditions,
) -> HitRates:
    """Top-K hit rate of the target against the cosine at ``layer`` (default: the last layer)."""
    if bin_width <= 0:
        raise ValueError(f"bin_width must be > 0, got {bin_width}")
    layer, rows = _one_layer(table, layer, conditions)
    cos = rows["cosine"].astype(np.float64)
    if cos.size == 0:
        raise ValueError("no rows match: nothing to bin")
    lo = np.floor(cos.min() / bin_width) * bin_width
    hi = np.ceil(cos.max() / bin_width) * bin_width
    edges = np.arange(lo, hi + bin_width / 2, bin_width)
    if edges.size < 2:
        edges = np.array([lo, lo + bin_width])
    which = np.clip(np.digitize(cos, edges) - 1, 0, edges.size - 2)
    counts = np.bincount(which, minlength=edges.size - 1)
    rates = {}
    for k in ks:
        hits = np.bincount(which, weights=(rows["rank"] < k).astype(np.float64), minlength=edges.size - 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = hits / counts
        rate[counts < min_count] = np.nan
        rates[int(k)] = rate
    return HitRates(layer, edges, counts, rates)


def logistic_fit(x: np.ndarray, y: np.ndarray, iterations: int = 100) -> tuple[float, float]:
    """Maximum-likelihood ``(a, b)`` of ``P(y=1 | x) = 1 / (1 + exp(-(a + b x)))`` (Newton's method,
    with a tiny ridge so that separable data stay finite)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    design = np.stack([np.ones_like(x), x], axis=1)
    w = np.zeros(2)
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-(design @ w)))
        grad = design.T @ (y - p) - 1e-6 * w
        hess = (design * (p * (1 - p))[:, None]).T @ design + 1e-6 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        w += step
        if np.abs(step).max() < 1e-10:
            break
    return float(w[0]), float(w[1])


def hit_threshold(table: AlignmentTable, k: int = 1, layer: int | None = None, **conditions) -> float:
    """The cosine (at ``layer``, default the last) above which the target is more likely than not
    in the mask's top-``k``: where a logistic fit of the hit on the cosine crosses 1/2.  NaN when
    hits do not grow with the cosine, or when every mask hits or every mask misses."""
    _, rows = _one_layer(table, layer, conditions)
    hit = rows["rank"] < k
    if hit.all() or not hit.any():
        return float("nan")
    a, b = logistic_fit(rows["cosine"], hit)
    return -a / b if b > 0 else float("nan")
