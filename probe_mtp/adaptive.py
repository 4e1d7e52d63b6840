"""The adaptive budget: each step, verify the tree size (and whether to attach masks) that
maximises expected tokens per second on this machine.

Expected tokens of a tree = 1 (the bonus token) + the sum over its draft nodes of the probability
that the node is accepted.  That probability is estimated from the drafter's own score for the node
(its cumulative probability) times a per-depth calibration factor learnt online from what
verification actually accepted.  Cost comes from the machine's :class:`~probe_mtp.cost.CostCurve`
at the context length decoding has reached (wide passes grow dearer as the cache grows), plus what
every step costs outside the forward pass (drafting, verification, bookkeeping): the decoder
reports each step's timings, and the policy keeps running means of that overhead and of how the
real passes compare with the curve (which is timed in a tight loop), so a step of N inputs costs
``c(N, L) * size_factor(N) + overhead / scale`` in the curve's units.  ``scale`` follows the
machine (a shared machine's slow phases); ``size_factor`` how far passes of N's size class (1,
2-3, 4-7, ... inputs) stray from the curve relative to the others (on our 2-core CPU wide
passes ran further from their tight-loop times than narrow ones).  A fixed per-step cost favours fewer,
larger steps over many bare ones.

With masks (``k`` per node) a pass over ``n`` draft nodes has ``(k+1)(n+1)`` inputs; a mask-free
pass has ``n+1``.  A drafter that puts its masks on a few nodes only (``mask_nodes``, chosen by its
``mask_owners``) pays ``n + 1 + k * min(mask_nodes, n + 1)``.  Masks pay for themselves only through the next step's proposals, so the choice
between the two compares steady states: the best tree with masks against the best tree built from
the proposals that need no masks (for the ESP drafter: none, i.e. a bare one-token step).  When the
mask-free side wins, the masks are re-probed now and then (after 1, 2, 4, ... 64 mask-free steps) to
see whether they have become worth their cost again.  Only the tree's size changes, never what
verification accepts, so decoding stays lossless.

The per-depth calibration makes the estimates right on average over the trees verified, but the
budget picks a wide tree exactly when its estimates run high, so wide passes tend to yield less
than estimated (and more so with a warm drafting memory, whose carried proposals widen the trees).
Per size class, the policy therefore also keeps what passes of that class yielded against what
their plans expected (:class:`YieldCalibration`) and scales a plan's expected draft tokens by it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from .cost import CostCurve
from .drafters import Drafter
from .tree import TokenTree, best_order, choose_node_count, keep_nodes, path_monotone

MAX_DEPTH_TRACKED = 64
MAX_BACKOFF = 64
CONTEXT_BUCKET = 64  # the cost tables follow the context in steps of this many tokens
TIMING_DECAY = 0.9  # weight of the past in the running step timings (about the last 10 steps)
SIZE_CLASSES = 7  # pass sizes 1, 2-3, 4-7, 8-15, 16-31, 32-63, 64+: a size factor each


def size_class(inputs: int) -> int:
    """The size class of a pass of ``inputs`` inputs: floor(log2(inputs)), at most 6."""
    return min(int(inputs).bit_length() - 1, SIZE_CLASSES - 1)


@dataclass
class StepPlan:
    """What to verify this step: the (cut) tree, the masks per owner, the nodes that carry them
    (None: every node) and the number of inputs to pad the pass to (0: no padding)."""

    tree: TokenTree
    num_masks: int
    pad_to: int = 0
    owners: np.ndarray | None = None

    @property
    def num_inputs(self) -> int:
        carriers = self.tree.size if self.owners is None else int(self.owners.size)
        return self.tree.size + self.num_masks * carriers


def owners_for(tree: TokenTree, num_masks: int, mask_owners) -> np.ndarray | None:
    """The nodes of ``tree`` that carry masks: ``mask_owners(tree)`` (None: every node)."""
    if not num_masks or mask_owners is None:
        return None
    owners = mask_owners(tree)
    return None if owners is None else np.asarray(owners, dtype=np.int64)


class BudgetPolicy(ABC):
    """Sizes each step's tree: every hook the decoding loop calls, with its default.

    Per step the loop calls :meth:`score_floor` (handed to the drafter before it proposes),
    :meth:`plan` (the tree to verify, its masks and padding), :meth:`observe` (what was accepted)
    and :meth:`observe_timing` (how long the pass and the step took)."""

    @abstractmethod
    def plan(self, tree: TokenTree, context_length: int | None = None) -> StepPlan:
        """The step's plan for the drafter's proposed ``tree`` at ``context_length`` cached tokens."""

    def observe(self, tree: TokenTree, accepted: np.ndarray) -> None:
        """The verified ``tree`` and its accepted path (root first)."""

    def observe_timing(self, inputs: int, context: int, forward_seconds: float, step_seconds: float) -> None:
        """One step's pass of ``inputs`` on ``context`` cached tokens took ``forward_seconds``, the
        whole step ``step_seconds``."""

    def score_floor(self) -> float:
        """Drafter scores below this cannot pay for their input (0: propose the whole budget)."""
        return 0.0

    def choice_counts(self) -> dict:
        """How often each kind of step was chosen (for the statistics)."""
        return {}

    def head_padding(self, max_rows: int) -> np.ndarray | None:
        """Row counts to run the output layer on (see :meth:`CostCurve.head_padding`); None: as many
        as wanted."""
        return None


class DepthCalibration:
    """Per depth d: how many accepted nodes the drafter's scores at depth d are worth.

    ``factor[d] = (accepted[d] + 1) / (score_sum[d] + 1)``, with exponentially decayed sums (recent
    steps weigh more, so the estimate follows the task: copying phases, reasoning phases)."""

    def __init__(self, decay: float = 0.97, max_depth: int = MAX_DEPTH_TRACKED):
        self.decay = float(decay)
        self.accepted = np.zeros(max_depth + 1)
        self.score_sum = np.zeros(max_depth + 1)

    def factor(self, depths: np.ndarray) -> np.ndarray:
        d = np.minimum(depths, self.accepted.shape[0] - 1)
        return (self.accepted[d] + 1.0) / (self.score_sum[d] + 1.0)

    def estimates(self, tree: TokenTree) -> np.ndarray:
        """Acceptance probability per node (1 at the root), non-increasing along paths."""
        est = np.clip(tree.scores * self.factor(tree.depths), 0.0, 1.0)
        est[0] = 1.0
        return path_monotone(tree, est)

    def observe(self, tree: TokenTree, accepted_depth: int) -> None:
        if tree.size <= 1:
            return
        self.accepted *= self.decay
        self.score_sum *= self.decay
        top = self.accepted.shape[0] - 1
        depths = np.minimum(tree.depths[1:], top)
        np.add.at(self.score_sum, depths, tree.scores[1:])
        self.accepted[1 : min(accepted_depth, top) + 1] += 1.0


class YieldCalibration:
    """Per size class of pass: the draft tokens its passes yielded against the sum of the
    estimates their plans were chosen on, as decayed sums (a class moves only when one of its
    passes is seen).  ``factor(c) = (yielded + PRIOR) / (expected + PRIOR)``, within
    [MIN_FACTOR, MAX_FACTOR]: 1 before any evidence."""

    PRIOR = 2.0  # pseudo draft tokens: a few passes before the factor moves far
    MIN_FACTOR, MAX_FACTOR = 0.25, 1.5

    def __init__(self, decay: float = 0.97):
        self.decay = float(decay)
        self.yielded = np.zeros(SIZE_CLASSES)
        self.expected = np.zeros(SIZE_CLASSES)

    def factors(self) -> np.ndarray:
        raw = (self.yielded + self.PRIOR) / (self.expected + self.PRIOR)
        return np.clip(raw, self.MIN_FACTOR, self.MAX_FACTOR)

    def observe(self, size_class_: int, expected: float, yielded: int) -> None:
        c = int(size_class_)
        self.yielded[c] = self.decay * self.yielded[c] + float(yielded)
        self.expected[c] = self.decay * self.expected[c] + float(expected)


@dataclass
class BudgetState:
    """What the adaptive budget learns, kept across requests by the decoder's drafting memory:
    acceptance per depth and per size class (discounted at each request's start,
    :meth:`begin_request`), the running scale of real passes against the curve, each size class's
    factor, and the step overhead (in seconds and in the curve's units)."""

    calibration: DepthCalibration = field(default_factory=DepthCalibration)
    yields: YieldCalibration = field(default_factory=YieldCalibration)
    size_factors: np.ndarray = field(default_factory=lambda: np.ones(SIZE_CLASSES))
    scale: float | None = None  # running mean of real forward time / curve time
    overhead_seconds: float = 0.0
    step_overhead: float = 0.0  # running mean, in the curve's units (added to every pass)

    def begin_request(self, carry: float) -> None:
        """A new request starts: the acceptance sums (per depth, per size class) keep ``carry`` of
        their weight; the machine's timings (scale, overhead, size factors) are kept whole."""
        for sums in (self.calibration.accepted, self.calibration.score_sum, self.yields.yielded, self.yields.expected):
            sums *= carry

    def as_arrays(self) -> dict[str, np.ndarray]:
        return {
            "accepted": self.calibration.accepted.copy(),
            "score_sum": self.calibration.score_sum.copy(),
            "size_factors": self.size_factors.copy(),
            "yielded": self.yields.yielded.copy(),
            "expected": self.yields.expected.copy(),
            "timings": np.array([np.nan if self.scale is None else self.scale, self.overhead_seconds, self.step_overhead]),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "BudgetState":
        state = cls()
        parts = [("accepted", state.calibration.accepted), ("score_sum", state.calibration.score_sum),
                 ("size_factors", state.size_factors)]
        # files written before the yield calibration lack it: it starts empty
        parts += [(n, t) for n, t in (("yielded", state.yields.yielded), ("expected", state.yields.expected)) if n in arrays]
        for name, target in parts:
            value = np.asarray(arrays[name], dtype=np.float64)
            if value.shape != target.shape or not np.all(np.isfinite(value)) or np.any(value < 0):
                raise ValueError(f"budget state {name!r} has shape {value.shape}, expected {target.shape}, non-negative")
            target[:] = value
        scale, overhead, step = (float(x) for x in np.asarray(arrays["timings"], dtype=np.float64).reshape(3))
        state.scale = None if not np.isfinite(scale) else scale
        state.overhead_seconds, state.step_overhead = overhead, step
        return state


class AdaptiveBudget(BudgetPolicy):
    """Chooses each step's tree size and masks from a cost curve and running acceptance stats.

    ``num_masks`` is the drafter's k; ``max_inputs`` bounds a pass (the drafter proposes trees
    sized for it).  ``mask_free(tree)`` tells which draft nodes the drafter could have proposed
    without masks (None: none of them when k > 0, all of them when k = 0).  ``mask_owners(tree)``
    and ``mask_nodes``: the drafter puts its masks on ``mask_nodes`` nodes only, the ones
    ``mask_owners`` names (None: on every node)."""

    def __init__(self, curve: CostCurve, num_masks: int, max_inputs: int, mask_free=None, mask_owners=None, mask_nodes=None,
                 state: BudgetState | None = None):
        self.state = state if state is not None else BudgetState()
        self.k = int(num_masks)
        self.mask_owners = mask_owners
        self.mask_nodes = None if mask_owners is None else mask_nodes
        self.max_inputs = int(max_inputs)
        self.curve = curve
        self._tables: dict[int | None, tuple[np.ndarray, np.ndarray]] = {}
        self._classes = np.array([0] + [size_class(n) for n in range(1, self.max_inputs + 1)])
        self._use_context(None)
        self.mask_free = mask_free
        self.free_steps = 0
        self.backoff = 1
        self.choices = {"mask": 0, "free": 0, "probe": 0}
        self._gain_factors = self.state.yields.factors()[self._classes]  # per input count
        self._pending: tuple[int, float] | None = None  # the last plan's (size class, expected draft tokens)

    @classmethod
    def for_drafter(cls, curve: CostCurve, drafter: Drafter, max_inputs: int,
                    state: BudgetState | None = None) -> "AdaptiveBudget":
        """The policy for ``drafter``'s trees: its masks, their owners and its mask-free proposals;
        ``state``: what earlier requests learnt (None: start from scratch)."""
        return cls(curve, drafter.num_masks, max_inputs, mask_free=drafter.mask_free_nodes,
                   mask_owners=drafter.mask_owners, mask_nodes=drafter.mask_nodes, state=state)

    # the learnt parts live in the state (shared across requests)
    @property
    def calibration(self) -> DepthCalibration:
        return self.state.calibration

    @property
    def size_factors(self) -> np.ndarray:
        return self.state.size_factors

    @property
    def step_overhead(self) -> float:
        return self.state.step_overhead

    @step_overhead.setter
    def step_overhead(self, value: float) -> None:
        self.state.step_overhead = float(value)

    def choice_counts(self) -> dict:
        return dict(self.choices)

    def head_padding(self, max_rows: int) -> np.ndarray:
        return self.curve.head_padding(max_rows)

    def _use_context(self, context: int | None) -> None:
        """Cost the pass sizes at ``context`` cached tokens (the middle of its bucket)."""
        key = None
        if context is not None and self.curve.long_seconds is not None:
            key = (int(context) // CONTEXT_BUCKET) * CONTEXT_BUCKET + CONTEXT_BUCKET // 2
        if key not in self._tables:
            costs = np.array([self.curve.cost(n, key) for n in range(1, self.max_inputs + 1)])
            # a pass of N inputs is padded to the size M >= N that costs least (the 2-3 input CPU
            # trap: 4 or 8 inputs can cost less than 2), so N effectively costs min over M >= N of c(M)
            suffix_best = np.array([n + int(np.argmin(costs[n:])) for n in range(costs.shape[0])])
            padded = costs[suffix_best]
            self._tables[key] = (np.concatenate([[0], suffix_best + 1]), np.concatenate([[0.0], padded]))
        self.pad_to, self._curve_costs = self._tables[key]
        self._price()

    def _price(self) -> None:
        """The cost table in use: the curve's padded costs times each padded size's size factor,
        and ``input_price``, the cheapest average price of one more input, from a bare pass to any
        wider one."""
        self.cost_table = self._curve_costs * self.size_factors[self._classes[self.pad_to]]
        widen = (self.cost_table[2:] - self.cost_table[1]) / np.arange(1, self.cost_table.shape[0] - 1)
        self.input_price = max(float(widen.min()), 0.0) if widen.size else 0.0

    def _cost(self, n: int) -> float:
        return float(self.cost_table[min(n, self.max_inputs)]) + self.step_overhead

    def observe_timing(self, inputs: int, context: int, forward_seconds: float, step_seconds: float) -> None:
        """One step's timings: its pass of ``inputs`` (padding included) on ``context`` cached
        tokens took ``forward_seconds``, the whole step ``step_seconds``."""
        if inputs < 1 or forward_seconds <= 0 or step_seconds < forward_seconds:
            return
        predicted = self.curve.cost(int(inputs), int(context))  # a one-row curve ignores the context
        ratio = forward_seconds / predicted
        overhead = step_seconds - forward_seconds
        st = self.state
        if st.scale is None:
            st.scale, st.overhead_seconds = ratio, overhead
        else:
            st.scale = TIMING_DECAY * st.scale + (1 - TIMING_DECAY) * ratio
            st.overhead_seconds = TIMING_DECAY * st.overhead_seconds + (1 - TIMING_DECAY) * overhead
        st.step_overhead = st.overhead_seconds / st.scale
        # the size class's factor moves only when one of its passes is seen (a class seldom used
        # keeps what it learnt: how a size strays from the curve is the machine's, not the phase's)
        c = size_class(inputs)
        self.size_factors[c] = TIMING_DECAY * self.size_factors[c] + (1 - TIMING_DECAY) * ratio / st.scale
        self._price()

    def score_floor(self) -> float:
        """The drafter score below which a node cannot pay for the input it takes, so the drafter
        need not propose it.  A bare step yields ``1 / cost(1)`` tokens per unit of cost and every
        plan is worth at least that; an input costs at least ``input_price`` (the cheapest average
        price of widening a bare pass), so a node accepted with probability ``e`` pays only if
        ``e >= input_price / cost(1)``.  Expressed in drafter scores (estimates are scores times a
        per-depth factor, at most its largest).  A heuristic bound: where the curve is flat a few
        nodes below it would ride along for free, each adding less than the floor."""
        estimate_floor = self.input_price / self._cost(1)
        return estimate_floor / float(self.calibration.factor(np.arange(self.calibration.accepted.shape[0])).max())

    def _inputs(self, size: int, k: int) -> int:
        """Inputs of a pass over a tree of ``size`` nodes (root included) with k masks per owner."""
        carriers = size if self.mask_nodes is None else min(self.mask_nodes, size)
        return size + k * carriers

    def _best(self, tree: TokenTree, est: np.ndarray, candidates: np.ndarray, k: int):
        order = candidates[np.lexsort((candidates, -est[candidates]))]
        n, value = choose_node_count(est[order], self._cost, lambda size: self._inputs(size, k), max_inputs=self.max_inputs,
                                     gain_factor=lambda inputs: float(self.gain_factors(inputs)))
        return order[: max(n, 0)], n, value

    def plan(self, tree: TokenTree, context_length: int | None = None) -> StepPlan:
        """The step's plan for ``tree``, with passes costed at ``context_length`` cached tokens."""
        self._use_context(context_length)
        est = self.calibration.estimates(tree)
        draft = best_order(tree, est)
        if self.k == 0:
            keep, _, _ = self._best(tree, est, draft, 0)
            return self._padded(keep_nodes(tree, keep), 0, est[keep].sum())
        free = self._free_nodes(tree)
        keep_free, n_free, v_free = self._best(tree, est, draft[free[draft]], 0)
        keep_mask, n_mask, v_mask = self._best(tree, est, draft, self.k)
        has_mask_proposals = tree.size > 1 and not bool(free[1:].all())
        if n_mask >= 0 and has_mask_proposals and v_mask >= v_free:
            self.free_steps, self.backoff = 0, 1
            self.choices["mask"] += 1
            return self._padded(keep_nodes(tree, keep_mask), self.k, est[keep_mask].sum())
        if self.free_steps >= self.backoff:
            # re-probe: attach masks so that the next step sees fresh mask proposals (with the
            # smallest tree when no size is efficient: one such step in `backoff` costs little)
            self.free_steps = 0
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
            self.choices["probe"] += 1
            keep = keep_mask if n_mask >= 0 else draft[:0]
            return self._padded(keep_nodes(tree, keep), self.k, est[keep].sum())
        self.free_steps += 1
        self.choices["free"] += 1
        return self._padded(keep_nodes(tree, keep_free), 0, est[keep_free].sum())

    # ------------------------------------------------------------------ one row of a batch
    def row_choice(self, tree: TokenTree, context: int) -> RowChoice:
        """This row's ways to fill its part of a batched pass, best nodes first: without masks,
        and (when the drafter has them) with masks."""
        self._use_context(context)
        est = self.calibration.estimates(tree)
        draft = best_order(tree, est)
        free = self._free_nodes(tree) if self.k else np.ones(tree.size, dtype=bool)
        gains = lambda order: np.concatenate([[0.0], np.cumsum(est[order])])  # noqa: E731
        free_order = draft[free[draft]]
        masked = None
        if self.k:
            masked = (draft, gains(draft), tree.size > 1 and not bool(free[1:].all()))
        return RowChoice(tree, (free_order, gains(free_order)), masked, lambda size, k: self._inputs(size, k), self.k)

    def row_plan(self, choice: RowChoice, width: int) -> StepPlan:
        """This row's plan within ``width`` inputs: the variant with the most expected tokens (masks
        when their proposals are worth at least as much; otherwise re-probed now and then, as in
        :meth:`plan`)."""
        n_free = choice.fit(False, width)
        n_mask = choice.fit(True, width)
        use_masks = n_mask >= 0 and choice.masked[2] and choice.gain(True, n_mask) >= choice.gain(False, n_free)
        if use_masks:
            self.free_steps, self.backoff = 0, 1
            self.choices["mask"] += 1
        elif n_mask >= 0 and self.free_steps >= self.backoff:
            self.free_steps, self.backoff = 0, min(2 * self.backoff, MAX_BACKOFF)
            self.choices["probe"] += 1
            use_masks = True
        elif self.k:
            self.free_steps += 1
            self.choices["free"] += 1
        order, n, k = (choice.masked[0], n_mask, self.k) if use_masks else (choice.free[0], max(n_free, 0), 0)
        kept = keep_nodes(choice.tree, order[:n])
        plan = StepPlan(kept, k, 0, owners_for(kept, k, self.mask_owners))
        self._pending = (size_class(plan.num_inputs), max(choice.gain(use_masks, n), 0.0))
        return plan

    def gain_factors(self, inputs: np.ndarray) -> np.ndarray:
        """The yield calibration's factor for passes of each of ``inputs`` inputs (see
        :class:`YieldCalibration`)."""
        return self._gain_factors[np.minimum(inputs, self._gain_factors.shape[0] - 1)]

    def row_width_limit(self, rows: int) -> int:
        """The most inputs one row of a batched pass of ``rows`` rows may take (``max_inputs`` over
        the rows, at least 1)."""
        return max(1, self.max_inputs // rows)

    def batch_pass_cost(self, inputs: int, context: int) -> float:
        """The curve's cost of a batched pass of ``inputs`` inputs in all (rows x width), in its
        units, without the step overhead."""
        return self.curve.cost(int(inputs), int(context)) * self.size_factors[size_class(inputs)]

    def _padded(self, tree: TokenTree, k: int, expected: float) -> StepPlan:
        plan = StepPlan(tree, k, 0, owners_for(tree, k, self.mask_owners))
        inputs = plan.num_inputs
        self._pending = (size_class(inputs), float(expected))
        pad = int(self.pad_to[inputs]) if inputs <= self.max_inputs else 0
        plan.pad_to = pad if pad > inputs else 0
        return plan

    def _free_nodes(self, tree: TokenTree) -> np.ndarray:
        given = None if self.mask_free is None else self.mask_free(tree)
        free = np.zeros(tree.size, dtype=bool) if given is None else np.asarray(given, dtype=bool).copy()
        free[0] = True
        # a node is usable without masks only if its whole path is
        for d in range(1, tree.max_depth + 1):
            at = np.flatnonzero(tree.depths == d)
            free[at] &= free[tree.parents[at]]
        return free

    def observe(self, tree: TokenTree, accepted: np.ndarray) -> None:
        depth = int(tree.depths[accepted[-1]])
        self.calibration.observe(tree, depth)
        if self._pending is not None and tree.size > 1:
            size_class_, expected = self._pending
            self.state.yields.observe(size_class_, expected, depth)
            self._gain_factors = self.state.yields.factors()[self._classes]
        self._pending = None


class FixedBudget(BudgetPolicy):
    """The paper's mode: every step verifies the drafter's whole tree with its k masks."""

    def __init__(self, num_masks: int, mask_owners=None):
        self.k = int(num_masks)
        self.mask_owners = mask_owners

    @classmethod
    def for_drafter(cls, drafter: Drafter) -> "FixedBudget":
        return cls(drafter.num_masks, drafter.mask_owners)

    def plan(self, tree: TokenTree, context_length: int | None = None) -> StepPlan:
        return StepPlan(tree, self.k, 0, owners_for(tree, self.k, self.mask_owners))




# ---------------------------------------------------------------------------------- batches
@dataclass
class RowChoice:
    """One row's ways to fill a batched pass: ``free`` (draft nodes needing no masks, best first,
    and the running sum of their acceptance estimates) and ``masked`` (every draft node, the same
    sums, and whether any node came from the masks; None without masks); ``inputs(size, k)``."""

    tree: TokenTree
    free: tuple[np.ndarray, np.ndarray]
    masked: tuple[np.ndarray, np.ndarray, bool] | None
    inputs: object
    num_masks: int

    def fit(self, masks: bool, width: int) -> int:
        """The most draft nodes of a variant within ``width`` inputs; -1 when not even the root fits."""
        if masks and self.masked is None:
            return -1
        order, k = (self.masked[0], self.num_masks) if masks else (self.free[0], 0)
        n = -1
        while n + 1 <= order.shape[0] and self.inputs(n + 2, k) <= width:
            n += 1
        return n

    def gain(self, masks: bool, n: int) -> float:
        """Expected draft tokens of a variant's best ``n`` nodes."""
        return -1.0 if n < 0 else float((self.masked if masks else self.free)[1][n])

    def best_gains(self, widths: np.ndarray) -> np.ndarray:
        """At every width of ``widths``: the expected draft tokens of the better variant within it
        (``max(gain(v, fit(v, width)) for v in variants)``, at least 0), all widths at once."""
        best = np.zeros(widths.shape[0])
        for masks in (False, True):
            if masks and self.masked is None:
                continue
            order, sums, k = (self.masked[0], self.masked[1], self.num_masks) if masks else (*self.free, 0)
            # inputs of the variant's best m nodes (m = 0..len), rising with m: fit = the last m within a width
            needed = np.array([self.inputs(m + 1, k) for m in range(order.shape[0] + 1)])
            n = np.searchsorted(needed, widths, side="right") - 1
            best = np.maximum(best, np.where(n >= 0, sums[np.maximum(n, 0)], 0.0))
        return best


class BatchWidthCosts:
    """What a batched pass really costs by width (inputs per row), measured on the batches
    themselves: a running mean of the seconds of every (rows, width) pass seen.

    The one-row cost curve prices a pass of B rows x W inputs as one row of B*W inputs, which holds
    for the weights but not for attention: B rows read B contexts, and a pass of W > 1 queries per
    row can take another attention path than a bare one (on GPUs transformers' sdpa copies grouped
    key/value heads for it; on CPUs :mod:`probe_mtp.attention` avoids the copy; see
    docs/benchmarks.md for the measured figures).  Once a bare pass (width 1) and a width W have
    been timed over the same number of rows, W is priced by their measured ratio; a width not yet
    timed is priced by the curve, but never below the dearest measured narrower width (a wider pass
    costs at least as much)."""

    def __init__(self, decay: float = TIMING_DECAY):
        self.decay = float(decay)
        self.seconds: dict[tuple[int, int], float] = {}  # (rows, width) -> running mean seconds

    def observe(self, rows: int, width: int, seconds: float) -> None:
        if seconds <= 0:
            return
        old = self.seconds.get((rows, width))
        self.seconds[(rows, width)] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def relative(self, rows: int, width: int, curve_ratio: float) -> float:
        """The cost of a pass of ``rows`` x ``width`` relative to a bare pass over as many rows:
        measured, else ``curve_ratio``, at least the largest ratio measured for a narrower width."""
        bare = self.seconds.get((rows, 1))
        if width == 1 or bare is None:
            return 1.0 if width == 1 else curve_ratio
        if (rows, width) in self.seconds:
            return self.seconds[(rows, width)] / bare
        narrower = [t / bare for (r, w), t in self.seconds.items() if r == rows and 1 < w < width]
        return max([curve_ratio] + narrower)


def laggard_weights(remaining_passes: np.ndarray, row_share: float) -> np.ndarray:
    """What a drafted token of each row is worth to a batch, relative to a token of the row that
    will finish last.  The batch runs until its last row stops, and a pass costs the weights' read
    whatever its rows plus a little per input (``row_share``: one row's part of a pass's cost).
    A token gained by the last row saves a whole pass; one gained by a row that finishes earlier
    saves only its own share of the passes it is still in.  ``remaining_passes``: each row's
    expected passes left (tokens left over its tokens per pass so far); which row finishes last is
    uncertain, so rows within about a tenth of the horizon of the last share its weight."""
    remaining = np.asarray(remaining_passes, dtype=np.float64)
    if remaining.shape[0] <= 1:
        return np.ones(remaining.shape[0])
    last = float(remaining.max())
    spread = 1.0 + 0.1 * last
    share = min(max(float(row_share), 0.0), 1.0)
    return share + (1.0 - share) * np.exp(-(last - remaining) / spread)


def plan_batch(policies: list[BudgetPolicy], trees: list[TokenTree], contexts: list[int],
               widths: BatchWidthCosts | None = None, weights: np.ndarray | None = None) -> list[StepPlan]:
    """The plans of one batched pass, a tree per row.  Rows share the pass, whose cost follows the
    total of its inputs: every row is padded to the widest row's input count W.  With the adaptive
    budget, W is chosen once for the batch, maximising ``(rows + expected draft tokens of every
    row's best tree within W inputs, each row weighted) / cost(rows x W)``; as the batch grows, W
    shrinks, down to bare one-token steps (W = 1) when no tree pays.  ``widths``: the batch's
    measured pass costs by width (:class:`BatchWidthCosts`), which override the curve's price of a
    width once seen.
    ``weights``: what a drafted token of each row is worth to the batch (:func:`laggard_weights`;
    None: every row alike).  Fixed budgets keep each row's whole tree."""
    if not all(isinstance(p, AdaptiveBudget) for p in policies):
        return [p.plan(t, c) for p, t, c in zip(policies, trees, contexts)]
    lead = policies[0]
    rows, context = len(trees), max(contexts)
    choices = [p.row_choice(t, context) for p, t in zip(policies, trees)]
    bare = lead.batch_pass_cost(rows, context)
    candidates = np.arange(1, lead.row_width_limit(rows) + 1)
    weights = np.ones(rows) if weights is None else np.asarray(weights, dtype=np.float64)
    gains = sum(w * c.best_gains(candidates) * p.gain_factors(candidates) for w, p, c in zip(weights, policies, choices))
    progress = float(weights.sum())
    best_width, best_value = 1, -1.0
    for width, gain in zip(candidates.tolist(), gains.tolist()):
        passes = lead.batch_pass_cost(rows * width, context)
        if widths is not None:
            passes = bare * widths.relative(rows, width, passes / bare)
        value = (progress + gain) / (passes + lead.step_overhead)
        if value > best_value + 1e-12:
            best_width, best_value = width, value
    return [p.row_plan(c, best_width) for p, c in zip(policies, choices)]
