"""Self-distillation of the mask vectors on a frozen model.

The model is frozen (``requires_grad_(False)``); only the mask parameters (one shared vector and,
optionally, one offset per mask slot) receive gradients.  Loss: cross-entropy of each mask's logits
against the teacher's token at that depth (the hard-teacher variant).  Each step trains every owner
position of one teacher sequence in one pass on top of the sequence's cached keys and values (see
:mod:`probe_mtp.distill.batch`).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..architectures import attention_format
from ..kv import AttentionFormat, new_cache
from ..tuned_masks import MODES, ModelIdentity, TunedMasks
from .batch import IGNORE, attention_mask, default_owners, ema_anchors, owner_batch
from .teacher import TeacherSequence

HIT_WIDTH = 14  # the tree width of k=1 at BC=30: how often the target is among the mask's top 14


@dataclass(frozen=True)
class TrainSettings:
    """Knobs of one tuning run.  ``lr`` is in units of the vocabulary embeddings' RMS (so one value
    suits models whose embeddings have different scales, such as Gemma's scaled ones); it decays
    along a cosine to ``final_lr_fraction * lr`` at the last step."""

    num_masks: int = 2
    steps: int = 400
    lr: float = 0.05
    mode: str = "relative"
    offsets: bool = True
    ema: float = 0.1
    seed: int = 0
    max_cached_tokens: int = 60_000
    final_lr_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.num_masks, int) or self.num_masks < 1:
            raise ValueError(f"num_masks must be an integer >= 1, got {self.num_masks!r}")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {self.steps!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not 0.0 <= float(self.ema) <= 1.0:
            raise ValueError(f"ema must lie in [0, 1], got {self.ema!r}")


class MaskParameters(torch.nn.Module):
    """``scale * (base + offsets[j])``: the trainable part of mask j's input vector."""

    def __init__(self, base: torch.Tensor, num_masks: int, scale: float, offsets: bool):
        super().__init__()
        self.scale = float(scale)
        self.base = torch.nn.Parameter(base.detach().float() / self.scale)
        zeros = torch.zeros((num_masks, base.shape[0]), dtype=torch.float32, device=base.device)
        if offsets:
            self.offsets = torch.nn.Parameter(zeros)
        else:
            self.register_buffer("offsets", zeros)

    def vectors(self) -> torch.Tensor:
        """``[k, H]`` float32."""
        return self.scale * (self.base[None, :] + self.offsets)


class PrefixCache:
    """The keys and values of a sequence's prefix, computed once; each training pass appends its
    mask inputs, :meth:`restore` puts the prefix back (the tensors are never modified in place)."""

    def __init__(self, model, ids: torch.Tensor, past_len: int):
        self.cache = new_cache(model)
        with torch.no_grad():
            model(input_ids=ids[None, :past_len].to(model.device), cache=self.cache, use_cache=True, logits_to_keep=1)
        self.past_len = past_len
        self._saved = [(layer.keys, layer.values, getattr(layer, "cumulative_length", None)) for layer in self.cache.layers]
        self.sliding = any(getattr(layer, "is_sliding", False) for layer in self.cache.layers)

    def restore(self) -> None:
        for layer, (keys, values, cumulative) in zip(self.cache.layers, self._saved):
            layer.keys, layer.values = keys, values
            if cumulative is not None:
                layer.cumulative_length = cumulative


def prompt_mean_init(embed: torch.nn.Module, sequences: list[TeacherSequence]) -> torch.Tensor:
    """The mean over training prompts of each prompt's mean input embedding (float64 ``[H]``)."""
    device = embed.weight.device
    with torch.no_grad():
        means = [embed(s.ids[: s.prompt_len].to(device)).double().mean(0) for s in sequences]
    return torch.stack(means).mean(0)


