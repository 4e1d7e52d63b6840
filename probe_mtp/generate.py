"""The drop-in entry points: ``generate(model, input_ids, ...)`` and ``custom_generate`` for
``model.generate(..., custom_generate=probe_mtp.custom_generate)``.

Both go through ``model.generate``'s own preparation (generation config and keyword overrides,
special tokens, ``max_new_tokens`` / ``max_length``, the logits processors the config implies, the
stopping criteria including ``stop_strings``), then hand the prepared pieces to the probe decoder.
So every option means exactly what it means in transformers.
"""

from __future__ import annotations

import torch

from .config import ProbeConfig
from .drafters import Drafter

UNSUPPORTED_CONFIG = {
    "num_beams": "beam search is not supported; use num_beams=1 (greedy or sampling)",
    "num_return_sequences": "several return sequences are not supported; call generate once per sample (seed each call)",
}
PROBE_KNOBS = frozenset(ProbeConfig.field_names())


def generate(model, input_ids: torch.Tensor | None = None, *, streamer=None, decoder=None, **kwargs):
    """Decode with probe-mtp; the same arguments and the same result as ``model.generate``.

    Greedy output is token-identical to ``model.generate(do_sample=False)`` in fp32; with
    ``do_sample=True`` every token follows exactly the distribution plain sampling would use.

    Accepted: every ``model.generate`` argument that applies to one sequence (``generation_config``
    and keyword overrides, ``max_new_tokens``/``max_length``, ``min_new_tokens``, ``eos_token_id``,
    ``pad_token_id``, ``attention_mask`` (left padding), ``logits_processor``, the processors the
    config implies, ``stopping_criteria``, ``stop_strings`` with ``tokenizer``, ``streamer``,
    ``return_dict_in_generate``, ``output_scores``), plus:

    - probe knobs: :class:`ProbeConfig` fields (``num_masks``, ``budget``, ``mask_init``, ...),
      or ``config=ProbeConfig(...)``; ``drafter`` may be a name or a :class:`Drafter` instance;
      ``masks=PATH`` uses mask vectors tuned by ``probe-mtp tune-masks`` (still lossless);
      ``acceptance="confadapt", threshold=0.9`` is the opt-in LOSSY ConfAdapt rule;
    - ``generator``: a ``torch.Generator`` for reproducible sampling (else the global seed);
    - ``decoder``: a :class:`ProbeDecoder` to reuse across calls (cached layouts, statistics).

    With ``return_dict_in_generate=True`` the result has ``.sequences``, ``.stats`` (forward passes,
    accepted lengths, tau; see :class:`probe_mtp.decoder.DecodeStats`) and ``.scores`` when
    ``output_scores=True``.
    """
    _check_input_ids(input_ids, kwargs.get("attention_mask"))
    max_new = kwargs.get("max_new_tokens")
    if max_new is not None:
        if not isinstance(max_new, int) or isinstance(max_new, bool):
            raise TypeError(f"max_new_tokens must be an integer, got {max_new!r}")
        if max_new < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new}")
        if max_new == 0:
            return _nothing_to_generate(model, input_ids, decoder, kwargs)
    tokenizer = kwargs.pop("tokenizer", None)
    _move_stop_strings_to_criteria(model, tokenizer, kwargs)
    return model.generate(
        input_ids,
        custom_generate=custom_generate,
        probe_streamer=streamer,
        probe_decoder=decoder,
        probe_tokenizer=tokenizer,
        **kwargs,
    )


def _move_stop_strings_to_criteria(model, tokenizer, kwargs: dict) -> None:
    """transformers does not hand ``tokenizer`` to a ``custom_generate`` function, so its own
    ``stop_strings`` handling cannot run there: build the ``StopStringCriteria`` here instead."""
    import copy

    from transformers import StopStringCriteria, StoppingCriteriaList

    stop_strings = kwargs.pop("stop_strings", None)
    config = kwargs.get("generation_config")
    for source in (config, model.generation_config):
        if stop_strings is None and source is not None and getattr(source, "stop_strings", None):
            stop_strings = source.stop_strings
            stripped = copy.deepcopy(source)
            stripped.stop_strings = None
            kwargs["generation_config"] = stripped
    if not stop_strings:
        return
    if tokenizer is None:
        raise ValueError("stop_strings needs the model's tokenizer: pass tokenizer=... to generate")
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    criteria.append(StopStringCriteria(tokenizer, stop_strings))
    kwargs["stopping_criteria"] = criteria


