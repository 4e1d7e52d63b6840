"""Batched decoding on tiny random models: row for row what model.generate returns for the same
left-padded batch (greedy), rows ending at different steps, sliding windows crossed, processors and
stopping criteria per row, num_return_sequences, scores, sampling per row, and clear refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, StoppingCriteria

import probe_mtp
from probe_mtp import ProbeDecoder
from probe_mtp.adaptive import AdaptiveBudget, BatchWidthCosts, laggard_weights, plan_batch
from probe_mtp.cost import CostCurve
from probe_mtp.tree import TokenTree

FLAT = {1: 1.0, 4: 1.05, 16: 1.2, 64: 2.0}
AUTO = dict(cost_curve=FLAT, cost_cache=False)
ESP = dict(drafter="esp", num_masks=2, budget=30)


def _llama(eos=63):
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=64, max_position_embeddings=512,
                         attn_implementation="sdpa", bos_token_id=0, eos_token_id=eos, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def _gemma(attn="sdpa"):
    torch.manual_seed(0)
    config = Gemma3TextConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=32, intermediate_size=128, vocab_size=64, sliding_window=8,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              max_position_embeddings=512, attn_implementation=attn, bos_token_id=2,
                              eos_token_id=1, pad_token_id=0)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _batch(lengths, seed=1, repeat_row=1):
    """Left-padded rows of the given lengths (one row a repeated pattern, so drafts get accepted)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        row = torch.randint(3, 60, (n,), generator=g)
        if r == repeat_row:
            row = torch.tensor(([5, 6, 7, 8] * n)[:n])
        ids[r, width - n :] = row
        mask[r, width - n :] = 1
    return ids, mask


@pytest.mark.parametrize("make", [_llama, _gemma, lambda: _gemma("eager")], ids=["llama", "gemma3-sliding", "gemma3-eager"])
@pytest.mark.parametrize("knobs", [AUTO, ESP], ids=["default", "esp"])
def test_greedy_batch_is_row_for_row_generate(make, knobs):
    model = make()
    ids, mask = _batch([5, 12, 3, 20])  # prompts and generations past the 8-token window
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    out = probe_mtp.generate(model, ids, attention_mask=mask, max_new_tokens=40, return_dict_in_generate=True, **knobs)
    assert torch.equal(out.sequences, ref)
    assert out.stats.forward_passes == len(out.stats.inputs_per_pass) + 1  # one pass per step for the batch
    assert len(out.row_stats) == 4 and out.stats.new_tokens == 4 * 40


LINEAR = {1: 1.0, 64: 64.0}  # a pass costs in proportion to its inputs (a CPU's long prompts)


@pytest.mark.parametrize("make", [_llama, _gemma, lambda: _gemma("eager")], ids=["llama", "gemma3-sliding", "gemma3-eager"])
@pytest.mark.parametrize("curve, apart", [(LINEAR, True), (FLAT, False)], ids=["rows-apart", "padded"])
def test_prompts_of_very_different_lengths_are_prefilled_apart_where_padding_costs_more(make, curve, apart):
    model = make()
    ids, mask = _batch([3, 40, 6, 17], seed=5)  # prompts past the 8-token window, and one mostly padding
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    out = probe_mtp.generate(model, ids, attention_mask=mask, max_new_tokens=24, return_dict_in_generate=True,
                             cost_curve=curve, cost_cache=False)
    assert torch.equal(out.sequences, ref)
    prefill_passes = out.stats.forward_passes - len(out.stats.inputs_per_pass)
    assert prefill_passes == (4 if apart else 1)
    # equal lengths: padding costs nothing, so even the linear curve keeps the one padded pass
    same, same_mask = _batch([9, 9, 9], seed=6)
    out = probe_mtp.generate(model, same, attention_mask=same_mask, max_new_tokens=8, return_dict_in_generate=True,
                             cost_curve=curve, cost_cache=False)
    assert torch.equal(out.sequences, model.generate(same, attention_mask=same_mask, do_sample=False, max_new_tokens=8))
    assert out.stats.forward_passes - len(out.stats.inputs_per_pass) == 1


