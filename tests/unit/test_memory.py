"""The drafting memory: longest-match corpus, bounded size, a file format that checks its model, and
a decoder that learns across requests without changing a single output token."""

from __future__ import annotations

import gc
import threading
import tracemalloc
import warnings
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import probe_mtp
from probe_mtp import ProbeDecoder
from probe_mtp.corpus import Corpus, SuffixAutomaton
from probe_mtp.decoder import MemoryFileWarning
from probe_mtp.memory import DraftingMemory, MemoryFileError

FLAT_CURVE = {1: 1.0, 4: 1.05, 16: 1.2, 64: 2.0}
KNOBS = dict(cost_curve=FLAT_CURVE, cost_cache=False)


def _tiny(seed=0, vocab=32):
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=vocab, max_position_embeddings=512,
                         attn_implementation="sdpa", bos_token_id=0, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked logits: no near-ties
    return model


@pytest.fixture(scope="module")
def tiny():
    return _tiny()


def _longest_suffix_match(query: list[int], docs: list[list[int]]) -> int:
    flat = "," + ",".join(",".join(map(str, d)) + ",-1" for d in docs) + ","
    for n in range(len(query), 0, -1):
        if "," + ",".join(map(str, query[-n:])) + "," in flat:
            return n
    return 0


@settings(max_examples=60, deadline=None)
@given(docs=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=30), min_size=1, max_size=5),
       query=st.lists(st.integers(0, 5), min_size=1, max_size=12))
def test_automaton_finds_the_longest_match_of_any_length(docs, query):
    sam = SuffixAutomaton()
    for d in docs:
        sam.add_document(d)
    state, matched = sam.match(query)
    assert matched == _longest_suffix_match(query, docs)
    # what followed the match anywhere in the corpus (never across a document boundary)
    tail = query[len(query) - matched :]
    expected = {d[i + matched] for d in docs for i in range(len(d) - matched)
                if matched and d[i : i + matched] == tail}
    assert set(sam.successors(state)) == (expected if matched else set(sam.successors(0)))


def test_corpus_stays_under_its_cap_and_forgets_the_oldest_first():
    cap = 400_000
    corpus = Corpus(cap)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 5000, size=300) for _ in range(200)]  # about 60k tokens: far over the cap
    tracemalloc.start()
    for d in docs:
        corpus.add(d)
        assert corpus.nbytes() <= cap
    traced, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert corpus.rebuilds >= 1 and len(corpus) < 60_000
    assert np.array_equal(corpus.documents[-1], docs[-1])  # the newest is kept ...
    assert not any(np.array_equal(d, docs[0]) for d in corpus.documents)  # ... the oldest went first
    kept = len(corpus.documents)
    assert all(np.array_equal(a, b) for a, b in zip(corpus.documents, docs[-kept:]))
    assert traced <= 1.2 * cap  # the estimate holds against what Python really allocated


def test_memory_file_round_trip_and_refusals(tiny, tmp_path):
    decoder = ProbeDecoder(tiny, **KNOBS)
    ids = torch.tensor([[1, 5, 7, 5, 7, 9]])
    decoder.generate(ids, max_new_tokens=24)
    decoder.generate(torch.tensor([[2, 3, 4]]), max_new_tokens=24)
    before = decoder.memory.summary()
    path = decoder.save_memory(tmp_path / "memory.safetensors")

    warm = ProbeDecoder(tiny, memory=path, **KNOBS)
    assert warm.memory.summary() == before
    assert [list(d) for d in warm.memory.corpus.documents] == [list(d) for d in decoder.memory.corpus.documents]
    a, b = decoder.memory.successor_table(8, 2), warm.memory.successor_table(8, 2)
    assert all(np.array_equal(x, y) for x, y in zip(a.as_arrays().values(), b.as_arrays().values()))

    other = _tiny(seed=1)  # another model's weights: refused, clearly, and the decoder starts cold
    with pytest.raises(MemoryFileError, match="another model"):
        ProbeDecoder(other, **KNOBS).load_memory(path)
    with pytest.warns(MemoryFileWarning, match="another model"):
        cold = ProbeDecoder(other, memory=path, **KNOBS)
    assert cold.memory.summary()["corpus_tokens"] == 0
    assert cold.generate(ids, max_new_tokens=4).shape == (1, 10)  # and working

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    text = tmp_path / "text.safetensors"
    text.write_text("not a memory")
    foreign = tmp_path / "foreign.safetensors"
    from safetensors.numpy import save_file

    save_file({"base": np.zeros(3, dtype=np.float32)}, str(foreign), metadata={"format": "probe-mtp-masks/1"})
    for bad, match in ((truncated, "not a readable"), (text, "not a readable"), (foreign, "not a probe-mtp memory"),
                       (tmp_path / "missing", "not found")):
        with pytest.raises(MemoryFileError, match=match):
            decoder.load_memory(bad)
    assert decoder.memory.summary() == before  # a refused file leaves the decoder as it was