def custom_generate(
    model,
    input_ids,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    probe_tokenizer=None,
    probe_streamer=None,
    probe_decoder=None,
    config: ProbeConfig | None = None,
    generator: torch.Generator | None = None,
    num_masks: int | None = None,
    budget: int | str | None = None,
    max_budget: int | None = None,
    pass_memory: float | None = None,
    cost_curve=None,
    cost_cache: bool | None = None,
    mask_init: str | None = None,
    mask_update: float | None = None,
    mask_token: int | None = None,
    mask_seed: int | None = None,
    prune_repeats: bool | None = None,
    drafter: str | Drafter | None = None,
    sampling_rule: str | None = None,
    masks=None,
    acceptance: str | None = None,
    threshold: float | None = None,
    **model_kwargs,
):
    """``model.generate(input_ids, custom_generate=probe_mtp.custom_generate, ...)``.

    transformers prepares the processors and criteria and calls this function.  On that path it
    keeps ``streamer`` and ``tokenizer`` to itself: pass ``probe_streamer=`` instead of ``streamer``
    and a ``StopStringCriteria`` in ``stopping_criteria`` instead of ``stop_strings``, or use
    :func:`probe_mtp.generate`, which does both for you.
    """
    from .decoder import DecodeRequest, ProbeDecoder

    gen = generation_config
    _check_generation_config(gen)
    knobs = {
        name: value
        for name, value in dict(
            num_masks=num_masks, budget=budget, max_budget=max_budget, pass_memory=pass_memory, cost_curve=cost_curve,
            cost_cache=cost_cache, mask_init=mask_init, mask_update=mask_update,
            mask_token=mask_token, mask_seed=mask_seed, prune_repeats=prune_repeats,
            sampling_rule=sampling_rule, masks=masks, acceptance=acceptance, threshold=threshold,
        ).items()
        if value is not None
    }
    custom_drafter = drafter if isinstance(drafter, Drafter) else None
    if drafter is not None and custom_drafter is None:
        knobs["drafter"] = drafter
    if probe_decoder is None:
        probe_decoder = ProbeDecoder(model, probe_tokenizer, config)
        base = probe_decoder.config
    else:
        base = config or probe_decoder.config
    probe_config = ProbeConfig.from_kwargs(base, **knobs)

    prompt, pad_prefix = _strip_left_padding(input_ids, model_kwargs.get("attention_mask"))
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and prompt.shape[1] >= limit:
        raise ValueError(
            f"the prompt has {prompt.shape[1]} tokens but the model takes at most {limit} positions "
            "(config.max_position_embeddings); shorten the prompt"
        )
    max_length = int(gen.max_length) - pad_prefix.shape[1]
    if limit is not None:
        max_length = min(max_length, int(limit))
    request = DecodeRequest(
        prompt=prompt,
        max_length=max_length,
        processors=logits_processor if logits_processor else None,
        criteria=stopping_criteria,
        do_sample=bool(gen.do_sample),
        config=probe_config,
        drafter=custom_drafter,
        generator=generator,
        streamer=probe_streamer,
        output_scores=bool(gen.output_scores),
    )
    out = probe_decoder.decode(request)
    if pad_prefix.shape[1]:
        out.sequences = torch.cat([pad_prefix.to(out.sequences.device), out.sequences], dim=1)
    out.sequences = out.sequences.to(input_ids.device)
    return out if gen.return_dict_in_generate else out.sequences


def _nothing_to_generate(model, input_ids, decoder, kwargs):
    """``max_new_tokens=0``: the input, as a tensor or as a result object (no forward pass)."""
    from .decoder import DecodeStats, GenerateOutput

    knobs = {k: v for k, v in kwargs.items() if k in PROBE_KNOBS and not isinstance(v, Drafter)}
    ProbeConfig.from_kwargs(decoder.config if decoder is not None else None, **knobs)  # still validate knobs
    if kwargs.get("return_dict_in_generate"):
        return GenerateOutput(input_ids.clone(), DecodeStats(), () if kwargs.get("output_scores") else None)
    return input_ids.clone()


def _check_generation_config(gen) -> None:
    for name, message in UNSUPPORTED_CONFIG.items():
        value = getattr(gen, name, 1)
        if value is not None and value > 1:
            raise ValueError(f"{name}={value}: {message}")
    if getattr(gen, "num_beam_groups", 1) not in (None, 1):
        raise ValueError("diverse beam search (num_beam_groups) is not supported by probe-mtp")
    if getattr(gen, "penalty_alpha", None):
        raise ValueError("contrastive search (penalty_alpha) is not supported by probe-mtp; use greedy or sampling")


def _check_input_ids(input_ids, attention_mask=None) -> None:
    if input_ids is None:
        raise ValueError("input_ids is required: a [1, length] tensor of prompt token ids")
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids with shape [1, length], got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2D [batch, length], got shape {tuple(input_ids.shape)}; use ids[None] for one prompt")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"batch size {input_ids.shape[0]} is not supported yet: probe-mtp decodes one sequence at a time; "
            "call generate once per prompt"
        )
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt token (for example the BOS token)")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
        )


def _strip_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """Split ``[pads | prompt]``: padded positions are invisible and shift no position id in
    transformers, so decoding the unpadded prompt gives the same tokens; the pads are put back
    in front of the result."""
    if attention_mask is None or bool(attention_mask.all()):
        return input_ids, input_ids[:, :0]
    mask = attention_mask[0].bool()
    real = int(mask.sum())
    if real == 0:
        raise ValueError("attention_mask masks every prompt token; at least one must be visible")
    pads = mask.shape[0] - real
    if bool(mask[:pads].any()) or not bool(mask[pads:].all()):
        raise ValueError("attention_mask must be left padding (zeros, then ones); other patterns are not supported")
    return input_ids[:, pads:], input_ids[:, :pads]