@pytest.mark.parametrize("make", [_llama, _gemma], ids=["llama", "gemma3-sliding"])
def test_rows_that_end_at_different_steps(make):
    model = make()
    ids, mask = _batch([6, 9, 4, 14], seed=3)
    free = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 6])  # a token that ends the rows where it first appears
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    ends = [(row[ids.shape[1]:] == eos).nonzero()[:1].reshape(-1).tolist() for row in ref]
    assert len({tuple(e) for e in ends}) > 1, "rows should end at different steps"
    decoder = ProbeDecoder(model, **AUTO)
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=0,
                           return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    finished = [s.new_tokens for s in out.row_stats]
    assert min(finished) < max(finished)


def test_processors_criteria_and_scores_per_row():
    model = _llama()
    ids, mask = _batch([7, 4, 11])

    class StopAfter(StoppingCriteria):  # a per-row criterion: stop a row once it holds token 9 twice
        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids == 9).sum(dim=1) >= 2

    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, repetition_penalty=1.3, no_repeat_ngram_size=3,
              min_new_tokens=5, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    ref = model.generate(ids, stopping_criteria=[StopAfter()], **kw)
    out = probe_mtp.generate(model, ids, stopping_criteria=[StopAfter()], **AUTO, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores)
    for step, (a, b) in enumerate(zip(out.scores, ref.scores)):
        for r in range(ids.shape[0]):
            if ids.shape[1] + step < out.sequences.shape[1] and r in _running(out, ids, step):
                torch.testing.assert_close(a[r], b[r], rtol=1e-4, atol=1e-4)


def _running(out, ids, step):
    return [r for r, s in enumerate(out.row_stats) if step < s.new_tokens]


def test_num_return_sequences_repeats_rows_as_generate_does():
    model = _llama()
    ids, mask = _batch([5, 9])
    with pytest.raises(ValueError, match="num_return_sequences"):  # transformers' own rule for greedy
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4, num_return_sequences=3)
    with pytest.raises(ValueError, match="num_return_sequences"):
        probe_mtp.generate(model, ids, attention_mask=mask, max_new_tokens=4, num_return_sequences=3, **AUTO)
    out = probe_mtp.generate(model, ids, attention_mask=mask, do_sample=True, max_new_tokens=16, num_return_sequences=3,
                             generator=torch.Generator().manual_seed(0), **AUTO)
    assert out.shape == (6, ids.shape[1] + 16)
    assert torch.equal(out[:, : ids.shape[1]], ids.repeat_interleave(3, dim=0))  # rows repeated in order
    assert len({tuple(row.tolist()) for row in out[:3]}) > 1  # independent samples of one prompt


@pytest.mark.heavy
def test_sampling_per_row_follows_plain_sampling():
    """Two rows sampled in one batch: each row's first two tokens are distributed as plain
    sampling's (a contingency test over 600 seeded draws each); a rule that ignores the model fails."""
    model = _llama()
    ids, mask = _batch([4, 6])
    kw = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_p=0.9, max_new_tokens=2)
    decoder = ProbeDecoder(model, **AUTO)

    def draws(fn, n):
        return [tuple(fn(s)[:, -2:].reshape(-1).tolist()) for s in range(n)]

    def plain(seed):
        torch.manual_seed(40_000 + seed)
        return model.generate(ids, **kw)

    probe = draws(lambda s: decoder.generate(ids, generator=torch.Generator().manual_seed(s), **kw), 600)
    reference = draws(plain, 600)
    for r in range(2):
        a = [d[2 * r : 2 * r + 2] for d in probe]
        b = [d[2 * r : 2 * r + 2] for d in reference]
        assert _p_value(a, b) > 1e-3
    uniform = [tuple(np.random.default_rng(s).integers(3, 60, size=2).tolist()) for s in range(600)]
    assert _p_value(uniform, [d[:2] for d in reference]) < 1e-3  # the test can fail


def _p_value(a, b, min_count=5):
    keys = sorted(set(a) | set(b))
    ca = np.array([a.count(k) for k in keys])
    cb = np.array([b.count(k) for k in keys])
    big = (ca + cb) >= min_count
    table = np.array([np.append(ca[big], ca[~big].sum()), np.append(cb[big], cb[~big].sum())])
    return float(chi2_contingency(table[:, table.sum(0) > 0]).pvalue)


