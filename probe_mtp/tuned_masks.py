"""Tuned mask vectors: the parameters ``probe-mtp tune-masks`` learns, their file, and the vectors
the decoder builds from them.

Parameters (all in the space the model's own embedding module produces, so Gemma's scaled
embeddings are handled): one shared vector ``base`` ``[H]`` and per-slot ``offsets`` ``[k, H]``
(zeros when trained without them).  Mask j's input vector is

- ``mode="absolute"``: ``base + offsets[j]`` (the EMA update, if ``mask_update > 0``, then moves it
  toward the generated tokens as for untuned masks);
- ``mode="relative"``: ``anchor + base + offsets[j]``, where ``anchor`` is the untuned prompt-mean
  vector with its EMA update (``mask_update``): the tuned part is a fixed offset on top of it.

The file is safetensors (tensors ``base``, ``offsets``) with string metadata: the model's identity
(name, hidden size, vocabulary size and a fingerprint of its embedding matrix), the settings of the
training run and the probe-mtp version.  Loading it for another model is a ``ValueError``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .masks import MaskVectors, initial_mask_vectors

FORMAT = "probe-mtp-masks/1"
BUNDLED = "bundled"
"""``masks="bundled"``: the tuned vectors shipped in ``probe_mtp/data/masks`` for the loaded model."""
AUTO_MASKS = "auto"
"""``masks="auto"`` (the default): the shipped vectors when some fit the loaded model, else untuned."""
MODES = ("absolute", "relative")
FINGERPRINT_ROWS = 512  # embedding rows hashed (evenly spaced over the vocabulary)


@dataclass(frozen=True)
class ModelIdentity:
    """What tuned vectors are tied to.  ``fingerprint`` hashes evenly spaced rows of the input
    embedding matrix rounded to bfloat16, so the same weights loaded in fp32 or bf16 match."""

    name: str
    hidden_size: int
    vocab_size: int
    fingerprint: str

    @classmethod
    def of(cls, model, name: str | None = None) -> "ModelIdentity":
        """``name`` (informational, not compared): default the config's ``name_or_path``."""
        weight = model.get_input_embeddings().weight.detach()
        vocab, hidden = weight.shape
        stride = max(1, vocab // FINGERPRINT_ROWS)
        rows = weight[::stride].to(device="cpu", dtype=torch.bfloat16).contiguous()
        digest = hashlib.sha256(rows.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
        name = name or str(getattr(model.config, "name_or_path", "") or type(model).__name__)
        return cls(name=name, hidden_size=int(hidden), vocab_size=int(vocab), fingerprint=digest)

    def mismatch(self, other: "ModelIdentity") -> str | None:
        """A sentence saying how ``other`` differs, or None when both are the same model."""
        if self.hidden_size != other.hidden_size:
            return f"hidden size {self.hidden_size} vs the model's {other.hidden_size}"
        if self.vocab_size != other.vocab_size:
            return f"vocabulary size {self.vocab_size} vs the model's {other.vocab_size}"
        if self.fingerprint != other.fingerprint:
            return f"embedding fingerprint {self.fingerprint} vs the model's {other.fingerprint} (different weights)"
        return None


@dataclass
class TunedMasks:
    """Learned mask parameters with their provenance (``settings``: the training run's knobs and
    figures, written to and read from the file's metadata)."""

    base: torch.Tensor  # [H] float32
    offsets: torch.Tensor  # [k, H] float32
    mode: str
    identity: ModelIdentity
    settings: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.base.dim() != 1 or self.offsets.dim() != 2 or self.offsets.shape[1] != self.base.shape[0]:
            raise ValueError(
                f"tuned masks need base [H] and offsets [k, H]; got {tuple(self.base.shape)} and {tuple(self.offsets.shape)}"
            )
        if self.base.shape[0] != self.identity.hidden_size:
            raise ValueError(f"base has {self.base.shape[0]} entries but the model's hidden size is {self.identity.hidden_size}")

    @property
    def num_masks(self) -> int:
        return int(self.offsets.shape[0])

    def check_model(self, model, source: str = "the tuned mask vectors") -> None:
        """Raise ``ValueError`` unless these vectors were made for ``model``."""
        problem = self.identity.mismatch(ModelIdentity.of(model))
        if problem:
            raise ValueError(
                f"{source} were made for another model ({self.identity.name!r}: {problem}); "
                "tune masks for this model with `probe-mtp tune-masks --model ...`"
            )

    def check_num_masks(self, num_masks: int, source: str = "the tuned mask vectors") -> None:
        if num_masks > self.num_masks:
            raise ValueError(
                f"num_masks={num_masks} but {source} hold {self.num_masks} mask slot(s); use num_masks <= "
                f"{self.num_masks} or tune with --num-masks {num_masks}"
            )

    def slot_vectors(self, num_masks: int) -> torch.Tensor:
        """``base + offsets[j]`` for slots ``j < num_masks``: ``[num_masks, H]`` float32.  Mask j
        sees only masks 1..j of its owner, so the first slots of a k-slot training are exactly the
        vectors a smaller k was trained with."""
        self.check_num_masks(num_masks)
        return self.base[None, :] + self.offsets[:num_masks]

    def mask_vectors(self, embed: torch.nn.Module, prompt_ids: torch.Tensor, num_masks: int, ema: float) -> MaskVectors:
        """The vectors of one generation (``prompt_ids``: 1D, unpadded)."""
        tuned = self.slot_vectors(num_masks)
        dtype = embed.weight.dtype
        device = prompt_ids.device
        if self.mode == "absolute":
            return MaskVectors(tuned.to(device=device, dtype=dtype), ema)
        anchor = initial_mask_vectors("prompt_mean", embed, prompt_ids, num_masks, ema)
        return MaskVectors(anchor.vectors, ema, offsets=tuned.to(device=device, dtype=torch.float64))

    # ------------------------------------------------------------------ file
    def metadata(self) -> dict[str, str]:
        meta = {
            "format": FORMAT,
            "mode": self.mode,
            "num_masks": str(self.num_masks),
            "model_name": self.identity.name,
            "hidden_size": str(self.identity.hidden_size),
            "vocab_size": str(self.identity.vocab_size),
            "embedding_fingerprint": self.identity.fingerprint,
            "settings": json.dumps(self.settings, sort_keys=True),
        }
        from .version import __version__

        meta["probe_mtp_version"] = __version__
        return meta

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"base": self.base.detach().float().cpu().contiguous(), "offsets": self.offsets.detach().float().cpu().contiguous()}
        save_file(tensors, str(path), metadata=self.metadata())
        return path

    @classmethod
    def load(cls, path: str | Path) -> "TunedMasks":
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tuned mask file not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                names = set(fh.keys())
                tensors = {name: fh.get_tensor(name) for name in names}
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{path} is not a safetensors file of tuned mask vectors ({exc})") from None
        if meta.get("format") != FORMAT or not {"base", "offsets"} <= names:
            raise ValueError(f"{path} is not a probe-mtp tuned mask file (format {meta.get('format')!r}, tensors {sorted(names)})")
        try:
            identity = ModelIdentity(meta["model_name"], int(meta["hidden_size"]), int(meta["vocab_size"]), meta["embedding_fingerprint"])
            settings = json.loads(meta.get("settings", "{}"))
            out = cls(tensors["base"].float(), tensors["offsets"].float(), meta["mode"], identity, settings)
        except (KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: incomplete tuned-mask metadata ({exc})") from None
        if out.num_masks != int(meta.get("num_masks", out.num_masks)):
            raise ValueError(f"{path}: metadata says {meta['num_masks']} masks but the file holds {out.num_masks}")
        out.settings.setdefault("probe_mtp_version", meta.get("probe_mtp_version"))
        return out


def bundled_files() -> list[Path]:
    from importlib import resources

    folder = Path(str(resources.files("probe_mtp") / "data" / "masks"))
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def bundled_for_model(model) -> Path:
    """The shipped tuned-mask file made for ``model``; ``ValueError`` when none is."""
    identity = ModelIdentity.of(model)
    for path in bundled_files():
        if TunedMasks.load(path).identity.mismatch(identity) is None:
            return path
    names = ", ".join(p.stem for p in bundled_files()) or "none"
    raise ValueError(
        f"no bundled tuned mask vectors for this model (bundled: {names}); make some with `probe-mtp tune-masks` "
        "and pass masks=PATH"
    )


def load_for_model(path: str | Path, model, num_masks: int) -> TunedMasks:
    """Load ``path`` and check that it fits ``model`` and ``num_masks`` (clear ``ValueError`` otherwise)."""
    tuned = TunedMasks.load(path)
    tuned.check_model(model, source=f"the tuned mask vectors in {path}")
    tuned.check_num_masks(num_masks, source=f"{path}")
    return tuned


class TunedMaskStore:
    """Tuned masks of one model, loaded and checked once per file (a decoder keeps one)."""

    def __init__(self, model):
        self.model = model
        self._loaded: dict[str, TunedMasks] = {}
        self._checked: set[int] = set()

    def get(self, source, num_masks: int) -> TunedMasks:
        """``source``: a path or a :class:`TunedMasks`; raises ``ValueError`` when it does not fit
        the model or ``num_masks``."""
        if isinstance(source, TunedMasks):
            if id(source) not in self._checked:
                source.check_model(self.model)
                self._checked.add(id(source))
            source.check_num_masks(num_masks)
            return source
        if str(source) == BUNDLED:
            source = bundled_for_model(self.model)
        key = str(Path(source).expanduser().resolve())
        tuned = self._loaded.get(key)
        if tuned is None:
            tuned = load_for_model(key, self.model, num_masks)
            self._loaded[key] = tuned
        tuned.check_num_masks(num_masks, source=key)
        return tuned

    def bundled_if_any(self, num_masks: int) -> TunedMasks | None:
        """The shipped vectors made for this model, when there are some with at least
        ``num_masks`` slots; None otherwise."""
        identity = ModelIdentity.of(self.model)
        for path in bundled_files():
            tuned = TunedMasks.load(path)
            if tuned.identity.mismatch(identity) is None and tuned.num_masks >= num_masks:
                return tuned
        return None


def masks_label(config, tuned: TunedMasks | None) -> str:
    """Which vectors a generation used, for its statistics and the report."""
    if tuned is None:
        return f"untuned:{config.mask_init}"
    choice = config.masks
    if isinstance(choice, str) and choice in (AUTO_MASKS, BUNDLED):
        return f"bundled:{tuned.identity.name}"
    if isinstance(choice, TunedMasks):
        return f"tuned:{tuned.identity.name}"
    return f"tuned:{Path(str(choice)).stem}"