def embedding_rms(embed: torch.nn.Module, sample: int = 4096) -> float:
    """Root mean square of (scaled) input embeddings over evenly spaced vocabulary rows."""
    vocab = embed.weight.shape[0]
    ids = torch.arange(0, vocab, max(1, vocab // sample), device=embed.weight.device)
    with torch.no_grad():
        return float(embed(ids).double().pow(2).mean().sqrt())


class _Sequences:
    """Teacher sequences with their cached prefixes (kept up to ``max_cached_tokens``) and anchors."""

    def __init__(self, model, sequences: list[TeacherSequence], settings: TrainSettings):
        self.model = model
        self.items = sequences
        self.settings = settings
        self.relative = settings.mode == "relative"
        self.ema = settings.ema
        self.embed = model.get_input_embeddings()
        self._caches: dict[int, PrefixCache] = {}
        self._cached_tokens = 0

    def prefix(self, i: int) -> PrefixCache:
        found = self._caches.get(i)
        if found is not None:
            return found
        seq = self.items[i]
        past_len = int(seq.ids.shape[0]) - 2
        built = PrefixCache(self.model, seq.ids, past_len)
        if self._cached_tokens + past_len <= self.settings.max_cached_tokens:
            self._caches[i] = built
            self._cached_tokens += past_len
        return built

    def anchors(self, i: int) -> torch.Tensor | None:
        if not self.relative:
            return None
        seq = self.items[i]
        with torch.no_grad():
            e = self.embed(seq.ids.to(self.embed.weight.device))
        return ema_anchors(e, seq.prompt_len, self.ema).float()


def masked_logits(model, vectors: torch.Tensor, seq: TeacherSequence, prefix: PrefixCache, anchors, fmt: AttentionFormat):
    """One pass: logits ``[N, V]`` of every owner's masks (``vectors``: ``[k, H]``, the tuned part
    of mask j's input; ``anchors``: ``[L, H]`` per-owner untuned vectors or None), and the batch."""
    k = int(vectors.shape[0])
    batch = owner_batch(seq.ids.numpy(), default_owners(int(seq.ids.shape[0]), seq.prompt_len), k, prefix.past_len)
    device = model.device
    slot = torch.from_numpy(batch.slot).to(device)
    embeds = vectors.index_select(0, slot)
    if anchors is not None:
        embeds = embeds + anchors.to(device).index_select(0, torch.from_numpy(batch.owner).to(device))
    mask = attention_mask(batch, fmt, prefix.sliding)
    positions = torch.from_numpy(batch.positions).to(device)[None]
    try:
        out = model(
            inputs_embeds=embeds.to(model.dtype)[None],
            attention_mask=mask,
            position_ids=positions,
            cache=prefix.cache,
            use_cache=True,
            logits_to_keep=0,
        )
    finally:
        prefix.restore()
    return out.logits[0].float(), batch


def batch_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """Loss (mean cross-entropy over valid targets), top-1 accuracy and top-14 hit rate."""
    valid = targets != IGNORE
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE)
    with torch.no_grad():
        lv, tv = logits[valid], targets[valid]
        top = lv.topk(HIT_WIDTH, dim=-1).indices
        acc = float((top[:, 0] == tv).float().mean()) if tv.numel() else float("nan")
        hit = float((top == tv[:, None]).any(-1).float().mean()) if tv.numel() else float("nan")
    return {"loss_tensor": loss, "loss": float(loss.detach()), "top1": acc, f"top{HIT_WIDTH}": hit, "targets": int(valid.sum())}


def train_masks(
    model,
    sequences: list[TeacherSequence],
    settings: TrainSettings,
    on_step: Callable[[dict], None] | None = None,
    extra_settings: dict | None = None,
) -> tuple[TunedMasks, list[dict]]:
    """Learn the mask parameters; returns the tuned masks and one record per step
    (``step, loss, top1, top14, targets, seconds``)."""
    if not sequences:
        raise ValueError("no teacher sequences to train on")
    from ..optimize import is_optimized

    if is_optimized(model):
        raise ValueError("a model prepared by probe_mtp.optimize cannot back-propagate (its weights are packed for "
                         "inference); tune the masks on the float32 model: the vectors serve the prepared one too")
    model.requires_grad_(False)
    embed = model.get_input_embeddings()
    k = settings.num_masks
    scale = embedding_rms(embed)
    if settings.mode == "absolute":
        base = prompt_mean_init(embed, sequences).float()
    else:
        base = torch.zeros(embed.weight.shape[1], device=embed.weight.device)
    params = MaskParameters(base, k, scale, settings.offsets)
    optimizer = torch.optim.Adam([p for p in params.parameters() if p.requires_grad], lr=settings.lr)
    floor = settings.final_lr_fraction
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(i, settings.steps - 1) / max(1, settings.steps - 1)))
    )
    fmt = attention_format(model)
    data = _Sequences(model, sequences, settings)
    rng = np.random.default_rng(settings.seed)
    order: list[int] = []
    history: list[dict] = []
    t0 = time.perf_counter()
    for step in range(1, settings.steps + 1):
        if not order:
            order = list(rng.permutation(len(sequences)))
        i = int(order.pop())
        seq = sequences[i]
        logits, batch = masked_logits(model, params.vectors(), seq, data.prefix(i), data.anchors(i), fmt)
        metrics = batch_metrics(logits, torch.from_numpy(batch.targets).to(logits.device))
        optimizer.zero_grad(set_to_none=True)
        metrics.pop("loss_tensor").backward()
        optimizer.step()
        schedule.step()
        record = {"step": step, "lr": optimizer.param_groups[0]["lr"], "sequence": i, "task": seq.task, **metrics, "seconds": time.perf_counter() - t0}
        history.append(record)
        if on_step is not None:
            on_step(record)
    vectors = params.vectors().detach().cpu()
    base_out = (params.scale * params.base).detach().cpu().float()
    offsets_out = vectors - base_out[None, :]
    meta = {**asdict(settings), "sequences": len(sequences), "seconds": round(time.perf_counter() - t0, 1),
            "loss_first": history[0]["loss"], "loss_last_mean10": float(np.mean([h["loss"] for h in history[-10:]])),
            "embedding_rms": scale, **(extra_settings or {})}
    tuned = TunedMasks(base_out, offsets_out, settings.mode, ModelIdentity.of(model, meta.get("model")), meta)
    return tuned, history