def test_unsupported_batch_inputs_are_clear_errors():
    model = _llama()
    ids, mask = _batch([5, 9])
    right = torch.flip(mask, dims=[1])
    with pytest.raises(ValueError, match="right padding.*padding_side='left'"):
        probe_mtp.generate(model, ids, attention_mask=right, max_new_tokens=4, **AUTO)
    with pytest.raises(ValueError, match="shape of input_ids"):
        probe_mtp.generate(model, ids, attention_mask=mask[:, 1:], max_new_tokens=4, **AUTO)
    holes = mask.clone()
    holes[1, -3] = 0
    with pytest.raises(ValueError, match="left padding"):
        probe_mtp.generate(model, ids, attention_mask=holes, max_new_tokens=4, **AUTO)
    with pytest.raises(ValueError, match="beam search"):
        probe_mtp.generate(model, ids, attention_mask=mask, max_new_tokens=4, num_beams=2, **AUTO)

    class Streamer:
        def put(self, value):
            pass

        def end(self):
            pass

    with pytest.raises(ValueError, match="streamer"):
        probe_mtp.generate(model, ids, attention_mask=mask, max_new_tokens=4, streamer=Streamer(), **AUTO)
    with pytest.raises(ValueError, match="confadapt"):
        probe_mtp.generate(model, ids, attention_mask=mask, max_new_tokens=4, drafter="esp", acceptance="confadapt")


def test_the_batch_budget_shrinks_trees_as_the_batch_grows():
    curve = CostCurve.from_mapping({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4, 16: 2.0, 32: 3.5, 64: 7.0})
    tree = TokenTree.from_paths(1, [[2, 3, 4, 5], [6], [7]])
    tree = TokenTree(tree.tokens, tree.parents, np.array([1.0, 0.9, 0.8, 0.7, 0.6, 0.3, 0.2]))

    def widths(rows):
        policies = [AdaptiveBudget(curve, 0, 64) for _ in range(rows)]
        return {p.num_inputs for p in plan_batch(policies, [tree] * rows, [100] * rows)}

    one, eight, thirty_two = widths(1), widths(8), widths(32)
    assert max(one) > max(eight) >= max(thirty_two)
    assert thirty_two == {1}  # no tree pays: plain batched steps


def test_a_rows_best_gains_over_all_widths_match_its_fit_width_by_width():
    curve = CostCurve.from_mapping({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4, 16: 2.0, 32: 3.5, 64: 7.0})
    tree = TokenTree.from_paths(1, [[2, 3, 4, 5], [6], [7, 8]])
    tree = TokenTree(tree.tokens, tree.parents, np.array([1.0, 0.9, 0.8, 0.7, 0.6, 0.3, 0.2, 0.1]))
    for k, free in ((0, None), (2, lambda t: t.depths <= 1)):
        policy = AdaptiveBudget(curve, k, 64, mask_free=free)
        choice = policy.row_choice(tree, 100)
        widths = np.arange(1, 40)
        expected = [max(choice.gain(False, choice.fit(False, w)), choice.gain(True, choice.fit(True, w)), 0.0)
                    for w in widths]
        assert choice.best_gains(widths) == pytest.approx(expected)
        assert expected[-1] > expected[2] > 0  # the widths really differ


def test_laggard_weights_value_the_row_that_finishes_last():
    assert laggard_weights(np.array([7.0]), 0.1) == pytest.approx([1.0])
    assert laggard_weights(np.array([30.0, 30.0, 30.0]), 0.1) == pytest.approx([1.0, 1.0, 1.0])
    weights = laggard_weights(np.array([60.0, 59.0, 20.0, 0.0]), 0.05)
    assert weights[0] == pytest.approx(1.0)
    assert 0.8 < weights[1] < 1.0  # about as far behind: may well finish last
    assert weights[2] < 0.1 and weights[3] == pytest.approx(0.05, abs=1e-3)  # far ahead: its share of the pass
    assert np.all(laggard_weights(np.array([5.0, 50.0]), 2.0) == 1.0)  # a share is at most the whole pass


