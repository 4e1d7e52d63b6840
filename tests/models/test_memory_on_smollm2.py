"""The drafting memory on the embedded SmolLM2: a warm decoder and a cold one emit the same tokens
as model.generate on a stream of Spec-Bench prompts, the warm one learns (a repeated prompt is
drafted from the corpus), and its memory survives a save/load round trip."""

from __future__ import annotations

import torch

from probe_mtp import ProbeDecoder
from probe_mtp.prompts import balanced_subset

from conftest import SMOL_NEW_TOKENS, chat_ids


def test_warm_and_cold_decoders_are_identical_to_generate_on_a_stream(smollm2, specbench, greedy, tmp_path):
    model, tok = smollm2
    warm = ProbeDecoder(model, tok)
    cold = ProbeDecoder(model, tok, memory=False)
    prompts = balanced_subset(specbench, 1)
    stream = [chat_ids(tok, p.turns[0]) for p in prompts] + [chat_ids(tok, prompts[1].turns[0])]  # one asked again
    taus = []
    for ids in stream:
        ref = greedy(model, ids, SMOL_NEW_TOKENS)
        w = warm.generate(ids, max_new_tokens=SMOL_NEW_TOKENS, return_dict_in_generate=True)
        c = cold.generate(ids, max_new_tokens=SMOL_NEW_TOKENS, return_dict_in_generate=True)
        assert torch.equal(w.sequences, ref) and torch.equal(c.sequences, ref)
        assert w.stats.masks == "bundled:smollm2-135m" and w.stats.memory == "warm" and c.stats.memory == "cold"
        taus.append((w.stats.mean_accepted_length, c.stats.mean_accepted_length))
    repeat_warm, repeat_cold = taus[-1]
    assert repeat_warm > 3 and repeat_warm > 1.5 * repeat_cold  # the repeated answer comes from the corpus
    assert warm.memory.summary()["corpus_documents"] == len(stream)

    path = warm.save_memory(tmp_path / "smollm2.memory")
    again = ProbeDecoder(model, tok, memory=path)
    ids = stream[0]
    out = again.generate(ids, max_new_tokens=SMOL_NEW_TOKENS, return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy(model, ids, SMOL_NEW_TOKENS))
    assert out.stats.mean_accepted_length > 3  # it remembers the first answer too
