"""What a vLLM engine step costs, by the number of tokens it verifies, measured by the proposer, and
the cut of the batch's draft chains that this cost makes best.

vLLM calls the proposer once per engine step, so the time from one ``propose`` call to the next is
one step: the model's pass over every row's last token and its drafts, the verification, the
scheduler and the proposer itself.  :class:`StepCosts` keeps the latest such times of steps that
only decoded (no request started, ended or was in prefill) against the tokens each verified, and
fits a line: ``seconds = fixed + per_token * tokens``.  Before enough steps of different widths
were timed the line leans on a prior slope (a small share of a step per token: optimistic on a
CPU, so wider steps get tried and timed).

:func:`cut_chains` then keeps, over all rows, the draft tokens whose estimated probability of
being accepted (the whole chain up to them) pays for the time they add: with the line, a step
commits ``rows + sum of kept probabilities`` tokens in ``fixed + per_token * (rows + kept)``
seconds, and a token raises that rate exactly when its probability exceeds ``per_token * rate``.
Tokens are taken most probable first, so every row keeps a prefix of its chain."""

from __future__ import annotations

from collections import deque

PRIOR_SLOPE = 0.01  # the prior's seconds per verified token, as a share of the mean step
PRIOR_WEIGHT = 16.0  # the prior's weight in the fit, in samples one token apart
WINDOW = 512  # the steps the line is fitted to (the latest)


class StepCosts:
    """Seconds per engine step against the tokens it verified, fitted to the latest timed steps."""

    def __init__(self, window: int = WINDOW, prior_slope: float = PRIOR_SLOPE, prior_weight: float = PRIOR_WEIGHT):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.prior_slope = prior_slope
        self.prior_weight = prior_weight
        self._sums = [0.0, 0.0, 0.0, 0.0]  # over the samples: x, y, x*x, x*y (kept as they come and go)

    def record(self, tokens: int, seconds: float) -> None:
        if tokens >= 1 and seconds > 0:
            if len(self.samples) == self.samples.maxlen:
                self._add(*self.samples[0], sign=-1.0)
            self.samples.append((int(tokens), float(seconds)))
            self._add(int(tokens), float(seconds), sign=1.0)

    def _add(self, x: int, y: float, sign: float) -> None:
        sums = self._sums
        sums[0] += sign * x
        sums[1] += sign * y
        sums[2] += sign * x * x
        sums[3] += sign * x * y

    def __len__(self) -> int:
        return len(self.samples)

    def line(self) -> tuple[float, float] | None:
        """``(fixed, per_token)`` seconds, or None before any step was timed.  A least-squares line
        whose slope is drawn towards ``prior_slope`` times the mean step (ridge), never below 0."""
        n = len(self.samples)
        if not n:
            return None
        sum_x, sum_y, sum_xx, sum_xy = self._sums
        mean_x, mean_y = sum_x / n, sum_y / n
        sxx = max(0.0, sum_xx - sum_x * mean_x)  # exact: the token counts are small integers
        sxy = sum_xy - sum_x * mean_y
        prior = self.prior_slope * mean_y
        slope = max(0.0, (sxy + self.prior_weight * prior) / (sxx + self.prior_weight))
        return max(mean_y - slope * mean_x, 1e-9), slope


def cut_chains(probabilities: list[list[float]], fixed: float, per_token: float, base: int | None = None) -> list[int]:
    """How many draft tokens each row keeps.  ``probabilities[r][j]``: the estimated probability
    that row r's draft tokens 0..j are all accepted (non-increasing in j).  Every row verifies its
    last committed token plus the kept drafts (``base``: the tokens the step verifies with no
    drafts, default one per row); tokens are added most probable first while each raises the
    batch's expected tokens per second (see the module docstring)."""
    rows = len(probabilities)
    keep = [0] * rows
    if not rows:
        return keep
    order = sorted(((p, r, j) for r, chain in enumerate(probabilities) for j, p in enumerate(chain)),
                   key=lambda item: (-item[0], item[1], item[2]))
    expected, seconds = float(rows), fixed + per_token * (rows if base is None else base)
    for p, r, j in order:
        if j != keep[r]:  # its chain was cut before it
            continue
        if p * seconds <= per_token * expected:
            break
        keep[r] += 1
        expected += p
        seconds += per_token
    return keep
