"""The alignment analysis's summaries (probe_mtp.analysis) on synthetic data: hit threshold, logistic
fit, hit rates, layer curve, cosine by outcome (the measurement on SmolLM2 is in
tests/models/test_analysis.py)."""

from __future__ import annotations

import numpy as np
import pytest

from probe_mtp.analysis import (
    TABLE_DTYPE,
    AlignmentTable,
    cosine_by_outcome,
    hit_rates,
    hit_threshold,
    layer_curve,
)
from probe_mtp.analysis.summaries import logistic_fit


def _synthetic_table(n=4000, threshold=0.4, seed=0):
    """Last-layer rows whose top-1 hit is likelier above ``threshold`` (logistic, slope 20)."""
    rng = np.random.default_rng(seed)
    cos = rng.uniform(0.0, 0.8, n)
    p = 1 / (1 + np.exp(-20 * (cos - threshold)))
    hit = rng.random(n) < p
    rows = np.zeros(2 * n, dtype=TABLE_DTYPE)
    rows["mask"] = 1
    rows["layer"] = np.repeat([0, 1], n)
    rows["cosine"] = np.concatenate([np.full(n, 0.2), cos])
    rows["control"] = 0.1
    rows["rank"] = np.tile(np.where(hit, 0, 20), 2)
    rows["top1"] = rows["accepted"] = rows["rank"] == 0
    return AlignmentTable(rows)


def test_summaries_on_synthetic_data():
    t = _synthetic_table()
    assert abs(hit_threshold(t, k=1) - 0.4) < 0.03
    assert np.isnan(hit_threshold(t, k=50))  # every row hits: no threshold
    a, b = logistic_fit(np.array([0.0, 0.1, 0.9, 1.0]), np.array([0, 0, 1, 1]))
    assert np.isfinite([a, b]).all() and b > 10 and 0.1 < -a / b < 0.9  # separable: steep, finite, in the gap
    h = hit_rates(t, ks=(1, 50), bin_width=0.1)
    assert h.layer == 1 and h.counts.sum() == 4000
    assert (np.nan_to_num(h.rates[50]) == 1.0).all()
    rate1 = h.rates[1]
    assert rate1[0] < 0.1 and rate1[-1] > 0.9 and np.all(np.diff(rate1) > -0.05)
    curve = layer_curve(t)
    assert curve.layers.tolist() == [0, 1] and np.isclose(curve.at(0), 0.2)
    assert np.allclose(layer_curve(t, column="control").mean, 0.1)
    with pytest.raises(ValueError, match="column"):
        layer_curve(t, column="rank")
    out = cosine_by_outcome(t, layers=[-1])
    assert out["layer"].tolist() == [1]
    assert out["accepted"][0] > out["rejected"][0] and np.isclose(out["control"][0], 0.1)
    assert out["n_accepted"][0] + out["n_rejected"][0] == 4000
    with pytest.raises(ValueError, match="bin_width"):
        hit_rates(t, bin_width=0)