def test_warm_and_cold_decoders_emit_the_same_tokens_and_warm_learns(tiny):
    warm = ProbeDecoder(tiny, **KNOBS)
    cold = ProbeDecoder(tiny, memory=False, **KNOBS)
    prompts = [torch.tensor([[1, 5, 7, 5, 7, 9, 11]]), torch.tensor([[3, 4, 3, 4, 3]]), torch.tensor([[1, 5, 7, 5, 7, 9, 11]])]
    taus = []
    for ids in prompts:
        ref = tiny.generate(ids, do_sample=False, max_new_tokens=40)
        w = warm.generate(ids, max_new_tokens=40, return_dict_in_generate=True)
        c = cold.generate(ids, max_new_tokens=40, return_dict_in_generate=True)
        assert torch.equal(w.sequences, ref) and torch.equal(c.sequences, ref)
        assert w.stats.memory == "warm" and c.stats.memory == "cold"
        taus.append((w.stats.mean_accepted_length, c.stats.mean_accepted_length))
    # the third prompt repeats the first: the warm decoder drafts the whole answer from its corpus
    assert taus[2][0] > 4 and taus[2][0] > 2 * taus[2][1]
    assert warm.memory.summary()["corpus_documents"] == 3 and cold.memory is None
    warm.reset_memory()
    assert warm.memory.summary()["corpus_tokens"] == 0


def test_each_request_keeps_the_machine_timings_and_a_share_of_the_acceptance_counts(tiny):
    decoder = ProbeDecoder(tiny, **KNOBS)
    starts = []
    begin = decoder.memory.begin_request
    decoder.memory.begin_request = lambda: (starts.append(1), begin())
    decoder.generate(torch.tensor([[1, 5, 7, 5, 7, 9, 11]]), max_new_tokens=24)
    decoder.generate(torch.tensor([[1, 5, 7], [3, 4, 3]]), max_new_tokens=8)  # a batch is one request
    assert len(starts) == 2
    memory = decoder.memory
    (state,), (calibrator,) = memory.budgets.values(), memory.calibrators.values()
    timings = (state.scale, state.overhead_seconds, state.step_overhead, state.size_factors.copy())
    sums = [a.copy() for a in (state.calibration.accepted, state.calibration.score_sum, state.yields.expected)]
    trials = {s: t.copy() for s, t in calibrator.trials.items()}
    hits = {s: h.copy() for s, h in calibrator.hits.items()}
    assert state.scale is not None and any(t.sum() > 0 for t in trials.values()) and sums[1].sum() > 0
    memory.acceptance_carry = 0.5
    memory.begin_request()
    assert (state.scale, state.overhead_seconds, state.step_overhead) == timings[:3]
    assert np.array_equal(state.size_factors, timings[3])
    for before, after in zip(sums, (state.calibration.accepted, state.calibration.score_sum, state.yields.expected)):
        assert np.allclose(after, 0.5 * before)
    for s in trials:  # the rates stay, their weight halves
        assert np.allclose(calibrator.trials[s], 0.5 * trials[s]) and np.allclose(calibrator.hits[s], 0.5 * hits[s])
    memory.acceptance_carry = 0.0
    memory.begin_request()
    assert not state.calibration.score_sum.any() and not any(t.any() for t in calibrator.trials.values())
    assert len(memory.corpus.documents) == 3 and state.scale == timings[0]  # corpus and timings stay


def test_the_drop_in_generate_keeps_one_decoder_per_model_and_lets_the_model_go():
    model = _tiny()
    ids = torch.tensor([[1, 5, 7, 5]])
    probe_mtp.generate(model, ids, max_new_tokens=8, **KNOBS)
    decoder = probe_mtp.decoder_for(model)
    probe_mtp.generate(model, ids, max_new_tokens=8, **KNOBS)
    assert probe_mtp.decoder_for(model) is decoder and decoder.memory.requests == 2
    assert probe_mtp.decoder_for(_tiny(seed=2)) is not decoder  # never shared across models
    gone = weakref.ref(model)
    del model, decoder
    gc.collect()
    assert gone() is None


def test_two_threads_share_one_decoder_safely(tiny):
    decoder = ProbeDecoder(tiny, **KNOBS)
    prompts = [torch.tensor([[1 + i, 5, 7, 5, 7]]) for i in range(6)]
    refs = [tiny.generate(p, do_sample=False, max_new_tokens=24) for p in prompts]
    results, errors = {}, []

    def work(indices):
        try:
            for i in indices:
                results[i] = decoder.generate(prompts[i], max_new_tokens=24)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(range(k, 6, 2),)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(torch.equal(results[i], refs[i]) for i in range(6))
    assert decoder.memory.requests == 6


def test_memory_size_is_checked():
    with pytest.raises(ValueError, match="memory_mb"):
        DraftingMemory.for_model(_tiny(), max_mb=-1)
    with pytest.raises(TypeError, match="memory must be True, False or the path"):
        ProbeDecoder(_tiny(), memory=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ProbeDecoder(_tiny(), memory_mb=0, **KNOBS).generate(torch.tensor([[1, 2]]), max_new_tokens=3)


def test_a_model_holding_its_decoder_can_still_be_copied():
    import copy

    model = _tiny()
    probe_mtp.generate(model, torch.tensor([[1, 5, 7, 5]]), max_new_tokens=6, **KNOBS)
    twin = copy.deepcopy(model)
    decoder = probe_mtp.decoder_for(twin)
    assert decoder is not probe_mtp.decoder_for(model) and decoder.model is twin
    assert torch.equal(probe_mtp.generate(twin, torch.tensor([[1, 5, 7, 5]]), max_new_tokens=6, **KNOBS),
                       model.generate(torch.tensor([[1, 5, 7, 5]]), do_sample=False, max_new_tokens=6))
