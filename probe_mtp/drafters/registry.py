"""The one registry of drafters: a name resolves to its class here and nowhere else.

The configuration (:class:`probe_mtp.config.ProbeConfig`) validates ``drafter`` and ``num_masks``
against it, and the CLI, the report and the bench list their methods from it.  A drafter's class
says how it uses masks (``mask_use``) and whether its trees depend on the budget
(``budget_free``); see :class:`probe_mtp.drafters.base.Drafter`.
"""

from __future__ import annotations

from types import MappingProxyType

from .ar import AutoregressiveDrafter
from .base import Drafter
from .esp import ESPDrafter
from .hybrid import HybridDrafter
from .lookahead import LookaheadDrafter
from .pld import PromptLookupDrafter
from .stand import StandDrafter

DRAFTERS = MappingProxyType(
    {
        cls.name: cls
        for cls in (HybridDrafter, ESPDrafter, PromptLookupDrafter, LookaheadDrafter, StandDrafter, AutoregressiveDrafter)
    }
)
"""Every drafter by name, the default (``hybrid``) first."""


def drafter_names() -> tuple[str, ...]:
    return tuple(DRAFTERS)


def drafter_class(name: str) -> type[Drafter]:
    """The class registered as ``name`` (a ``ValueError`` naming the choices otherwise)."""
    cls = DRAFTERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown drafter {name!r}; choose one of: {', '.join(DRAFTERS)}")
    return cls


def make_drafter(config) -> Drafter:
    """The drafter named by ``config.drafter``, sized by ``config.tree_budget``."""
    return drafter_class(config.drafter).from_config(config)
