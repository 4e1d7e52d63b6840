"""The decoding step's pieces on toy tensors, and tree passes on tiny random-weight models
(fast checks of the mechanics; the losslessness proofs on real models are in test_lossless_*.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from transformers import DynamicCache, Gemma3TextConfig, LlamaConfig
from transformers.cache_utils import DynamicLayer
from transformers import Gemma3ForCausalLM, LlamaForCausalLM

from probe_mtp import ProbeDecoder
from probe_mtp.cost import measure_cost_curve
from probe_mtp.head import SplitHead
from probe_mtp.heap import heap_trimmer
from probe_mtp.kv import GROW_TOKENS, ReservedLayer, keep_accepted, new_cache, start_recording
from probe_mtp.verify import accept_greedy, accept_greedy_lazily, node_targets, process_node_logits, process_node_row
from probe_mtp.vocab import top_candidates
from probe_mtp.tree import TokenTree

from oracle import OracleDrafter
from tree_strategies import bfs_trees


def _tree():
    #        0(5)
    #      /   |   \
    #   1(7)  2(8)  3(9)
    #   /  \    |
    # 4(1) 5(2) 6(3)
    return TokenTree(
        np.array([5, 7, 8, 9, 1, 2, 3]),
        np.array([-1, 0, 0, 0, 1, 1, 2]),
        np.ones(7),
    )


@settings(max_examples=40, deadline=None)
@given(bfs_trees(), st.integers(0, 2**31 - 1))
def test_processing_one_node_row_equals_the_tree_wide_processing(tree, seed):
    """The lazy greedy walk processes only the rows it reaches: each equals the whole tree's row."""
    from transformers import LogitsProcessorList, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tree.size, 64, generator=gen)
    context = torch.randint(0, 64, (7,), generator=gen)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), NoRepeatNGramLogitsProcessor(2)])
    whole = process_node_logits(processors, context, tree, logits)
    for node in range(tree.size):
        assert torch.equal(process_node_row(processors, context, tree, logits, node), whole[node : node + 1])
    assert process_node_row(None, context, tree, logits, tree.size - 1).data_ptr() == logits[-1].data_ptr()  # a view


def test_accept_greedy_walks_matching_children():
    tree = _tree()
    targets = np.array([7, 2, 0, 0, 0, 4, 0])  # root -> 7 (node 1) -> 2 (node 5) -> bonus 4
    assert accept_greedy(tree, targets).tolist() == [0, 1, 5]
    targets = np.array([6, 0, 0, 0, 0, 0, 0])  # no child carries 6
    assert accept_greedy(tree, targets).tolist() == [0]
    targets = np.array([8, 0, 3, 0, 0, 0, 0])
    assert accept_greedy(tree, targets).tolist() == [0, 2, 6]
    assert accept_greedy(TokenTree.root_only(3), np.array([1])).tolist() == [0]


@settings(max_examples=200, deadline=None)
@given(tree=bfs_trees(max_width=5), seed=st.integers(0, 2**31 - 1))
def test_lazy_greedy_walk_matches_the_eager_one_and_asks_only_the_path(tree, seed):
    # targets drawn from the tokens in play, so that long accepted paths are common
    rng = np.random.default_rng(seed)
    targets = rng.choice(np.unique(tree.tokens), size=tree.size)
    asked = []
    path, bonus = accept_greedy_lazily(tree, lambda node: asked.append(node) or targets[node])
    assert path.tolist() == accept_greedy(tree, targets).tolist()
    assert bonus == targets[path[-1]]
    assert asked == path.tolist()


def test_node_targets_and_top_candidates():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert node_targets(logits).tolist() == [1, 0]
    toks, probs = top_candidates(logits, 2)
    assert toks[0].tolist() == [1, 2] and toks[1].tolist() == [0, 2]
    full = torch.softmax(logits, -1)
    assert np.allclose(probs[0], full[0, [1, 2]].numpy())
    toks, _ = top_candidates(logits, 10)  # width larger than the vocabulary is clipped
    assert toks[0].shape == (3,)


def _filled_cache(config, length, num_layers, capacity=None):
    cache = DynamicCache(config=config)
    if capacity is not None:  # reserved full-attention layers, as decoding uses them
        cache.layers = [ReservedLayer(capacity) if type(layer) is DynamicLayer else layer
                        for layer in cache.layers]
    start_recording(cache)
    for i in range(num_layers):
        k = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1).expand(1, 1, length, 2).clone()
        cache.layers[i].update(k, k.clone())
    return cache


