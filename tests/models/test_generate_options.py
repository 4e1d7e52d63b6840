"""Every generation option of ``model.generate`` gives the same greedy output through probe-mtp
(fp32), on both integration paths; streamers see what is returned."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    TextStreamer,
)

import probe_mtp
from probe_mtp import ProbeDecoder

from conftest import chat_ids

PROMPTS = [
    "List five fruits and their colors.",
    "Write a short poem about the sea, then explain it.",
    "What is 17 times 23? Show the steps.",
]


class BanToken(LogitsProcessor):
    """A user processor that reads the sequence: bans the token that was generated last."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[torch.arange(scores.shape[0]), input_ids[:, -1]] = -float("inf")
        return scores


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return torch.tensor([int(input_ids[0, -1]) == self.token])


@pytest.fixture(scope="module")
def smol(smollm2):
    model, tok = smollm2
    return model, tok, ProbeDecoder(model, tok, num_masks=2, budget=30)


def _both(model, decoder, ids, **kwargs):
    ref = model.generate(ids, do_sample=False, **kwargs)
    out = decoder.generate(ids, do_sample=False, **kwargs)
    return ref, out


OPTIONS = {
    "repetition_penalty": dict(max_new_tokens=40, repetition_penalty=1.3),
    "no_repeat_ngram": dict(max_new_tokens=40, no_repeat_ngram_size=2),
    "min_new_tokens": dict(max_new_tokens=40, min_new_tokens=30),
    "suppress_tokens": dict(max_new_tokens=30, suppress_tokens=[13, 30, 28]),
    "bad_words": dict(max_new_tokens=30, bad_words_ids=[[330], [11, 2]]),
    "sequence_bias": dict(max_new_tokens=30, sequence_bias={(28,): -5.0}),
    "max_length": dict(max_length=60),
    "user_processor": dict(max_new_tokens=30, logits_processor=LogitsProcessorList([BanToken()])),
    "generation_config": dict(generation_config=GenerationConfig(max_new_tokens=25, repetition_penalty=1.2, do_sample=False)),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_identical_to_generate(smol, name):
    model, tok, decoder = smol
    ids = chat_ids(tok, PROMPTS[list(OPTIONS).index(name) % 2])  # the first two prompts in turn
    ref, out = _both(model, decoder, ids, **OPTIONS[name])
    assert torch.equal(out, ref), name


def test_min_new_tokens_holds_back_eos(smol):
    model, tok, decoder = smol
    ids = chat_ids(tok, "Reply with the single word: yes")
    ref, out = _both(model, decoder, ids, max_new_tokens=30, min_new_tokens=12)
    assert ref.shape[1] - ids.shape[1] >= 12
    assert torch.equal(out, ref)


def test_eos_list_and_pad(smol):
    model, tok, decoder = smol
    ids = chat_ids(tok, PROMPTS[0])
    ref_full = model.generate(ids, do_sample=False, max_new_tokens=40)
    stop_tok = int(ref_full[0, ids.shape[1] + 5])
    ref, out = _both(model, decoder, ids, max_new_tokens=40, eos_token_id=[tok.eos_token_id, stop_tok], pad_token_id=tok.eos_token_id)
    assert torch.equal(out, ref)
    assert int(out[0, -1]) == stop_tok


def test_stopping_criteria_and_stop_strings(smol):
    model, tok, decoder = smol
    ids = chat_ids(tok, PROMPTS[0])
    full = model.generate(ids, do_sample=False, max_new_tokens=60)
    target = int(full[0, ids.shape[1] + 9])
    crit = StoppingCriteriaList([StopAfterToken(target)])
    ref, out = _both(model, decoder, ids, max_new_tokens=60, stopping_criteria=crit)
    assert torch.equal(out, ref)
    text = tok.decode(full[0, ids.shape[1]:])
    stop = text.split()[6]
    ref = model.generate(ids, do_sample=False, max_new_tokens=60, stop_strings=[stop], tokenizer=tok)
    out = probe_mtp.generate(model, ids, do_sample=False, max_new_tokens=60, stop_strings=[stop], tokenizer=tok)
    assert torch.equal(out, ref)
    assert out.shape[1] < full.shape[1]


def test_custom_generate_path(smol):
    model, tok, _ = smol
    ids = chat_ids(tok, PROMPTS[2])
    ref = model.generate(ids, do_sample=False, max_new_tokens=40, repetition_penalty=1.1)
    out = model.generate(ids, do_sample=False, max_new_tokens=40, repetition_penalty=1.1,
                         custom_generate=probe_mtp.custom_generate, num_masks=2, budget=60)
    assert torch.equal(out, ref)
    res = model.generate(ids, max_new_tokens=20, custom_generate=probe_mtp.custom_generate,
                         return_dict_in_generate=True)
    assert torch.equal(res.sequences, model.generate(ids, do_sample=False, max_new_tokens=20))
    assert res.stats.forward_passes <= 20
    # on this path transformers keeps `streamer` to itself: probe_streamer reaches the decoder
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    out = model.generate(ids, max_new_tokens=20, custom_generate=probe_mtp.custom_generate, probe_streamer=streamer)
    assert "".join(streamer) == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_left_padding_attention_mask(smol):
    model, tok, decoder = smol
    ids = chat_ids(tok, PROMPTS[1])
    pad = torch.full((1, 4), tok.pad_token_id or 0, dtype=ids.dtype)
    padded = torch.cat([pad, ids], dim=1)
    mask = torch.cat([torch.zeros_like(pad), torch.ones_like(ids)], dim=1)
    ref = model.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=30)
    out = decoder.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=30)
    assert torch.equal(out, ref)


