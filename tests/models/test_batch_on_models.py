"""Batched greedy decoding on the embedded models: row for row what model.generate returns for the
same left-padded batch, with prompts of very different lengths, rows that end at different steps,
(Gemma 3) rows past its 512-token sliding window, and stop strings, logits processors and stopping
criteria applied row by row."""

from __future__ import annotations

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import probe_mtp
from probe_mtp import ProbeDecoder
from probe_mtp.prompts import balanced_subset
from probe_mtp.report.batches import left_padded

from conftest import chat_ids


def test_smollm2_batch_is_row_for_row_generate(smollm2, specbench):
    model, tok = smollm2
    texts = [p.turns[0] for p in balanced_subset(specbench, 1)][:4] + ["Reply with the single word: yes", "Say hello."]
    ids, mask = left_padded([chat_ids(tok, t) for t in texts], tok.pad_token_id)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    decoder = ProbeDecoder(model, tok)
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=40, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    ended = [s.new_tokens for s in out.row_stats]
    assert min(ended) < 40 == max(ended), "the short answers should end early, with EOS"
    # one pass per step for the whole batch, after a prefill in one padded pass or one pass per row
    # (prompts of very different lengths, where this machine's cost curve says padding costs more)
    assert out.stats.forward_passes - len(out.stats.inputs_per_pass) in (1, ids.shape[0])
    # and the same batch through transformers' own generate with the probe as custom_generate
    again = model.generate(ids, attention_mask=mask, max_new_tokens=40, custom_generate=probe_mtp.custom_generate,
                           probe_decoder=decoder)
    assert torch.equal(again, ref)


def test_gemma3_batch_across_the_sliding_window(gemma3, specbench):
    model, tok = gemma3
    rag = [p.turns[0] for p in specbench if p.task == "rag"][:40]
    long_text = min(rag, key=lambda t: len(tok(t)["input_ids"]))  # about 600 tokens
    long_ids = tok(long_text, return_tensors="pt")["input_ids"]
    rows = [
        tok("The quick brown fox jumps over the lazy dog. The quick brown", return_tensors="pt")["input_ids"],
        long_ids[:, :495],  # crosses the 512-token window while generating
        long_ids,  # longer than the window
    ]
    ids, mask = left_padded(rows, 0)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=32)
    out = probe_mtp.generate(model, ids, attention_mask=mask, max_new_tokens=32)
    assert torch.equal(out, ref)


def test_smollm2_batch_stop_strings_per_row(smollm2, specbench):
    """A stop string ends each row where it first appears in that row's text (model.generate's rule,
    row by row); the rows it ends leave the batch, the others run on."""
    model, tok = smollm2
    texts = [p.turns[0] for p in balanced_subset(specbench, 1)][:3] + ["Count from one to twenty, in words."]
    ids, mask = left_padded([chat_ids(tok, t) for t in texts], tok.pad_token_id)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=48, stop_strings=[".", "\n\n"], tokenizer=tok)
    ref = model.generate(ids, **kw)
    out = probe_mtp.generate(model, return_dict_in_generate=True, input_ids=ids, **kw)
    assert torch.equal(out.sequences, ref)
    ended = [s.new_tokens for s in out.row_stats]
    assert len(set(ended)) > 1, f"the rows should stop at different steps: {ended}"
    assert min(ended) < 48


def test_smollm2_batch_processors_and_criteria_per_row(smollm2, specbench):
    """Logits processors that read each row's own tokens and a stopping criterion that ends rows
    one by one: sequences and every running row's scores as model.generate gives them."""
    model, tok = smollm2
    comma = tok.convert_tokens_to_ids(",")

    class EndsWithComma(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == comma

    texts = [p.turns[0] for p in balanced_subset(specbench, 1)][1:4] + ["List five fruits."]
    ids, mask = left_padded([chat_ids(tok, t) for t in texts], tok.pad_token_id)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=40, repetition_penalty=1.2, no_repeat_ngram_size=3,
              output_scores=True, return_dict_in_generate=True)
    ref = model.generate(ids, stopping_criteria=StoppingCriteriaList([EndsWithComma()]), **kw)
    out = probe_mtp.generate(model, ids, stopping_criteria=StoppingCriteriaList([EndsWithComma()]), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    ended = [s.new_tokens for s in out.row_stats]
    assert len(set(ended)) > 1, f"the rows should stop at different steps: {ended}"
    assert len(out.scores) == len(ref.scores)
    for step, (a, b) in enumerate(zip(out.scores, ref.scores)):
        for r, n in enumerate(ended):
            if step < n:
                torch.testing.assert_close(a[r], b[r], rtol=1e-4, atol=1e-4)
