"""The drop-in entry points: ``generate(model, input_ids, ...)`` and ``custom_generate`` for
``model.generate(..., custom_generate=probe_mtp.custom_generate)``.

Both go through ``model.generate``'s own preparation (generation config and keyword overrides,
special tokens, ``max_new_tokens`` / ``max_length``, the logits processors the config implies, the
stopping criteria including ``stop_strings``), then hand the prepared pieces to a
:class:`~probe_mtp.decoder.ProbeDecoder`.  So every option means exactly what it means in
transformers.
"""

from __future__ import annotations

import torch

from .decoder import ProbeDecoder
from .request import with_probe_knobs

DECODER_ATTRIBUTE = "_probe_mtp_decoder"


def decoder_for(model, tokenizer=None) -> ProbeDecoder:
    """The decoder :func:`generate` and :func:`custom_generate` use for ``model``: made on first use
    and kept on the model object itself, so its drafting memory serves every later call, belongs to
    that model only, and goes when the model goes (nothing is kept at module level)."""
    found = model.__dict__.get(DECODER_ATTRIBUTE)
    if not isinstance(found, ProbeDecoder) or found.model is not model:
        found = ProbeDecoder(model, tokenizer)
        model.__dict__[DECODER_ATTRIBUTE] = found
    return found


def generate(model, input_ids: torch.Tensor | None = None, *, decoder: ProbeDecoder | None = None, **kwargs):
    """Decode with probe-mtp; the same arguments and the same result as ``model.generate``.

    Greedy output is token-identical to ``model.generate(do_sample=False)`` in fp32; with
    ``do_sample=True`` every token follows exactly the distribution plain sampling would use.

    Accepted: every ``model.generate`` argument that applies to one sequence (``generation_config``
    and keyword overrides, ``max_new_tokens``/``max_length``, ``min_new_tokens``, ``eos_token_id``,
    ``pad_token_id``, ``attention_mask`` (left padding), ``logits_processor``, the processors the
    config implies, ``stopping_criteria``, ``stop_strings`` with ``tokenizer``, ``streamer``,
    ``return_dict_in_generate``, ``output_scores``), plus:

    - probe knobs: :class:`~probe_mtp.config.ProbeConfig` fields (``drafter``, ``num_masks``,
      ``budget``, ...), or ``config=ProbeConfig(...)``; ``drafter`` may be a name or a
      :class:`~probe_mtp.drafters.Drafter` instance; ``acceptance="confadapt"`` is the opt-in
      LOSSY rule;
    - ``generator``: a ``torch.Generator`` for reproducible sampling (else the global seed);
    - ``decoder``: the :class:`ProbeDecoder` to use; by default the model's own (:func:`decoder_for`),
      whose drafting memory learns from every call.

    With ``return_dict_in_generate=True`` the result has ``.sequences``, ``.stats`` (forward passes,
    accepted lengths, tau; see :class:`probe_mtp.stats.DecodeStats`) and ``.scores`` when
    ``output_scores=True``.
    """
    if decoder is None:
        decoder = decoder_for(model, kwargs.get("tokenizer"))
    elif decoder.model is not model:
        raise ValueError("decoder= belongs to another model; build a ProbeDecoder per model")
    return decoder.generate(input_ids, **kwargs)


@with_probe_knobs
def custom_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                    probe_decoder: ProbeDecoder | None = None, **kwargs):
    """``model.generate(input_ids, custom_generate=probe_mtp.custom_generate, ...)``.

    transformers prepares the processors and criteria and calls this function with every probe
    knob (:class:`~probe_mtp.config.ProbeConfig` fields) it was given.  On that path it keeps
    ``streamer`` and ``tokenizer`` to itself: pass ``probe_streamer=`` instead of ``streamer`` and
    a ``StopStringCriteria`` in ``stopping_criteria`` instead of ``stop_strings``, or use
    :func:`probe_mtp.generate`, which does both for you.  ``probe_decoder``: the decoder to use
    (default: the model's own, :func:`decoder_for`).
    """
    decoder = probe_decoder if probe_decoder is not None else decoder_for(model, kwargs.get("probe_tokenizer"))
    return decoder.handle_prepared(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs)
