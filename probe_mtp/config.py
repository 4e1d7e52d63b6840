"""The decoder's knobs, in one place.

Every knob is a field of :class:`ProbeConfig` with its documentation in the field's metadata.  The
keyword arguments of ``generate`` / ``custom_generate``, the command line options
(:mod:`probe_mtp.options`), the report's sweeps and the README's configuration table are all derived
from these fields, so a knob is added, documented and validated here only.
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, dataclass, field, fields, replace

from .cost import CostCurve
from .drafters.registry import drafter_class, drafter_names
from .tree import min_block_complexity

MASK_INITS = ("prompt_mean", "last_k", "sample", "token")
SAMPLING_RULES = ("match", "rejection")
ACCEPTANCE_RULES = ("verify", "confadapt")
UNTUNED_MASKS = ("untuned", "prompt_mean")  # masks= values that mean: the mask_init vectors


def parse_budget(text: str) -> int | str:
    """A budget on the command line: ``"auto"`` or an integer number of inputs per pass."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"a budget is an integer or 'auto', got {text!r}") from None


def knob(default, doc: str, *, cli: bool = True, choices: tuple | None = None, sweep: bool = False, cli_type=None):
    """A :class:`ProbeConfig` field: ``doc`` (one paragraph, shown by ``help()``, the CLI and the
    README), ``cli`` (whether the command line offers it), ``choices`` (the allowed values, when a
    fixed set), ``sweep`` (the report may measure several values of it side by side), ``cli_type``
    (how command line text becomes a value, where the default's type does not say)."""
    metadata = {"doc": doc, "cli": cli, "choices": choices, "sweep": sweep, "cli_type": cli_type}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ProbeConfig:
    """Settings of probe-mtp decoding; every field is also a keyword argument of ``generate``."""

    drafter: str = knob(
        "hybrid",
        "Which drafter proposes the tree: 'hybrid' (one tree from the successor table of the model's own earlier "
        "top-k, context lookup and, with num_masks >= 1, the probe masks on the root), 'esp' (embedding-space "
        "probing alone, the paper's method), or the mask-free baselines 'pld' (prompt lookup), 'lookahead' "
        "(lookahead decoding), 'stand' (n-gram memory of the model's logits) and 'ar' (plain one-token decoding "
        "through the same loop). A Drafter instance is accepted by generate() too.",
        choices=drafter_names(),
        sweep=True,
    )
    num_masks: int = knob(
        1,
        "k: mask inputs per tree node (the hybrid puts them on the root only); mask j proposes depth j. "
        "0 turns the probe off (hybrid only); ignored by the mask-free drafters.",
    )
    budget: int | str = knob(
        "auto",
        "Inputs of one verification pass (block complexity BC = (k + 1) * (1 + draft nodes)), never exceeded; "
        "'auto': each step verifies the tree size (and masks or none) that maximises expected tokens per second "
        "on this machine, from its measured cost curve and running acceptance statistics.",
        sweep=True,
        cli_type=parse_budget,
    )
    max_budget: int = knob(64, "The largest pass budget='auto' may choose.")
    pass_memory: float = knob(
        0.05,
        "For budget='auto': one pass's float32 logits (inputs x vocabulary x 4 bytes) stay under this share of "
        "the model's weight bytes, which bounds what wide passes add to peak memory; 0 turns the cap off.",
    )
    cost_curve: object | None = knob(
        None,
        "For budget='auto': None measures the machine's cost curve once (seconds) and caches it per model, "
        "dtype, device, thread count and processor; or a CostCurve, or a mapping {inputs: seconds}.",
        cli=False,
    )
    cost_cache: bool = knob(
        True,
        "Read and write measured cost curves in the user's cache directory ($PROBE_MTP_CACHE_DIR, else "
        "~/.cache/probe-mtp); False measures afresh per decoder.",
    )
    mask_init: str = knob(
        "prompt_mean",
        "Initial mask vectors: 'prompt_mean' (mean of the prompt's input embeddings, the paper's best), "
        "'last_k' (embeddings of the last k prompt tokens), 'sample' (a seeded draw from N(mu, sigma^2 I) "
        "fitted to the vocabulary embeddings) or 'token' (the embedding of mask_token).",
        choices=MASK_INITS,
    )
    mask_update: float = knob(0.1, "lambda of the EMA update m <- m + lambda (E[e_t] - m) after every generated token; 0 freezes the vectors.")
    mask_token: int | None = knob(None, "Token id for mask_init='token'.", cli_type=int)
    mask_seed: int = knob(0, "Seed of mask_init='sample'.")
    prune_repeats: bool = knob(True, "Drop a candidate equal to its parent's token (the next best takes its place).")
    sampling_rule: str = knob(
        "match",
        "Lossless sampling rule: 'match' (sample-and-match, exact for any tree) or 'rejection' (recursive "
        "rejection over children drawn i.i.d. from the masks, for drafter='esp'; other drafters use 'match').",
        choices=SAMPLING_RULES,
    )
    masks: object = knob(
        "auto",
        "Tuned mask vectors: 'auto' (the vectors shipped for the loaded model when there are some for it and "
        "mask_init is 'prompt_mean', else the untuned mask_init), 'untuned' (always mask_init; 'prompt_mean' "
        "says the same), 'bundled' (the shipped vectors, an error when none fit), a file written by `probe-mtp "
        "tune-masks`, or a TunedMasks. Lossless whichever; vectors of another model are refused.",
        sweep=True,
        cli_type=str,
    )
    acceptance: str = knob(
        "verify",
        "'verify' (lossless, the default) or 'confadapt' (LOSSY, greedy only: after verification also emit the "
        "longest run of mask predictions whose top-1 probability is at least threshold, unverified).",
        choices=ACCEPTANCE_RULES,
        sweep=True,
    )
    threshold: float = knob(0.9, "ConfAdapt's top-1 probability threshold (above 1 never emits).")

    def __post_init__(self) -> None:
        cls = drafter_class(self.drafter)
        self._check_budget(cls)
        if self.mask_init not in MASK_INITS:
            raise ValueError(f"mask_init must be one of {MASK_INITS}, got {self.mask_init!r}")
        if self.mask_init == "token" and self.mask_token is None:
            raise ValueError("mask_init='token' needs mask_token=<token id>")
        if not 0.0 <= float(self.mask_update) <= 1.0:
            raise ValueError(f"mask_update (the EMA rate lambda) must lie in [0, 1], got {self.mask_update!r}")
        if self.sampling_rule not in SAMPLING_RULES:
            raise ValueError(f"sampling_rule must be one of {SAMPLING_RULES}, got {self.sampling_rule!r}")
        self._check_tuning_knobs(cls)

    def _check_budget(self, cls) -> None:
        fewest_masks = 0 if cls.mask_use == "optional" else 1
        if not isinstance(self.num_masks, int) or isinstance(self.num_masks, bool) or self.num_masks < fewest_masks:
            why = "0 turns the probe off" if fewest_masks == 0 else "the probe needs at least one mask"
            raise ValueError(f"num_masks must be an integer >= {fewest_masks} for drafter={self.drafter!r} ({why}), got {self.num_masks!r}")
        if self.budget != "auto" and (not isinstance(self.budget, int) or isinstance(self.budget, bool)):
            raise TypeError(f"budget must be an integer number of inputs per pass or 'auto', got {self.budget!r}")
        if not isinstance(self.max_budget, int) or isinstance(self.max_budget, bool):
            raise TypeError(f"max_budget must be an integer number of inputs per pass, got {self.max_budget!r}")
        if isinstance(self.pass_memory, bool) or not isinstance(self.pass_memory, (int, float)) \
                or not 0 <= self.pass_memory < math.inf:
            raise ValueError(f"pass_memory must be a share >= 0 of the weights' bytes (0: no cap), got {self.pass_memory!r}")
        if self.cost_curve is not None and not isinstance(self.cost_curve, (dict, CostCurve)):
            raise TypeError(f"cost_curve must be None, a CostCurve or a mapping {{inputs: seconds}}, got {self.cost_curve!r}")
        masks = 0 if cls.mask_use == "none" else self.num_masks
        smallest = min_block_complexity(masks)
        if self.tree_budget < smallest:
            what = (f"for drafter={self.drafter!r}: the smallest tree (root + one draft node) needs {smallest} inputs"
                    if masks == 0 else
                    f"for num_masks={self.num_masks}: the smallest tree (root + one draft node, each with {self.num_masks} "
                    f"mask(s)) needs {smallest} inputs")
            raise ValueError(f"{self._budget_name}={self.tree_budget} is too small {what}; use {self._budget_name} >= {smallest}")

    def _check_tuning_knobs(self, cls) -> None:
        from .tuned_masks import TunedMasks

        if self.masks is not None and not isinstance(self.masks, (str, os.PathLike, TunedMasks)):
            raise TypeError(f"masks must be a path to a tuned mask file (or a TunedMasks), got {type(self.masks).__name__}")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {self.acceptance!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not self.threshold >= 0 \
                or not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be a number >= 0 (ConfAdapt's top-1 probability bound), got {self.threshold!r}")
        if self.acceptance == "confadapt" and cls.mask_use == "none":
            raise ValueError(
                f"acceptance='confadapt' emits mask predictions, but drafter={self.drafter!r} uses no masks; use drafter='esp'"
            )

    @property
    def adaptive(self) -> bool:
        return self.budget == "auto"

    @property
    def tree_budget(self) -> int:
        """The block complexity drafters size their trees for: ``budget``, or ``max_budget`` when
        the budget is adaptive (the adaptive policy then cuts each tree down)."""
        return self.max_budget if self.adaptive else int(self.budget)

    @property
    def _budget_name(self) -> str:
        return "max_budget" if self.adaptive else "budget"

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def knobs(cls) -> tuple:
        """The fields with their metadata (``doc``, ``cli``, ``choices``, ``sweep``)."""
        return fields(cls)

    @classmethod
    def default(cls, name: str):
        return next(f.default for f in fields(cls) if f.name == name and f.default is not MISSING)

    @classmethod
    def from_kwargs(cls, base: "ProbeConfig | None" = None, **kwargs) -> "ProbeConfig":
        """``base`` (default settings if None) with the given fields replaced."""
        unknown = set(kwargs) - set(cls.field_names())
        if unknown:
            raise TypeError(f"unknown probe-mtp option(s): {sorted(unknown)}; known: {list(cls.field_names())}")
        return replace(base or cls(), **kwargs)


def config_table() -> str:
    """The configuration as a markdown table (knob, default, meaning): the README's table."""
    lines = ["| knob | default | meaning |", "| --- | --- | --- |"]
    for f in ProbeConfig.knobs():
        lines.append(f"| `{f.name}` | `{f.default!r}` | {f.metadata['doc']} |")
    return "\n".join(lines)


ProbeConfig.__doc__ += "\n\n" + "\n".join(f"- ``{f.name}`` (default ``{f.default!r}``): {f.metadata['doc']}" for f in fields(ProbeConfig))