def test_the_batch_widens_for_the_row_that_finishes_last_not_for_rows_far_ahead():
    curve = CostCurve.from_mapping({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4, 16: 2.0, 32: 3.5, 64: 7.0})
    sure = TokenTree.from_paths(1, [[2, 3, 4, 5]])
    sure = TokenTree(sure.tokens, sure.parents, np.array([1.0, 0.95, 0.9, 0.85, 0.8]))
    bare = TokenTree.root_only(1)

    def width(weights):
        policies = [AdaptiveBudget(curve, 0, 64) for _ in range(4)]
        plans = plan_batch(policies, [sure, bare, bare, bare], [100] * 4, None, weights)
        return max(p.num_inputs for p in plans)

    assert width(None) > 1  # every row alike: the first row's chain pays for the pass
    assert width(np.array([1.0, 1.0, 1.0, 1.0])) == width(None)
    assert width(laggard_weights(np.array([5.0, 40.0, 40.0, 40.0]), 0.05)) == 1  # it is far ahead: bare steps
    assert width(laggard_weights(np.array([40.0, 5.0, 5.0, 5.0]), 0.05)) > 1  # it finishes last: widen for it


def test_measured_width_costs_override_the_curve_in_the_batch_budget():
    curve = CostCurve.from_mapping({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4, 16: 2.0, 32: 3.5, 64: 7.0})
    tree = TokenTree.from_paths(1, [[2, 3, 4, 5], [6], [7]])
    tree = TokenTree(tree.tokens, tree.parents, np.array([1.0, 0.9, 0.8, 0.7, 0.6, 0.3, 0.2]))
    rows = 4
    widths = BatchWidthCosts()

    def width():
        policies = [AdaptiveBudget(curve, 0, 64) for _ in range(rows)]
        return max(p.num_inputs for p in plan_batch(policies, [tree] * rows, [100] * rows, widths))

    assert width() > 1  # the curve says trees pay at 4 rows
    widths.observe(rows, 1, 0.1)
    widths.observe(rows, 2, 1.0)  # measured: a second input per row costs 10 bare passes
    assert widths.relative(rows, 2, 1.1) == pytest.approx(10.0)
    assert widths.relative(rows, 5, 1.2) == pytest.approx(10.0)  # never below a narrower measured width
    assert widths.relative(rows, 5, 12.0) == pytest.approx(12.0)
    assert widths.relative(rows + 1, 2, 1.1) == pytest.approx(1.1)  # no bare pass timed over 5 rows
    assert width() == 1


def test_the_decoder_measures_batch_widths_only_with_a_measured_curve():
    model = _llama()
    ids, mask = _batch([5, 9, 3])
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    supplied = ProbeDecoder(model, **AUTO)
    assert torch.equal(supplied.generate(ids, attention_mask=mask, max_new_tokens=12), ref)
    assert not supplied._batch_widths.seconds  # a supplied curve is taken as said
    measured = ProbeDecoder(model, cost_cache=False)
    assert torch.equal(measured.generate(ids, attention_mask=mask, max_new_tokens=12), ref)
    assert measured._batch_widths.seconds  # its passes were timed, for this batch and the next


@pytest.mark.parametrize("make", [_llama, _gemma], ids=["llama", "gemma3-sliding"])
def test_compacting_the_ragged_cache_every_step_changes_nothing(make, monkeypatch):
    import probe_mtp.ragged as ragged

    monkeypatch.setattr(ragged, "HOLE_SHARE", 0.0)
    monkeypatch.setattr(ragged, "HOLE_SLACK", 0)
    compactions = []
    original = ragged.RaggedCache.compact
    monkeypatch.setattr(ragged.RaggedCache, "compact", lambda self: compactions.append(1) or original(self))
    model = make()
    ids, mask = _batch([5, 12, 3, 20], seed=4)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    # a fixed budget: the adaptive one sizes trees by this machine's timings, so how many steps
    # reject nodes (and leave holes to compact) would depend on the machine
    out = probe_mtp.generate(model, ids, attention_mask=mask, max_new_tokens=40, drafter="hybrid", budget=30)
    assert torch.equal(out, ref) and len(compactions) > 5


