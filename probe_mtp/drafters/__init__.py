"""Drafters: each proposes a token tree for the next verification pass and learns from the result.

Every drafter is verified by the same lossless verifier and counted with the same block-complexity
budget, so they can be compared at equal BC.
"""

from .base import Drafter, StepFeedback
from .esp import ESPDrafter

__all__ = ["Drafter", "StepFeedback", "ESPDrafter", "make_drafter"]


def make_drafter(config) -> Drafter:
    """The drafter named by ``config.drafter``, sized by ``config.budget``."""
    if config.drafter == "esp":
        return ESPDrafter(config.num_masks, config.budget, prune_repeats=config.prune_repeats)
    raise ValueError(f"unknown drafter {config.drafter!r}")
