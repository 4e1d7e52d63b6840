"""Online calibration of draft proposals: how often a source's proposals of one kind are accepted.

Each source sorts its proposals into a few *cells* (for example: "successor table, pair key, stored
probability 0.6-0.9" or "context match of 3 tokens, unanimous").  For every cell the calibrator
counts proposals that were *tested* (their parent was on the accepted path, so the verifier's
token after the parent is known) and how many of them were that token.  The estimate is the
Beta-smoothed rate

    p(cell) = (hits + strength * prior) / (trials + strength),

which starts at the prior and follows the observed rate as evidence accumulates.  An instance
lives for one generation, or across requests in the decoder's drafting memory; there
``max_evidence`` bounds the trials a cell remembers (older evidence is scaled down, the rate kept),
so a long-lived estimate still follows the text at hand.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class AcceptanceCalibrator:
    """Per-(source, cell) acceptance counts turned into probability estimates.

    ``priors[source]`` gives the prior mean of each of the source's cells (its length is the
    number of cells); ``strength`` is the prior's weight in pseudo-proposals."""

    def __init__(self, priors: Mapping[str, np.ndarray], strength: float = 4.0, max_evidence: float | None = None):
        if strength <= 0:
            raise ValueError(f"strength must be > 0, got {strength!r}")
        self.priors = {}
        for source, prior in priors.items():
            prior = np.asarray(prior, dtype=np.float64).reshape(-1)
            if prior.size == 0 or np.any((prior < 0) | (prior > 1)):
                raise ValueError(f"prior of {source!r} must be non-empty probabilities in [0, 1]")
            prior.setflags(write=False)
            self.priors[source] = prior
        self.strength = float(strength)
        if max_evidence is not None and not max_evidence > 0:
            raise ValueError(f"max_evidence must be None or > 0, got {max_evidence!r}")
        self.max_evidence = max_evidence
        self.reset()

    def reset(self) -> None:
        self.hits = {s: np.zeros_like(p) for s, p in self.priors.items()}
        self.trials = {s: np.zeros_like(p) for s, p in self.priors.items()}

    def estimate(self, source: str, cells: np.ndarray, prior: np.ndarray | None = None) -> np.ndarray:
        """Acceptance probability of proposals in ``cells`` of ``source``; ``prior`` (one per
        proposal) replaces the source's fixed prior means (hierarchical smoothing: a cell of a
        finer source falls back to an estimate of a coarser one)."""
        m = self.strength
        mean = self.priors[source][cells] if prior is None else prior
        return (self.hits[source][cells] + m * mean) / (self.trials[source][cells] + m)

    def all_cells(self, source: str) -> np.ndarray:
        """The estimate of every cell of ``source``."""
        m = self.strength
        return (self.hits[source] + m * self.priors[source]) / (self.trials[source] + m)

    def record(self, source: str, cells: np.ndarray, accepted: np.ndarray) -> None:
        """Count tested proposals of ``source`` (one per entry of ``cells``) and which were accepted."""
        cells = np.asarray(cells, dtype=np.int64)
        trials, hits = self.trials[source], self.hits[source]
        np.add.at(trials, cells, 1.0)
        np.add.at(hits, cells, np.asarray(accepted, dtype=np.float64))
        if self.max_evidence is not None:
            over = trials > self.max_evidence
            if over.any():
                shrink = self.max_evidence / trials[over]
                trials[over] *= shrink
                hits[over] *= shrink

    def discount(self, carry: float) -> None:
        """Keep ``carry`` (0 to 1) of the evidence's weight, the rates it measured unchanged."""
        for s in self.priors:
            self.hits[s] *= carry
            self.trials[s] *= carry

    def as_arrays(self) -> dict[str, np.ndarray]:
        """``{source/hits, source/trials}`` (for saving)."""
        out = {}
        for s in self.priors:
            out[f"{s}/hits"] = self.hits[s].copy()
            out[f"{s}/trials"] = self.trials[s].copy()
        return out

    def load_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """The counts saved by :meth:`as_arrays` (a ``ValueError`` when they do not fit the priors)."""
        for s, prior in self.priors.items():
            hits, trials = (np.asarray(arrays[f"{s}/{n}"], dtype=np.float64) for n in ("hits", "trials"))
            if hits.shape != prior.shape or trials.shape != prior.shape or np.any(hits < 0) or np.any(hits > trials + 1e-9):
                raise ValueError(f"calibration counts of {s!r} do not fit its {prior.size} cells")
            self.hits[s], self.trials[s] = hits.copy(), trials.copy()