def test_kept_logits_hold_every_rows_nodes_in_one_block_then_its_other_inputs():
    from probe_mtp.batch import KeptLogits

    # row r's kept input i has the logits row [r, i]; row 0 keeps 3 inputs (2 nodes), row 1 keeps 4 (1 node)
    rows = [torch.tensor([[0.0, i] for i in range(3)]), torch.tensor([[1.0, i] for i in range(4)])]
    kept = KeptLogits.of(rows, [2, 1])
    assert kept.node_block.tolist() == [[0, 0], [0, 1], [1, 0]]
    assert kept.nodes(0).tolist() == [[0, 0], [0, 1]] and kept.nodes(1).tolist() == [[1, 0]]
    assert kept.extra(0).tolist() == [[0, 2]] and kept.extra(1).tolist() == [[1, 1], [1, 2], [1, 3]]
    assert kept.node_block.data_ptr() == kept.flat.data_ptr()  # a view: reduced without a copy


def test_the_ragged_cache_keeps_each_rows_path_with_its_positions():
    from probe_mtp.kv import ReservedLayer
    from probe_mtp.ragged import RaggedCache

    class Cache:
        layers = [ReservedLayer(16)]

    layer = Cache.layers[0]
    # two rows, one head, one dim: entry value = 100 * row + slot
    def entries(first, count):
        return (100 * torch.arange(2.0)[:, None] + torch.arange(first, first + count)[None, :])[:, None, :, None]

    layer.update(entries(0, 3), entries(0, 3))  # the prompts: row 0 holds 3 tokens, row 1 two (one pad)
    ragged = RaggedCache(Cache(), 2, 16, torch.device("cpu"))
    ragged.prefill([0, 1], 3, 3)
    assert ragged.positions[:, :3].tolist() == [[0, 1, 2], [-1, 0, 1]]
    layer.update(entries(3, 4), entries(3, 4))  # a pass of 4 inputs per row
    ragged.keep(4, [np.array([0, 2]), np.array([0, 1, 3])], [np.array([3, 4]), np.array([2, 3, 4])])
    assert ragged.length == 6 and layer.keys.shape[2] == 6
    assert layer.keys[:, 0, 3:, 0].tolist() == [[3, 5, 5], [103, 104, 106]]
    assert torch.equal(layer.values, layer.keys)
    assert ragged.positions[:, :6].tolist() == [[0, 1, 2, 3, 4, -1], [-1, 0, 1, 2, 3, 4]]
    assert ragged.tokens().tolist() == [5, 5]
    # a pass whose kept inputs are every row's first ones moves nothing, only writes positions
    layer.update(entries(6, 2), entries(6, 2))
    ragged.keep(2, [np.array([0]), np.array([0, 1])], [np.array([5]), np.array([5, 6])])
    assert layer.keys[:, 0, 6:, 0].tolist() == [[6, 7], [106, 107]]
    assert ragged.positions[:, 6:8].tolist() == [[5, -1], [5, 6]]


@pytest.mark.parametrize("make", [_llama, _gemma], ids=["llama", "gemma3-sliding"])
def test_a_batch_through_the_models_own_output_layer_is_row_for_row_generate(make):
    # a model whose logits the split output layer cannot reproduce runs its own forward: every kept
    # input's logits come from the model, and the batch still reads each row's nodes and masks right
    from probe_mtp.head import SplitHead

    model = make()
    decoder = ProbeDecoder(model, **ESP)
    decoder._split_head = SplitHead(model)
    decoder._split_head.usable = False
    ids, mask = _batch([5, 12, 3, 20])
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    calls = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=30, return_dict_in_generate=True)
    finally:
        hook.remove()
    assert len(calls) == out.stats.forward_passes  # every pass through the model's own forward
    assert torch.equal(out.sequences, ref)
    assert sum(s.accepted_lengths.count(1) < len(s.accepted_lengths) for s in out.row_stats) >= 1  # drafts accepted