RESERVED = pytest.mark.parametrize("capacity", [None, 16], ids=["dynamic", "reserved"])


@RESERVED
def test_keep_accepted_selects_prefix_and_path(capacity):
    config = LlamaConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=1, num_key_value_heads=1,
                         intermediate_size=8, vocab_size=16)
    cache = _filled_cache(config, 10, 2, capacity)  # 6 cached + a pass of 4 new entries
    keep_accepted(cache, 4, torch.tensor([0, 2]))
    for layer in cache.layers:
        assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 8]
        assert layer.values.shape[-2] == 8
    assert cache.get_seq_length() == 8


@RESERVED
def test_keep_accepted_prefix_and_empty_keep_then_next_pass_appends_after_them(capacity):
    config = LlamaConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=1, num_key_value_heads=1,
                         intermediate_size=8, vocab_size=16)
    cache = _filled_cache(config, 10, 2, capacity)  # 6 cached + a pass of 4
    keep_accepted(cache, 4, torch.tensor([0, 1]))  # a prefix of the pass: a cut, nothing moves
    assert [layer.keys[0, 0, :, 0].tolist() for layer in cache.layers] == [[0, 1, 2, 3, 4, 5, 6, 7]] * 2
    new = torch.full((1, 1, 3, 2), 50.0)
    for layer in cache.layers:
        layer.update(new, new.clone())
    keep_accepted(cache, 3, torch.tensor([], dtype=torch.long))  # nothing of the pass is kept
    for layer in cache.layers:
        assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
        layer.update(new[:, :, :2] + 1, new[:, :, :2] + 2)
    keep_accepted(cache, 2, torch.tensor([1]))
    for layer in cache.layers:
        assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 51]
        assert layer.values[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 52]
    assert cache.get_seq_length() == 9


@RESERVED
def test_keep_accepted_trims_sliding_layers_to_window(capacity):
    config = Gemma3TextConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=1, num_key_value_heads=1,
                              intermediate_size=8, vocab_size=16, head_dim=2, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"])
    cache = _filled_cache(config, 9, 2, capacity)  # 5 committed + a pass of 4
    sliding, full = cache.layers
    keep_accepted(cache, 4, torch.tensor([0, 3]))
    assert sliding.cumulative_length == 7
    # the window keeps the last sliding_window - 1 = 3 committed entries: positions 4, 5 (node 0), 8 (node 3)
    assert sliding.keys[0, 0, :, 0].tolist() == [4, 5, 8]
    assert full.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 8]


def test_reserved_layer_writes_in_place_grows_when_full_and_adopts_replaced_tensors():
    layer = ReservedLayer(capacity=8)
    rows = lambda a, b: torch.arange(a, b, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 2, -1, 3).clone()  # noqa: E731
    keys, values = layer.update(rows(0, 5), rows(0, 5) + 100)
    buffer = layer.keys.data_ptr()
    assert keys.shape == (1, 2, 5, 3) and layer.get_seq_length() == 5
    layer.update(rows(5, 8), rows(5, 8) + 100)  # fills the buffer exactly: no new allocation
    assert layer.keys.data_ptr() == buffer and layer.capacity == 8
    cache = DynamicCache()
    cache.layers = [layer]
    keep_accepted(cache, 3, torch.tensor([2]))  # keep entry 7 only: [0..4, 7]
    assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 7] and layer.keys.data_ptr() == buffer
    layer.update(rows(20, 25), rows(20, 25) + 100)  # 6 + 5 > 8: moves to a larger buffer once
    assert layer.capacity == 8 + GROW_TOKENS
    assert layer.keys[0, 1, :, 0].tolist() == [0, 1, 2, 3, 4, 7, 20, 21, 22, 23, 24]
    assert layer.values[0, 1, :, 2].tolist() == [100, 101, 102, 103, 104, 107, 120, 121, 122, 123, 124]
    grown = layer.keys.data_ptr()
    layer.update(rows(30, 31), rows(30, 31))
    assert layer.keys.data_ptr() == grown
    layer.keys, layer.values = layer.keys[:, :, :4].clone(), layer.values[:, :, :4].clone()  # replaced from outside
    layer.update(rows(40, 41), rows(40, 41))
    assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 40]


