"""Drafters: each proposes a token tree for the next verification pass and learns from the result.

Every drafter is verified by the same lossless verifier and counted with the same block-complexity
budget, so they can be compared at equal BC.
"""

from .ar import AutoregressiveDrafter
from .base import Drafter, StepFeedback
from .esp import ESPDrafter
from .hybrid import HybridDrafter
from .lookahead import LookaheadDrafter, lookahead_shape
from .pld import PromptLookupDrafter
from .stand import StandDrafter

__all__ = [
    "Drafter",
    "StepFeedback",
    "ESPDrafter",
    "HybridDrafter",
    "PromptLookupDrafter",
    "LookaheadDrafter",
    "StandDrafter",
    "AutoregressiveDrafter",
    "lookahead_shape",
    "make_drafter",
]


def make_drafter(config) -> Drafter:
    """The drafter named by ``config.drafter``, sized by ``config.tree_budget`` (``budget``, or ``max_budget`` when adaptive)."""
    if config.drafter == "esp":
        return ESPDrafter(config.num_masks, config.tree_budget, prune_repeats=config.prune_repeats)
    if config.drafter == "hybrid":
        return HybridDrafter(config.tree_budget, config.num_masks, prune_repeats=config.prune_repeats)
    # baselines without mask inputs: config.num_masks does not apply to them
    if config.drafter == "pld":
        return PromptLookupDrafter(config.tree_budget)
    if config.drafter == "lookahead":
        return LookaheadDrafter(config.tree_budget)
    if config.drafter == "stand":
        return StandDrafter(config.tree_budget)
    if config.drafter == "ar":
        return AutoregressiveDrafter(config.tree_budget)
    raise ValueError(f"unknown drafter {config.drafter!r}")