def test_scores_match_generate(smol):
    model, tok, decoder = smol
    ids = chat_ids(tok, PROMPTS[0])
    ref = model.generate(ids, do_sample=False, max_new_tokens=20, return_dict_in_generate=True,
                         output_scores=True, repetition_penalty=1.2)
    out = decoder.generate(ids, do_sample=False, max_new_tokens=20, return_dict_in_generate=True,
                           output_scores=True, repetition_penalty=1.2)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores)
    for a, b in zip(out.scores, ref.scores):
        assert torch.allclose(a, b, atol=2e-3, rtol=1e-3)


def test_text_streamer_prints_the_answer(smol, capsys):
    model, tok, decoder = smol
    ids = chat_ids(tok, PROMPTS[0])
    out = decoder.generate(ids, max_new_tokens=40, streamer=TextStreamer(tok, skip_prompt=True))
    printed = capsys.readouterr().out
    assert printed.strip() == tok.decode(out[0, ids.shape[1]:]).strip()


def test_text_iterator_streamer_gets_tokens_in_blocks(smol):
    model, tok, decoder = smol
    ids = chat_ids(tok, PROMPTS[2])
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    result = {}
    worker = threading.Thread(
        target=lambda: result.setdefault("out", decoder.generate(ids, max_new_tokens=48, streamer=streamer))
    )
    worker.start()
    text = "".join(streamer)
    worker.join()
    assert text == tok.decode(result["out"][0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.gemma
def test_options_on_gemma(gemma3):
    model, tok = gemma3
    decoder = ProbeDecoder(model, tok, num_masks=2, budget=30)
    ids = tok("The three primary colors are", return_tensors="pt")["input_ids"]
    for name in ("repetition_penalty", "user_processor"):  # a built-in and a user processor that read the sequence
        ref, out = _both(model, decoder, ids, **OPTIONS[name])
        assert torch.equal(out, ref), name
    ref = model.generate(ids, do_sample=False, max_new_tokens=30, stop_strings=["."], tokenizer=tok)
    out = decoder.generate(ids, do_sample=False, max_new_tokens=30, stop_strings=["."])
    assert torch.equal(out, ref)