def test_decoding_cache_is_reserved_and_never_reallocated():
    """A whole generation writes into the buffers reserved at the prompt: same storage at the end."""
    model = _tiny_llama("sdpa")
    model.generation_config.eos_token_id = None
    cache = new_cache(model, capacity=64)
    assert all(isinstance(layer, ReservedLayer) for layer in cache.layers)
    ids = torch.randint(1, 15, (1, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, cache=cache, use_cache=True)
    first = [layer.keys.data_ptr() for layer in cache.layers]
    for i in range(40):
        model(input_ids=ids[:, i % 12 : i % 12 + 1], cache=cache, use_cache=True)
    assert [layer.keys.data_ptr() for layer in cache.layers] == first
    assert cache.get_seq_length() == 52


def _tiny_llama(attn: str):
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=16, max_position_embeddings=256,
                         attn_implementation=attn, bos_token_id=0, eos_token_id=15, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def _tiny_gemma(attn: str):
    torch.manual_seed(0)
    config = Gemma3TextConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=16, intermediate_size=64, vocab_size=16, sliding_window=8,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              max_position_embeddings=256, attn_implementation=attn,
                              bos_token_id=2, eos_token_id=1, pad_token_id=0)
    return Gemma3ForCausalLM(config).eval()


@pytest.mark.parametrize("make", [_tiny_llama, _tiny_gemma], ids=["llama", "gemma3-sliding"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_passes_match_generate_on_tiny_models(make, attn):
    """Random weights, so the masks propose noise: this checks the mechanics (mask layout, both
    attention formats, sliding windows crossed many times, cache rollback), not acceptance."""
    model = make(attn)
    model.generation_config.eos_token_id = None
    decoder = ProbeDecoder(model, drafter="esp", num_masks=2, budget=24, mask_update=0.1)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, 15, (1, 5 + 7 * seed), generator=g)
        ref = model.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=None)
        out = decoder.generate(ids, max_new_tokens=40)
        assert torch.equal(out, ref)
        # an oracle drafter: blocks of up to 10 tokens accepted, window crossed mid-block
        continuation = ref[0, ids.shape[1] :].tolist()
        for limit in (1, 3, 17, 40):
            res = decoder.generate(ids, max_new_tokens=limit, drafter=OracleDrafter(continuation, ids.shape[1]),
                                   return_dict_in_generate=True)
            assert torch.equal(res.sequences, ref[:, : ids.shape[1] + limit])
            if limit == 40:
                assert res.stats.mean_accepted_length > 5
        # EOS inside an accepted block: stop right after it
        eos = continuation[12]
        ref_eos = model.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=eos)
        res = decoder.generate(ids, max_new_tokens=40, eos_token_id=eos, drafter=OracleDrafter(continuation, ids.shape[1]))
        assert torch.equal(res, ref_eos)
        assert res[0, -1].item() == eos


def test_heap_trimmer_runs_on_the_cpu_and_is_skipped_elsewhere():
    trim = heap_trimmer(torch.device("cpu"), every=3)
    if trim is not None:  # glibc: malloc_trim returns 0 or 1, on every third call only
        results = [trim() for _ in range(6)]
        assert results[0] is None and results[1] is None and results[3] is None and results[4] is None
        assert results[2] in (0, 1) and results[5] in (0, 1)
    assert heap_trimmer(torch.device("meta")) is None
    with pytest.raises(ValueError, match="every"):
        heap_trimmer(torch.device("cpu"), every=0)


@pytest.mark.parametrize("make", [_tiny_llama, _tiny_gemma], ids=["llama", "gemma3-sliding"])
def test_cost_curve_is_measured_at_a_context_beyond_the_sliding_window(make):
    model = make("sdpa")
    curve = measure_cost_curve(model, sizes=(1, 2, 4), context=16, rounds=1, long_context=64)  # window: 8
    assert curve.long_context == 64 and len(curve.long_seconds) == 3
    assert curve.cost(4, 200) > 0 and curve.head_rows is None
    # with the split head: the output layer timed alone, the passes run with it padded
    head = SplitHead(model)
    assert head.usable
    timed = measure_cost_curve(model, sizes=(1, 2, 4), context=16, rounds=1, long_context=64, head=head, head_rows=(1, 3, 8))
    assert timed.head_rows == (1, 3, 8) and all(s > 0 for s in timed.head_seconds) and timed.cost(4, 200) > 0
    # no room for a long context within the model's positions: one row
    assert measure_cost_curve(model, sizes=(1, 2), context=130, rounds=1, long_context=1024).long_seconds is None
