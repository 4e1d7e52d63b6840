"""The decoder's drafting memory: what drafting learns from one request and uses in the next.

A :class:`~probe_mtp.decoder.ProbeDecoder` keeps one :class:`DraftingMemory` for its model and
shares it with every request it decodes:

- **successor tables**: the model's own verified top-k after every token tail (Token Recycling's
  table), written by every verified node;
- **corpus**: earlier prompts with their outputs, with longest-match lookup of any length
  (:mod:`probe_mtp.corpus`), so text that repeats or continues what was seen before (the same
  document asked about again, code edits, agent loops, multi-turn chat) drafts long chains;
- **calibration**: per drafter and source cell, how often proposals were accepted;
- **budget states**: what the adaptive budget learnt (acceptance per depth, how real passes compare
  with the cost curve, the step overhead).

Tables, corpus and the machine's timings carry over whole.  Acceptance counts (the calibration, the
budget's per-depth and per-size-class sums) enter each new request at a quarter of their weight
(``ACCEPTANCE_CARRY``): a prior the request's own passes outvote within a few steps.  Carried whole,
one task's rates priced the next task's trees (a chat moving from questions to translation drafted
deep trees the translation did not accept: 0.78-0.85x against 1.07-1.14x cold on that task).

The memory only changes what is drafted, never what verification accepts, so the output is the
same with or without it.  It is bounded by ``max_bytes`` (the corpus gives way, oldest documents
first), tied to one model (a file records the model's identity and is refused for another), and
saved as safetensors with JSON metadata: a format that cannot run code when read.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np

from .adaptive import BudgetState
from .corpus import Corpus
from .drafters.calibration import AcceptanceCalibrator
from .drafters.successors import SuccessorTable
from .tuned_masks import ModelIdentity
from .version import __version__

FORMAT = "probe-mtp-memory/1"
DEFAULT_MEMORY_MB = 64
# a calibration cell remembers at most this many trials (older ones scaled down, the rate kept)
MAX_EVIDENCE = 256.0
# the weight a new request gives the acceptance counts of the requests before it
ACCEPTANCE_CARRY = 0.25


class MemoryFileError(ValueError):
    """A memory file that cannot be used: not one, damaged, of another format or another model."""


def tokenizer_identity(tokenizer) -> str:
    """A short fingerprint of a tokenizer's vocabulary ("" without one)."""
    if tokenizer is None:
        return ""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: no fingerprint
        return type(tokenizer).__name__
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
    return f"{type(tokenizer).__name__}:{len(vocab)}:{digest}"


