"""Drafters: each proposes a token tree for the next verification pass and learns from the result.

Every drafter is verified by the same lossless verifier and counted with the same block-complexity
budget, so they can be compared at equal BC.  :mod:`~probe_mtp.drafters.base` declares the
interface, :mod:`~probe_mtp.drafters.registry` names every drafter once.
"""

from .ar import AutoregressiveDrafter
from .base import Drafter, StepFeedback
from .esp import ESPDrafter
from .hybrid import HybridDrafter
from .lookahead import LookaheadDrafter, lookahead_shape
from .pld import PromptLookupDrafter
from .registry import DRAFTERS, drafter_class, drafter_names, make_drafter
from .stand import StandDrafter

__all__ = [
    "Drafter",
    "StepFeedback",
    "DRAFTERS",
    "drafter_class",
    "drafter_names",
    "make_drafter",
    "ESPDrafter",
    "HybridDrafter",
    "PromptLookupDrafter",
    "LookaheadDrafter",
    "StandDrafter",
    "AutoregressiveDrafter",
    "lookahead_shape",
]
