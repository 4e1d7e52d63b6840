"""Mask vectors: the synthesized soft inputs whose logits propose future tokens.

All strategies work in the space the model's own embedding module produces (Gemma multiplies its
embeddings by sqrt(hidden); using the module handles that), in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EmbeddingStats:
    """Mean and scalar standard deviation of the vocabulary's (scaled) input embeddings."""

    mean: torch.Tensor  # [H]
    std: float


def embedding_stats(embed: torch.nn.Module, vocab_size: int, chunk: int = 8192) -> EmbeddingStats:
    """Streamed over the vocabulary in chunks (Gemma's 262k x 640 table is never materialised twice)."""
    total = None
    total_sq = 0.0
    device = next(embed.parameters()).device
    with torch.no_grad():
        for start in range(0, vocab_size, chunk):
            ids = torch.arange(start, min(start + chunk, vocab_size), device=device)
            e = embed(ids).double()
            total = e.sum(0) if total is None else total + e.sum(0)
            total_sq += float((e * e).sum())
    mean = total / vocab_size
    hidden = mean.numel()
    var = total_sq / (vocab_size * hidden) - float((mean * mean).mean())
    return EmbeddingStats(mean=mean, std=max(var, 0.0) ** 0.5)


class MaskVectors:
    """The k mask vectors of one generation, ``[k, H]`` in the model's dtype, with the EMA update.

    ``offsets`` (``[k, H]``, optional): fixed vectors added to the running average, which the EMA
    update leaves alone (tuned masks in relative mode, see :mod:`probe_mtp.tuned_masks`)."""

    def __init__(self, vectors: torch.Tensor, ema: float, offsets: torch.Tensor | None = None):
        self.ema = float(ema)
        self._acc = vectors.double()  # the running average, kept in float64 so that updates don't drift
        self._offsets = None if offsets is None else offsets.double()
        self._dtype = vectors.dtype
        self.vectors = self._compose() if offsets is not None else vectors

    def _compose(self) -> torch.Tensor:
        total = self._acc if self._offsets is None else self._acc + self._offsets
        return total.to(self._dtype)

    @property
    def num_masks(self) -> int:
        return int(self.vectors.shape[0])

    def update(self, token_embeds: torch.Tensor) -> None:
        """Apply ``m <- m + lambda (E[e_t] - m)`` once per generated token, in order."""
        if self.ema == 0.0 or token_embeds.shape[0] == 0:
            return
        lam = self.ema
        t = token_embeds.shape[0]
        # closed form of t sequential updates: m_t = (1-l)^t m + sum_i l (1-l)^(t-1-i) e_i
        weights = lam * (1.0 - lam) ** torch.arange(t - 1, -1, -1, dtype=torch.float64, device=token_embeds.device)
        self._acc = (1.0 - lam) ** t * self._acc + (weights[:, None] * token_embeds.double()).sum(0)[None, :]
        self.vectors = self._compose()


def initial_mask_vectors(
    strategy: str,
    embed: torch.nn.Module,
    prompt_ids: torch.Tensor,
    num_masks: int,
    ema: float,
    *,
    stats: EmbeddingStats | None = None,
    token: int | None = None,
    seed: int = 0,
) -> MaskVectors:
    """Build the mask vectors for one generation.

    ``prompt_ids``: 1D tensor of the prompt's (unpadded) token ids.
    """
    with torch.no_grad():
        dtype = embed.weight.dtype if hasattr(embed, "weight") else torch.float32
        if strategy == "prompt_mean":
            m = embed(prompt_ids).double().mean(0, keepdim=True).expand(num_masks, -1)
        elif strategy == "last_k":
            last = prompt_ids[-num_masks:]
            e = embed(last).double()
            if e.shape[0] < num_masks:  # a prompt shorter than k: repeat its first token's embedding
                e = torch.cat([e[:1].expand(num_masks - e.shape[0], -1), e])
            m = e
        elif strategy == "sample":
            if stats is None:
                raise ValueError("mask_init='sample' needs the vocabulary embedding statistics")
            gen = torch.Generator(device="cpu").manual_seed(int(seed))
            noise = torch.randn(stats.mean.shape, generator=gen, dtype=torch.float64, device="cpu")
            m = (stats.mean.cpu() + stats.std * noise).to(prompt_ids.device)[None, :].expand(num_masks, -1)
        elif strategy == "token":
            ids = torch.tensor([int(token)], device=prompt_ids.device)
            m = embed(ids).double().expand(num_masks, -1)
        else:
            raise ValueError(f"unknown mask_init {strategy!r}")
    return MaskVectors(m.to(dtype).contiguous(), ema)


def config_mask_vectors(
    config, embed: torch.nn.Module, prompt_ids: torch.Tensor, num_masks: int, stats: EmbeddingStats | None = None
) -> MaskVectors:
    """:func:`initial_mask_vectors` with the settings of a :class:`~probe_mtp.config.ProbeConfig`
    (``mask_init``, ``mask_update``, ``mask_token``, ``mask_seed``)."""
    return initial_mask_vectors(
        config.mask_init,
        embed,
        prompt_ids,
        num_masks,
        config.mask_update,
        stats=stats,
        token=config.mask_token,
        seed=config.mask_seed,
    )
