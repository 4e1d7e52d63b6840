"""The decoder's knobs."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace

from .tree import min_block_complexity

MASK_INITS = ("prompt_mean", "last_k", "sample", "token")
SAMPLING_RULES = ("match", "rejection")
ACCEPTANCE_RULES = ("verify", "confadapt")
DRAFTERS = ("esp", "hybrid", "pld", "lookahead", "stand", "ar")
# drafters that append no mask inputs: ``num_masks`` is validated but does not apply to them
MASK_FREE_DRAFTERS = ("pld", "lookahead", "stand", "ar")
# drafters for which the probe is one source among others: ``num_masks=0`` turns it off
MASKS_OPTIONAL_DRAFTERS = ("hybrid",)


@dataclass(frozen=True)
class ProbeConfig:
    """Settings of probe-mtp decoding (all also accepted as keyword arguments of ``generate``).

    - ``num_masks`` (k): mask inputs appended to every tree node; mask j proposes depth j.
    - ``budget`` (BC): inputs of one verification pass, ``(k + 1) * (1 + draft nodes)``; never
      exceeded.  BC=30 with k=1 is one level of 14 alternatives.  ``"auto"``: each step verifies
      the tree size (and masks or none) that maximises expected tokens per second on this machine,
      from its measured cost curve and running acceptance statistics, up to ``max_budget`` inputs
      (see :mod:`probe_mtp.adaptive`).
    - ``max_budget``: the largest pass ``budget="auto"`` may choose.
    - ``pass_memory``: for ``budget="auto"``: one pass's float32 logits (inputs x vocabulary x 4
      bytes) stay under this share of the model's weight bytes, which bounds what wide passes add
      to peak memory (Gemma 3 270M, 262k vocabulary: 51 inputs at 0.05; SmolLM2: no cap below
      ``max_budget``); 0 turns the cap off.
    - ``cost_curve``: for ``budget="auto"``: None (measure it once, about 9 s for SmolLM2 and 14 s
      for Gemma 3 on 2 CPU cores, with the output layer's time per row count, and cache it on disk
      per model, dtype, device and thread count), a :class:`~probe_mtp.cost.CostCurve`, or a
      mapping ``{inputs: seconds}`` to supply one.
    - ``cost_cache``: read and write measured cost curves in the user's cache directory
      (``$PROBE_MTP_CACHE_DIR``, else ``~/.cache/probe-mtp``); False measures afresh per decoder.
    - ``mask_init``: ``"prompt_mean"`` (mean of the prompt's input embeddings; the paper's best),
      ``"last_k"`` (embeddings of the last k prompt tokens, one per mask slot), ``"sample"`` (a
      seeded draw from N(mu, sigma^2 I) fitted to the vocabulary embeddings) or ``"token"`` (the
      embedding of ``mask_token``).
    - ``mask_update`` (lambda): EMA update ``m <- m + lambda (E[e_t] - m)`` after every generated
      token; 0 freezes the vectors.
    - ``mask_token``: token id for ``mask_init="token"``.
    - ``mask_seed``: seed of ``mask_init="sample"``.
    - ``prune_repeats``: drop a candidate equal to its parent's token (next-best takes its place).
    - ``drafter``: which drafter proposes the tree: ``"esp"`` (embedding-space probing, uses
      ``num_masks``), ``"hybrid"`` (one tree from the successor table, context lookup and, with
      ``num_masks`` >= 1, the probe, whose k masks it puts on the root only; ``num_masks=0`` is
      allowed for it), or the mask-free
      baselines ``"pld"`` (prompt lookup), ``"lookahead"``
      (lookahead decoding), ``"stand"`` (n-gram memory of the model's logits) and ``"ar"`` (plain
      one-token decoding through the same loop).  The baselines ignore ``num_masks``; their trees
      hold at most ``budget`` nodes, the root included.
    - ``masks``: tuned mask vectors (a file written by ``probe-mtp tune-masks``, ``"bundled"`` for
      the vectors shipped for the loaded model, or a loaded :class:`probe_mtp.tuned_masks.TunedMasks`)
      instead of ``mask_init``; ``mask_update`` still applies on top.  Checked against the model:
      vectors of another model are a ``ValueError``.
    - ``acceptance``: ``"verify"`` (lossless, default) or ``"confadapt"`` (LOSSY, greedy only:
      after verification also emit the longest run of mask predictions whose top-1 probability is
      at least ``threshold``, unverified; see :mod:`probe_mtp.confadapt`).
    - ``threshold``: ConfAdapt's confidence threshold (a value above 1 never emits).
    """

    num_masks: int = 1
    budget: int | str = "auto"
    max_budget: int = 64
    pass_memory: float = 0.05
    cost_curve: object | None = None
    cost_cache: bool = True
    mask_init: str = "prompt_mean"
    mask_update: float = 0.1
    mask_token: int | None = None
    mask_seed: int = 0
    prune_repeats: bool = True
    drafter: str = "hybrid"
    sampling_rule: str = "match"
    masks: object = None
    acceptance: str = "verify"
    threshold: float = 0.9

    def __post_init__(self) -> None:
        fewest_masks = 0 if self.drafter in MASKS_OPTIONAL_DRAFTERS else 1
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
        if self.cost_curve is not None and not isinstance(self.cost_curve, dict) and not hasattr(self.cost_curve, "cost"):
            raise TypeError(f"cost_curve must be None, a CostCurve or a mapping {{inputs: seconds}}, got {self.cost_curve!r}")
        if self.drafter in MASK_FREE_DRAFTERS:
            smallest = min_block_complexity(0)
            if self.tree_budget < smallest:
                raise ValueError(
                    f"{self._budget_name}={self.tree_budget} is too small for drafter={self.drafter!r}: the smallest tree "
                    f"(root + one draft node) needs {smallest} inputs; use {self._budget_name} >= {smallest}"
                )
        else:
            smallest = min_block_complexity(self.num_masks)
            if self.tree_budget < smallest:
                raise ValueError(
                    f"{self._budget_name}={self.tree_budget} is too small for num_masks={self.num_masks}: the smallest tree "
                    f"(root + one draft node, each with {self.num_masks} mask(s)) needs {smallest} inputs; "
                    f"use {self._budget_name} >= {smallest}"
                )
        if self.mask_init not in MASK_INITS:
            raise ValueError(f"mask_init must be one of {MASK_INITS}, got {self.mask_init!r}")
        if self.mask_init == "token" and self.mask_token is None:
            raise ValueError("mask_init='token' needs mask_token=<token id>")
        if not 0.0 <= float(self.mask_update) <= 1.0:
            raise ValueError(f"mask_update (the EMA rate lambda) must lie in [0, 1], got {self.mask_update!r}")
        if self.sampling_rule not in SAMPLING_RULES:
            raise ValueError(f"sampling_rule must be one of {SAMPLING_RULES}, got {self.sampling_rule!r}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        self._check_tuning_knobs()

    def _check_tuning_knobs(self) -> None:
        from .tuned_masks import TunedMasks

        if self.masks is not None and not isinstance(self.masks, (str, os.PathLike, TunedMasks)):
            raise TypeError(f"masks must be a path to a tuned mask file (or a TunedMasks), got {type(self.masks).__name__}")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {self.acceptance!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not self.threshold >= 0 \
                or not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be a number >= 0 (ConfAdapt's top-1 probability bound), got {self.threshold!r}")
        if self.acceptance == "confadapt" and self.drafter in MASK_FREE_DRAFTERS:
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
    def from_kwargs(cls, base: "ProbeConfig | None" = None, **kwargs) -> "ProbeConfig":
        """``base`` (default settings if None) with the given fields replaced."""
        unknown = set(kwargs) - set(cls.field_names())
        if unknown:
            raise TypeError(f"unknown probe-mtp option(s): {sorted(unknown)}; known: {list(cls.field_names())}")
        return replace(base or cls(), **kwargs)