class DraftingMemory:
    """Shared drafting state of one model (see the module docstring)."""

    def __init__(self, max_bytes: int = DEFAULT_MEMORY_MB << 20, identity: ModelIdentity | None = None,
                 tokenizer: str = ""):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"the memory's size must be a number of bytes >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.identity = identity
        self.tokenizer = tokenizer
        self.corpus = Corpus(max_bytes)
        self.successors: dict[tuple[int, int], SuccessorTable] = {}
        self.calibrators: dict[str, AcceptanceCalibrator] = {}
        self.budgets: dict[str, BudgetState] = {}
        self.requests = 0
        self.acceptance_carry = ACCEPTANCE_CARRY

    @classmethod
    def for_model(cls, model, tokenizer=None, max_mb: float = DEFAULT_MEMORY_MB) -> "DraftingMemory":
        if isinstance(max_mb, bool) or not isinstance(max_mb, (int, float)) or not max_mb >= 0:
            raise ValueError(f"memory_mb must be a number of megabytes >= 0, got {max_mb!r}")
        return cls(int(max_mb * (1 << 20)), ModelIdentity.of(model), tokenizer_identity(tokenizer))

    # ---------------------------------------------------------------- what drafters share
    def successor_table(self, top_k: int, order: int) -> SuccessorTable:
        key = (int(top_k), int(order))
        if key not in self.successors:
            self.successors[key] = SuccessorTable(top_k, order)
        return self.successors[key]

    def calibrator(self, key: str, priors: dict[str, np.ndarray], strength: float) -> AcceptanceCalibrator:
        """The calibration of the drafter configuration ``key`` (made from ``priors`` the first time;
        made anew if the priors' shapes changed)."""
        found = self.calibrators.get(key)
        shapes = {s: np.asarray(p).shape for s, p in priors.items()}
        if found is None or {s: p.shape for s, p in found.priors.items()} != shapes:
            found = self.calibrators[key] = AcceptanceCalibrator(priors, strength, max_evidence=MAX_EVIDENCE)
        return found

    def budget_state(self, key: str) -> BudgetState:
        if key not in self.budgets:
            self.budgets[key] = BudgetState()
        return self.budgets[key]

    def begin_request(self) -> None:
        """A request starts: acceptance counts (per drafter source, per budget depth and size class)
        keep ``acceptance_carry`` of their weight; tables, corpus and the machine's timings stay whole."""
        for calibrator in self.calibrators.values():
            calibrator.discount(self.acceptance_carry)
        for state in self.budgets.values():
            state.begin_request(self.acceptance_carry)

    def remember(self, tokens) -> None:
        """A finished request's prompt and output, for the corpus (within the size cap)."""
        self.requests += 1
        self.corpus.max_bytes = max(0, self.max_bytes - self._fixed_bytes())
        self.corpus.add(tokens)

    # ---------------------------------------------------------------- size and reset
    def _fixed_bytes(self) -> int:
        tables = sum(t.nbytes() for t in self.successors.values())
        calibration = sum(sum(a.nbytes for a in c.as_arrays().values()) for c in self.calibrators.values())
        budgets = sum(sum(a.nbytes for a in b.as_arrays().values()) for b in self.budgets.values())
        return tables + calibration + budgets

    def nbytes(self) -> int:
        """Estimated bytes held: the tables, counts and the corpus with its automaton."""
        return self._fixed_bytes() + self.corpus.nbytes()

    def summary(self) -> dict:
        return {"requests": self.requests, "corpus_tokens": len(self.corpus), "corpus_documents": len(self.corpus.documents),
                "bytes": self.nbytes(), "max_bytes": self.max_bytes}

    def reset(self) -> None:
        """Forget everything learnt (the decoder is cold again)."""
        self.corpus.clear()
        self.successors.clear()
        self.calibrators.clear()
        self.budgets.clear()
        self.requests = 0

    # ---------------------------------------------------------------- file
    def save(self, path: str | Path) -> Path:
        """Write the memory to ``path`` (safetensors: arrays, and JSON metadata)."""
        from safetensors.numpy import save_file

        # entries are named "group|key|name" (keys and names may hold "/", never "|")
        tensors: dict[str, np.ndarray] = {}
        for name, value in self.corpus.to_arrays().items():
            tensors[f"corpus||{name}"] = value
        for (top_k, order), table in self.successors.items():
            for name, value in table.as_arrays().items():
                tensors[f"successors|{top_k},{order}|{name}"] = np.ascontiguousarray(value)
        calibration_meta = {}
        for key, calibrator in self.calibrators.items():
            calibration_meta[key] = {"priors": {s: p.tolist() for s, p in calibrator.priors.items()},
                                     "strength": calibrator.strength}
            for name, value in calibrator.as_arrays().items():
                tensors[f"calibration|{key}|{name}"] = value
        for key, state in self.budgets.items():
            for name, value in state.as_arrays().items():
                tensors[f"budget|{key}|{name}"] = value
        metadata = {
            "format": FORMAT,
            "probe_mtp_version": __version__,
            "identity": json.dumps(None if self.identity is None else vars(self.identity)),
            "tokenizer": self.tokenizer,
            "max_bytes": str(self.max_bytes),
            "requests": str(self.requests),
            "calibration": json.dumps(calibration_meta),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=metadata)
        return path

    @classmethod
    def load(cls, path: str | Path, identity: ModelIdentity | None, tokenizer: str = "",
             max_bytes: int | None = None) -> "DraftingMemory":
        """Read a memory written by :meth:`save` for the model of ``identity`` (and ``tokenizer``);
        :class:`MemoryFileError` (a ``ValueError``) when the file is not a usable memory of it."""
        from safetensors import SafetensorError
        from safetensors.numpy import load_file, safe_open

        path = Path(path)
        if not path.is_file():
            raise MemoryFileError(f"memory file not found: {path}")
        try:
            with safe_open(str(path), framework="numpy") as fh:
                meta = fh.metadata() or {}
            arrays = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise MemoryFileError(f"{path} is not a readable probe-mtp memory file ({exc})") from None
        if meta.get("format") != FORMAT:
            raise MemoryFileError(f"{path} is not a probe-mtp memory file of format {FORMAT} (format: {meta.get('format')!r})")
        try:
            saved = json.loads(meta["identity"])
            saved_identity = None if saved is None else ModelIdentity(**saved)
            calibration_meta = json.loads(meta["calibration"])
            saved_max = int(meta["max_bytes"])
            requests = int(meta["requests"])
        except (KeyError, TypeError, ValueError) as exc:
            raise MemoryFileError(f"{path}: damaged metadata ({exc})") from None
        if identity is not None:
            why = None if saved_identity is None else saved_identity.mismatch(identity)
            if saved_identity is None or why:
                raise MemoryFileError(f"{path} was saved for another model ({why or 'no model recorded'}); "
                                      "a memory is only valid for the model it was learnt on")
        if tokenizer and meta.get("tokenizer") and meta["tokenizer"] != tokenizer:
            raise MemoryFileError(f"{path} was saved with another tokenizer ({meta['tokenizer']} vs {tokenizer})")
        memory = cls(saved_max if max_bytes is None else max_bytes, identity or saved_identity, tokenizer or meta.get("tokenizer", ""))
        try:
            memory._load_arrays(arrays, calibration_meta)
        except (KeyError, ValueError, TypeError) as exc:
            raise MemoryFileError(f"{path}: damaged contents ({exc})") from None
        memory.requests = requests
        return memory

    def _load_arrays(self, arrays: dict[str, np.ndarray], calibration_meta: dict) -> None:
        groups: dict[tuple[str, str], dict[str, np.ndarray]] = {}
        for entry, value in arrays.items():
            group, key, name = entry.split("|")
            if group not in ("corpus", "successors", "calibration", "budget"):
                raise ValueError(f"unknown entry {entry!r}")
            groups.setdefault((group, key), {})[name] = value
        for (group, key), values in groups.items():
            if group == "successors":
                top_k, order = (int(x) for x in key.split(","))
                self.successor_table(top_k, order).load_arrays(values)
            elif group == "calibration":
                saved = calibration_meta[key]
                priors = {s: np.asarray(p, dtype=np.float64) for s, p in saved["priors"].items()}
                self.calibrator(key, priors, float(saved["strength"])).load_arrays(values)
            elif group == "budget":
                self.budgets[key] = BudgetState.from_arrays(values)
        corpus = groups.get(("corpus", ""), {})
        self.corpus.max_bytes = max(0, self.max_bytes - self._fixed_bytes())
        self.corpus.load_arrays(corpus["tokens"], corpus["lengths"])
