"""The tidy alignment table: one row per (setting, prompt, owner, mask, layer), as a numpy structured
array that users can slice, or hand to pandas (``table.to_pandas()``, pandas not required otherwise)."""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from .alignment import PromptAlignment

TABLE_DTYPE = np.dtype(
    [
        ("init", "U40"),  # the mask setting's label
        ("task", "U24"),  # Spec-Bench task (or any label the caller gives)
        ("prompt", np.int32),  # prompt id
        ("step", np.int32),  # greedy step of the owner: 0 = the prefill's owner (last prompt token)
        ("position", np.int32),  # absolute position of the mask, owner + mask
        ("mask", np.int8),  # mask index j (1..k)
        ("layer", np.int16),  # 0 = input embeddings, l = after decoder block l (last: after the final norm)
        ("cosine", np.float32),  # cos(mask's hidden state, true token's hidden state) at that layer
        ("control", np.float32),  # mean cosine of the mask's hidden state with the other positions' true ones
        ("rank", np.int32),  # rank of the target in the mask's logits (0 = top-1)
        ("top1", np.bool_),  # rank == 0
        ("accepted", np.bool_),  # greedy verification of the owner's top-1 chain accepts this mask's proposal
        ("target", np.int32),  # the token the mask should propose, x_{q+j+1}
        ("proposal", np.int32),  # the mask's top-1 token
    ]
)


class AlignmentTable:
    """Rows of :data:`TABLE_DTYPE`.  ``table["cosine"]`` is a column; ``table.select(...)`` filters."""

    def __init__(self, records: np.ndarray):
        if not isinstance(records, np.ndarray) or records.dtype != TABLE_DTYPE:
            raise TypeError("AlignmentTable needs a numpy structured array of TABLE_DTYPE")
        self.records = records

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_alignment(cls, alignment: PromptAlignment, *, init: str, task: str, prompt: int) -> "AlignmentTable":
        """Flatten one prompt's :class:`PromptAlignment` (valid masks only) into rows."""
        owner, mask = np.nonzero(alignment.valid)
        num_hidden = alignment.num_layers
        rows = np.zeros(owner.size * num_hidden, dtype=TABLE_DTYPE)
        rep = lambda a: np.repeat(a, num_hidden)  # noqa: E731 - one value per mask, repeated per layer
        rows["init"] = init
        rows["task"] = task
        rows["prompt"] = prompt
        rows["step"] = rep(owner)
        rows["position"] = rep(alignment.owner_positions[owner] + mask + 1)
        rows["mask"] = rep(mask + 1)
        rows["layer"] = np.tile(np.arange(num_hidden), owner.size)
        rows["cosine"] = alignment.cosine[owner, mask].reshape(-1)
        rows["control"] = alignment.control[owner, mask].reshape(-1)
        rows["rank"] = rep(alignment.rank[owner, mask])
        rows["top1"] = rep(alignment.top1[owner, mask])
        rows["accepted"] = rep(alignment.accepted[owner, mask])
        rows["target"] = rep(alignment.target[owner, mask])
        rows["proposal"] = rep(alignment.proposal[owner, mask])
        return cls(rows)

    @classmethod
    def concat(cls, tables: Iterable["AlignmentTable"]) -> "AlignmentTable":
        parts = [t.records for t in tables]
        return cls(np.concatenate(parts) if parts else np.zeros(0, dtype=TABLE_DTYPE))

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return int(self.records.shape[0])

    def __getitem__(self, column: str) -> np.ndarray:
        return self.records[column]

    @property
    def columns(self) -> tuple[str, ...]:
        return TABLE_DTYPE.names

    @property
    def last_layer(self) -> int:
        """Index of the last hidden state (after the final norm)."""
        if not len(self):
            raise ValueError("the table is empty")
        return int(self.records["layer"].max())

    def unique(self, column: str) -> list:
        return [v.item() if hasattr(v, "item") else v for v in np.unique(self.records[column])]

    def select(self, **conditions) -> "AlignmentTable":
        """Rows where every condition holds: ``column=value`` (equality), ``column=[v1, v2]`` (any
        of), or ``column=callable`` (a predicate on the column array, e.g. ``rank=lambda r: r < 10``)."""
        keep = np.ones(len(self), dtype=bool)
        for column, cond in conditions.items():
            if column not in TABLE_DTYPE.names:
                raise KeyError(f"unknown column {column!r}; columns: {list(TABLE_DTYPE.names)}")
            values = self.records[column]
            if callable(cond):
                keep &= np.asarray(cond(values), dtype=bool)
            elif isinstance(cond, (list, tuple, set, frozenset, np.ndarray)):
                keep &= np.isin(values, list(cond))
            else:
                keep &= values == cond
        return AlignmentTable(self.records[keep])

    def where(self, predicate: Callable[[np.ndarray], np.ndarray]) -> "AlignmentTable":
        """Rows where ``predicate(records)`` is True (for conditions across columns)."""
        return AlignmentTable(self.records[np.asarray(predicate(self.records), dtype=bool)])

    def to_pandas(self):
        """The table as a pandas DataFrame (needs pandas, which probe-mtp does not install)."""
        try:
            import pandas as pd
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("to_pandas() needs pandas: pip install pandas") from exc
        return pd.DataFrame.from_records(self.records)

    def __repr__(self) -> str:
        inits = self.unique("init") if len(self) else []
        return f"AlignmentTable({len(self)} rows, inits={inits})"
