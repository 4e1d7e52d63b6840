"""A whole alignment study: prompts x mask settings, greedy continuations, tau, one table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..config import ProbeConfig
from ..decoder import ProbeDecoder
from ..prompts import Prompt, chat_input_ids
from .alignment import align_masks
from .table import AlignmentTable

TAU_DTYPE = np.dtype(
    [
        ("init", "U40"),
        ("task", "U24"),
        ("prompt", np.int32),
        ("tau", np.float64),  # this prompt's mean accepted length
        ("committed", np.int64),  # tokens committed by decoding steps (prefill excluded)
        ("steps", np.int64),  # decoding steps (passes after the prefill)
        ("new_tokens", np.int64),
    ]
)


def mask_init_settings(token_id: int, ema: float = 0.1, seed: int = 0, budget: int = 30) -> dict[str, ProbeConfig]:
    """The mask initialisations the paper ablates, as decoder settings (k=1, a fixed BC=30 as in
    the paper's comparisons, not the adaptive budget):
    the prompt mean frozen and with the EMA update, and frozen last-k, sample and fixed-token
    vectors (``token_id``: the fixed token)."""
    return {
        "prompt mean": ProbeConfig(drafter="esp", mask_init="prompt_mean", mask_update=0.0, budget=budget),
        "prompt mean + EMA": ProbeConfig(drafter="esp", mask_init="prompt_mean", mask_update=ema, budget=budget),
        "last-k": ProbeConfig(drafter="esp", mask_init="last_k", mask_update=0.0, budget=budget),
        "sample": ProbeConfig(drafter="esp", mask_init="sample", mask_update=0.0, mask_seed=seed, budget=budget),
        "token": ProbeConfig(drafter="esp", mask_init="token", mask_update=0.0, mask_token=int(token_id), budget=budget),
    }


@dataclass
class AlignmentStudy:
    """``table``: the tidy rows (:mod:`.table`); ``tau``: one row per (setting, prompt) of
    :data:`TAU_DTYPE`, measured by the decoder itself with each setting."""

    table: AlignmentTable
    tau: np.ndarray
    settings: dict[str, ProbeConfig]
    num_masks: int
    max_new_tokens: int

    def pooled_tau(self, init: str) -> float:
        """Tau over all prompts of one setting: committed tokens / decoding steps."""
        rows = self.tau[self.tau["init"] == init]
        if rows.size == 0:
            raise KeyError(f"no tau rows for setting {init!r}; settings: {list(self.settings)}")
        return float(rows["committed"].sum() / max(1, rows["steps"].sum()))


def _prompt_ids(tokenizer, prompt) -> tuple[torch.Tensor, str, int]:
    if isinstance(prompt, Prompt):
        return chat_input_ids(tokenizer, [{"role": "user", "content": prompt.turns[0]}]), prompt.task, prompt.question_id
    if isinstance(prompt, str):
        return chat_input_ids(tokenizer, [{"role": "user", "content": prompt}]), "custom", -1
    raise TypeError(f"prompts must be probe_mtp.prompts.Prompt objects or strings, got {type(prompt).__name__}")


def run_alignment_study(
    model,
    tokenizer,
    prompts: Sequence[Prompt | str],
    settings: dict[str, ProbeConfig] | None = None,
    *,
    max_new_tokens: int = 48,
    num_masks: int = 3,
    measure_tau: bool = True,
) -> AlignmentStudy:
    """For every prompt: the greedy continuation, then for every setting one alignment pass
    (:func:`~probe_mtp.analysis.alignment.align_masks` with ``num_masks`` masks per owner) and,
    with ``measure_tau``, the decoder's own tau with that setting.

    The continuation comes from the decoder run of the first setting (lossless, so it is the greedy
    continuation); every further setting's output is checked to be identical.  Without
    ``measure_tau`` it comes from ``model.generate(do_sample=False)``.  Prompts are formatted with
    the tokenizer's chat template (first turn only).
    """
    settings = settings or {"prompt mean + EMA": ProbeConfig(drafter="esp")}
    if not settings:
        raise ValueError("settings must name at least one mask setting")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be an integer >= 2, got {max_new_tokens!r}")
    decoder = ProbeDecoder(model, tokenizer)
    stats = decoder.embedding_stats() if any(c.mask_init == "sample" for c in settings.values()) else None
    tables, taus = [], []
    for prompt in prompts:
        ids, task, pid = _prompt_ids(tokenizer, prompt)
        ids = ids.to(model.device)
        greedy = None
        if not measure_tau:
            greedy = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
        for label, config in settings.items():
            if measure_tau:
                out = decoder.generate(ids, config=config, max_new_tokens=max_new_tokens, return_dict_in_generate=True)
                if greedy is None:
                    greedy = out.sequences
                elif not torch.equal(out.sequences, greedy):
                    raise RuntimeError(f"setting {label!r} changed the greedy output of prompt {pid}: not lossless")
                s = out.stats
                taus.append((label, task, pid, s.mean_accepted_length, sum(s.accepted_lengths), len(s.accepted_lengths), s.new_tokens))
            continuation = greedy[0, ids.shape[1] :]
            if continuation.shape[0] < 2:
                continue  # stopped at once: no mask has a target
            alignment = align_masks(model, ids, continuation, config, num_masks=num_masks, stats=stats)
            tables.append(AlignmentTable.from_alignment(alignment, init=label, task=task, prompt=pid))
    return AlignmentStudy(
        table=AlignmentTable.concat(tables),
        tau=np.array(taus, dtype=TAU_DTYPE),
        settings=dict(settings),
        num_masks=num_masks,
        max_new_tokens=max_new_tokens,
    )
