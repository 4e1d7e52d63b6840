"""One generation's request: what ``model.generate`` prepared, checked, in a form the loop reads.

``model.generate`` does the preparation (generation config and keyword overrides, special tokens,
``max_new_tokens`` / ``max_length``, the logits processors the config implies, the stopping
criteria) and hands the pieces to a ``custom_generate`` function; :func:`build_request` turns them
into a :class:`DecodeRequest`.  The checks of what probe-mtp does not support live here too, so a
bad argument is refused with a clear message before any forward pass.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch

from .config import ProbeConfig
from .drafters import Drafter
from .stopping import HostCriteria

UNSUPPORTED_CONFIG = {
    "num_beams": "beam search is not supported; use num_beams=1 (greedy or sampling)",
}
# the keyword arguments of a custom_generate function besides the probe knobs (transformers pops
# the names of a custom function's parameters out of the generate() keywords and passes them on)
HANDLER_ARGUMENTS = ("config", "generator", "probe_streamer", "probe_tokenizer")


@dataclass
class DecodeRequest:
    """Everything one generation (one row) needs, prepared and checked.  ``pad_prefix`` is the
    row's left padding: invisible to the model and shifting no position, but part of the sequence
    that logits processors and stopping criteria read, and of the output, as in transformers."""

    prompt: torch.Tensor  # [1, P], padding removed
    max_length: int  # total length limit of the row (padding + prompt + new), from the generation config
    processors: object | None  # LogitsProcessorList or None
    criteria: object  # StoppingCriteriaList
    do_sample: bool
    config: ProbeConfig
    drafter: Drafter | None = None
    generator: torch.Generator | None = None
    streamer: object | None = None
    output_scores: bool = False
    pad_prefix: torch.Tensor | None = None  # [1, pads]; None: no padding
    # the criteria answered on the host (no wait for the device), None: run them as transformers does
    host_criteria: HostCriteria | None = None

    @property
    def pads(self) -> int:
        return 0 if self.pad_prefix is None else int(self.pad_prefix.shape[1])


def with_probe_knobs(fn):
    """Give ``fn`` (a ``custom_generate`` function ending in ``**kwargs``) one keyword-only parameter
    per :class:`ProbeConfig` field (and per ``HANDLER_ARGUMENTS`` it lacks), so that transformers
    hands those keywords to it instead of treating them as model arguments; the knobs are read from
    the configuration, never re-typed."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    rest = [p for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in params}
    knobs = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
             for name in HANDLER_ARGUMENTS + ProbeConfig.field_names() if name not in taken]
    fn.__signature__ = sig.replace(parameters=params + knobs + rest)
    return fn


def split_probe_knobs(kwargs: dict) -> tuple[dict, Drafter | None]:
    """Pop the probe knobs (set, not None) out of ``kwargs``: ``(knobs, drafter instance or None)``."""
    knobs = {name: kwargs.pop(name) for name in ProbeConfig.field_names() if name in kwargs}
    knobs = {name: value for name, value in knobs.items() if value is not None}
    custom = knobs.pop("drafter") if isinstance(knobs.get("drafter"), Drafter) else None
    return knobs, custom


def row_processors(processors, row: int):
    """``processors`` for one row of a batch.  A tree verifies many paths of one row at once, so a
    processor that holds per-row state of the batch must hold that row's: transformers'
    repetition penalty ignores each row's left padding by a per-row length, which becomes the
    row's own length here.  Every other processor is shared as it is."""
    if not processors:
        return None
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    out = LogitsProcessorList()
    for proc in processors:
        if isinstance(proc, RepetitionPenaltyLogitsProcessor) and isinstance(proc.prompt_ignore_length, torch.Tensor):
            proc = copy.copy(proc)
            proc.prompt_ignore_length = int(proc.prompt_ignore_length.reshape(-1)[row])
        out.append(proc)
    return out