@torch.no_grad()
def evaluate(model, tuned: TunedMasks, sequences: list[TeacherSequence], ema: float | None = None) -> dict:
    """Loss, top-1 accuracy and top-14 hit rate of ``tuned`` over ``sequences`` (pooled over their
    targets), with the anchors of ``ema`` (default: the rate the vectors were trained with)."""
    ema = float(tuned.settings.get("ema", 0.1) if ema is None else ema)
    settings = TrainSettings(num_masks=tuned.num_masks, mode=tuned.mode, ema=ema, max_cached_tokens=0)
    data = _Sequences(model, sequences, settings)
    fmt = attention_format(model)
    vectors = tuned.slot_vectors(tuned.num_masks).to(model.device)
    keys = ("loss", "top1", f"top{HIT_WIDTH}")
    groups = {"": None, **{f"_mask{j + 1}": j for j in range(tuned.num_masks)}} if tuned.num_masks > 1 else {"": None}
    total = {g: dict.fromkeys((*keys, "targets"), 0.0) for g in groups}
    for i, seq in enumerate(sequences):
        logits, batch = masked_logits(model, vectors, seq, data.prefix(i), data.anchors(i), fmt)
        targets = torch.from_numpy(batch.targets).to(logits.device)
        for g, slot in groups.items():
            rows = slice(None) if slot is None else torch.from_numpy(batch.slot == slot).to(logits.device)
            m = batch_metrics(logits[rows], targets[rows])
            for key in keys:
                total[g][key] += m[key] * m["targets"]
            total[g]["targets"] += m["targets"]
    out = {}
    for g, t in total.items():
        n = max(1.0, t["targets"])
        out.update({f"{key}{g}": t[key] / n for key in keys})
        out[f"targets{g}"] = int(t["targets"])
    return out
