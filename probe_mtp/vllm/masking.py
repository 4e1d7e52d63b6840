"""The probe's mask vectors for requests served by vLLM: built from the served model's own embedding
(vLLM's module, through the model plugin) as :mod:`probe_mtp.masks` and :mod:`probe_mtp.tuned_masks`
build them for ``probe_mtp.generate``: the prompt-mean anchor with its EMA update, plus the tuned
offsets where probe-mtp ships some for the model (checked by the embedding's fingerprint)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ..masks import MaskVectors, initial_mask_vectors
from ..tuned_masks import TunedMasks, bundled_for_model


class Embedder(torch.nn.Module):
    """The served model's input embedding (Gemma's scale included) as probe_mtp.masks expects it: a
    callable on token ids with a ``weight`` (the vocabulary's rows)."""

    def __init__(self, embed, weight: torch.Tensor, name: str):
        super().__init__()
        self._embed = embed
        self.weight = weight
        self.name = name

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embed(ids)


def model_embedder(model) -> Embedder:
    """:class:`Embedder` of a vLLM causal LM (its ``embed_input_ids`` and its embedding rows)."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", config)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    table = model.model.embed_tokens.weight
    weight = table[:vocab] if vocab else table
    name = str(getattr(config, "name_or_path", "") or type(model).__name__)
    return Embedder(model.embed_input_ids, weight.detach(), name)


def tuned_masks_for(embed: Embedder, settings) -> TunedMasks | None:
    """The bundled tuned vectors made for this model (None where none fit, or too few slots)."""
    shim = SimpleNamespace(get_input_embeddings=lambda: embed, config=SimpleNamespace(name_or_path=embed.name))
    try:
        tuned = TunedMasks.load(bundled_for_model(shim))
    except ValueError:
        return None
    return tuned if tuned.num_masks >= settings.num_masks else None


def request_masks(embed: Embedder, tuned: TunedMasks | None, tokens: np.ndarray, settings) -> MaskVectors:
    """One request's mask vectors from its tokens so far."""
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=embed.weight.device)
    if tuned is not None:
        return tuned.mask_vectors(embed, ids, settings.num_masks, settings.mask_update)
    return initial_mask_vectors("prompt_mean", embed, ids, settings.num_masks, settings.mask_update)
