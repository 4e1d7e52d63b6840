"""``generate(model, input_ids, ...)``: the drop-in entry point."""

from __future__ import annotations

import torch

from .config import ProbeConfig
from .decoder import ProbeDecoder


def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int = 20,
    eos_token_id: int | list[int] | None = None,
    return_dict_in_generate: bool = False,
    config: ProbeConfig | None = None,
    tokenizer=None,
    **probe_knobs,
):
    """Greedy multi-token decoding; returns exactly what
    ``model.generate(input_ids, do_sample=False, max_new_tokens=...)`` returns (token-identical in
    fp32).

    ``probe_knobs`` are :class:`ProbeConfig` fields (``num_masks``, ``budget``, ``mask_init``,
    ``mask_update``, ``prune_repeats``, ``drafter``, ...).  With ``return_dict_in_generate=True``
    the result has ``.sequences`` and ``.stats`` (forward passes, new tokens, accepted lengths and
    tau; see :class:`probe_mtp.decoder.DecodeStats` for how the prefill is counted).
    For repeated calls on one model, build a :class:`ProbeDecoder` once and call its ``generate``.
    """
    decoder = ProbeDecoder(model, tokenizer=tokenizer, config=config)
    return decoder.generate(
        input_ids,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        return_dict_in_generate=return_dict_in_generate,
        **probe_knobs,
    )
