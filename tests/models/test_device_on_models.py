"""Ready for an accelerator, on the embedded SmolLM2 (see tests/unit/test_device_hygiene.py for the
tiny-architecture checks): decoding under torch's default device "meta" stays identical to
``model.generate``, and the host synchronisations per decoding step stay within budget for the
default decoder (whatever tau), a batch of four and seeded sampling."""

from __future__ import annotations

import pytest
import torch

import probe_mtp
from probe_mtp import ProbeDecoder
from probe_mtp.device_audit import HostSyncCounter, meta_default_device
from probe_mtp.prompts import balanced_subset
from probe_mtp.report.batches import left_padded

from conftest import chat_ids

SYNC_BUDGET = 3
NEW = 48


@pytest.fixture(scope="module")
def prompts(smollm2, specbench):
    _, tok = smollm2
    return [chat_ids(tok, p.turns[0]) for p in balanced_subset(specbench, 1)]


@pytest.mark.cpu_only
def test_default_decoder_under_meta_is_generate(smollm2, prompts, greedy):
    model, tok = smollm2
    decoder = ProbeDecoder(model, tok)
    for ids in prompts[:4]:
        with meta_default_device():
            out = decoder.generate(ids, max_new_tokens=NEW)
        assert torch.equal(out, greedy(model, ids, NEW))


@pytest.mark.cpu_only
def test_batch_with_scores_under_meta_is_generate(smollm2, prompts):
    model, tok = smollm2
    ids, mask = left_padded(prompts[:3], tok.pad_token_id)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, return_dict_in_generate=True,
                  output_scores=True)
    ref = model.generate(ids, **kwargs)
    with meta_default_device():
        out = probe_mtp.generate(model, ids, decoder=ProbeDecoder(model, tok), **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    for mine, theirs in zip(out.scores, ref.scores):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def syncs_per_step(model, ids, decoder, **kwargs) -> tuple[float, object]:
    """Host synchronisations per step: the whole generation's less the set-up and prefill's (the
    same call for one token), over the steps after the prefill."""
    def count(**kw):
        with HostSyncCounter() as syncs:
            res = decoder.generate(ids, return_dict_in_generate=True, **kw)
        return syncs.total, res

    total, res = count(**kwargs)
    setup, _ = count(**dict(kwargs, max_new_tokens=1))
    return (total - setup) / (res.stats.forward_passes - 1), res


def test_default_decoder_syncs_per_step(smollm2, prompts, greedy):
    model, tok = smollm2
    decoder = ProbeDecoder(model, tok)
    for ids in prompts[:3]:
        rate, res = syncs_per_step(model, ids, decoder, max_new_tokens=NEW)
        assert torch.equal(res.sequences, greedy(model, ids, NEW))
        assert rate <= SYNC_BUDGET, rate
    # a prompt the warm memory has seen: long accepted blocks (tau well above 2)
    rate, res = syncs_per_step(model, prompts[0], decoder, max_new_tokens=NEW)
    assert res.stats.mean_accepted_length > 2.5
    assert rate <= SYNC_BUDGET, rate


def test_batch_of_four_syncs_per_step(smollm2, prompts):
    model, tok = smollm2
    ids, mask = left_padded(prompts[:4], tok.pad_token_id)
    rate, res = syncs_per_step(model, ids, ProbeDecoder(model, tok), attention_mask=mask, max_new_tokens=32)
    assert torch.equal(res.sequences, model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=32))
    assert rate <= SYNC_BUDGET, rate


def test_sampling_syncs_per_step(smollm2, prompts):
    """Sampling reads its draws back once per step on an accelerator (tests/unit/test_device_hygiene.py
    shows that rule draws the same tokens); the CPU's rule reads one per token drawn."""
    model, tok = smollm2
    rate, res = syncs_per_step(model, prompts[1], ProbeDecoder(model, tok), max_new_tokens=NEW, do_sample=True,
                               temperature=0.7, generator=torch.Generator(device=model.device).manual_seed(0))
    per_token = 1 if model.device.type == "cpu" else 0
    assert rate <= SYNC_BUDGET + per_token * res.stats.mean_accepted_length, rate