def build_requests(model, input_ids, logits_processor, stopping_criteria, generation_config, config: ProbeConfig,
                   drafter: Drafter | None, generator, streamer, attention_mask) -> list[DecodeRequest]:
    """One request per row of ``input_ids`` (left padding split off each row)."""
    gen = generation_config
    check_generation_config(gen)
    check_input_ids(input_ids, attention_mask)
    rows = input_ids.shape[0]
    if rows > 1 and streamer is not None:
        raise ValueError(f"a streamer takes one sequence; it cannot follow a batch of {rows} rows (as in transformers)")
    if rows > 1 and drafter is not None:
        raise ValueError("a Drafter instance proposes for one sequence; pass drafter by name for a batch")
    check_generator_device(generator, model.device)
    host_criteria = HostCriteria.of(stopping_criteria)
    limit = getattr(model.config, "max_position_embeddings", None)
    requests = []
    for r in range(rows):
        prompt, pad_prefix = strip_left_padding(input_ids[r : r + 1], None if attention_mask is None else attention_mask[r : r + 1])
        if limit is not None and prompt.shape[1] >= limit:
            raise ValueError(
                f"the prompt has {prompt.shape[1]} tokens but the model takes at most {limit} positions "
                "(config.max_position_embeddings); shorten the prompt"
            )
        max_length = int(gen.max_length)
        if limit is not None:
            max_length = min(max_length, int(limit) + pad_prefix.shape[1])
        requests.append(DecodeRequest(
            prompt=prompt,
            max_length=max_length,
            processors=row_processors(logits_processor, r),
            criteria=stopping_criteria,
            do_sample=bool(gen.do_sample),
            config=config,
            drafter=drafter,
            generator=generator,
            streamer=streamer,
            output_scores=bool(gen.output_scores),
            pad_prefix=pad_prefix if pad_prefix.shape[1] else None,
            host_criteria=host_criteria,
        ))
    return requests


def check_generator_device(generator, device: torch.device) -> None:
    """A ``generator`` draws on its own device only: refuse one that is not on the model's."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    have, want = torch.device(generator.device), torch.device(device)
    same = have.type == want.type and (have.index is None or want.index is None or have.index == want.index)
    if not same:
        raise ValueError(
            f"the generator is on {have} but the model is on {want}: a generator draws on its own device only; "
            f"make it with torch.Generator(device={str(want)!r}).manual_seed(...)"
        )


def move_stop_strings_to_criteria(model, tokenizer, kwargs: dict) -> None:
    """transformers does not hand ``tokenizer`` to a ``custom_generate`` function, so its own
    ``stop_strings`` handling cannot run there: build the ``StopStringCriteria`` here instead."""
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


def check_max_new_tokens(max_new) -> None:
    if max_new is None:
        return
    if not isinstance(max_new, int) or isinstance(max_new, bool):
        raise TypeError(f"max_new_tokens must be an integer, got {max_new!r}")
    if max_new < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new}")


def check_generation_config(gen) -> None:
    for name, message in UNSUPPORTED_CONFIG.items():
        value = getattr(gen, name, 1)
        if value is not None and value > 1:
            raise ValueError(f"{name}={value}: {message}")
    if getattr(gen, "num_beam_groups", 1) not in (None, 1):
        raise ValueError("diverse beam search (num_beam_groups) is not supported by probe-mtp")
    if getattr(gen, "penalty_alpha", None):
        raise ValueError("contrastive search (penalty_alpha) is not supported by probe-mtp; use greedy or sampling")


def check_input_ids(input_ids, attention_mask=None) -> None:
    if input_ids is None:
        raise ValueError("input_ids is required: a [batch, length] tensor of prompt token ids")
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids with shape [batch, length], got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2D [batch, length], got shape {tuple(input_ids.shape)}; use ids[None] for one prompt")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids has no rows: give at least one prompt")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt token (for example the BOS token)")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
        )
    if attention_mask is not None and not bool(attention_mask[:, -1].bool().all()):
        raise ValueError("attention_mask ends in padding (right padding): decoder-only generation needs left padding; "
                         "load the tokenizer with padding_side='left'")


def strip_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """Split one row ``[pads | prompt]``: padded positions are invisible and shift no position id in
    transformers, so the model sees the unpadded prompt; the pads stay in front of the row."""
    if attention_mask is None or bool(attention_mask.all()):
        return input_ids, input_ids[:, :0]
    mask = attention_mask[0].bool()
    real = int(mask.sum())
    if real == 0:
        raise ValueError("attention_mask masks every prompt token of a row; at least one must be visible")
    pads = mask.shape[0] - real
    if bool(mask[:pads].any()) or not bool(mask[pads:].all()):
        raise ValueError("attention_mask must be left padding (zeros, then ones) in every row; holes inside a "
                         "prompt are not supported")
    return input_ids[:, pads:], input_ids[:, :pads]
