"""The decoding step's stages one at a time, on a tiny random model: each does its one job."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MaxLengthCriteria, StoppingCriteriaList

from probe_mtp import ProbeConfig, ProbeDecoder
from probe_mtp.drafters import Drafter
from probe_mtp.request import DecodeRequest
from probe_mtp.step import commit, decode_step, feed_back, lay_out, node_tops, prefill, propose, verify_pass
from probe_mtp.tree import TokenTree


class ChainDrafter(Drafter):
    """Proposes a fixed chain after every root (and records what it was told)."""

    name = "chain"

    def __init__(self, chain: list[int]):
        super().__init__(budget=len(chain) + 1)
        self.chain = chain
        self.seen = []

    def propose(self, root_token, context):
        return TokenTree.from_paths(root_token, [self.chain])

    def observe(self, feedback):
        self.seen.append(feedback)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=16, max_position_embeddings=256,
                         attn_implementation="sdpa", bos_token_id=0, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def _generation(model, drafter, max_new=12, **knobs):
    decoder = ProbeDecoder(model, budget=drafter.budget, drafter="pld", **knobs)
    prompt = torch.tensor([[1, 4, 6, 4, 6]])
    request = DecodeRequest(prompt=prompt, max_length=prompt.shape[1] + max_new, processors=None,
                            criteria=StoppingCriteriaList(), do_sample=False, config=decoder.config, drafter=drafter)
    return decoder.start(request)


@torch.no_grad()
def test_each_stage_on_its_own(model):
    ref = model.generate(torch.tensor([[1, 4, 6, 4, 6]]), do_sample=False, max_new_tokens=12)[0, 5:].tolist()
    drafter = ChainDrafter([ref[1], ref[2], 3])  # the first two drafts are right, the third is not
    gen, _ = _generation(model, drafter)
    prefill(gen)
    assert gen.length == 6 and gen.cached == 5 and gen.cache.get_seq_length() == 5
    assert drafter.seen[-1].is_prefill and drafter.seen[-1].new_tokens.tolist() == [ref[0]]

    tree = propose(gen)
    assert tree.tokens.tolist() == [ref[0], ref[1], ref[2], 3]
    plan = gen.policy.plan(tree, gen.cached)
    assert plan.tree is tree and plan.num_masks == 0  # a fixed budget keeps the drafter's tree
    layout, inputs = lay_out(gen, plan)
    assert inputs.inputs_embeds.shape[:2] == (1, 4)
    assert inputs.position_ids.tolist() == [[5, 6, 7, 8]]  # depth-based, from the root's position
    logits = verify_pass(gen, tree, layout, inputs)
    assert logits.nodes.shape == (4, 16) and gen.cache.get_seq_length() == 9
    assert gen.stats.forward_passes == 2 and gen.stats.inputs_per_pass == [4]
    assert node_tops(gen, logits.nodes) is None  # this drafter reads no top tokens
    verdict = gen.accept(tree, logits.nodes, gen.context)
    assert verdict.path.tolist() == [0, 1, 2] and verdict.tokens.tolist() == ref[1:4]


def test_decode_step_keeps_the_accepted_path_in_the_cache(model):
    ref = model.generate(torch.tensor([[1, 4, 6, 4, 6]]), do_sample=False, max_new_tokens=12)[0, 5:].tolist()
    drafter = ChainDrafter([ref[1], ref[2], 3])
    gen, _ = _generation(model, drafter)
    with torch.no_grad():
        prefill(gen)
        decode_step(gen)
    assert gen.context[5:].tolist() == ref[:4]
    assert gen.stats.accepted_lengths == [3]
    assert gen.cache.get_seq_length() == gen.cached == 8
    assert drafter.seen[-1].accepted.tolist() == [0, 1, 2]


def test_commit_stops_at_a_criterion_inside_a_block(model):
    gen, _ = _generation(model, ChainDrafter([2]))
    gen.request.criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=8)])
    assert commit(gen, np.array([9, 8, 7, 6]), None) == 3
    assert gen.done and gen.context.tolist() == [1, 4, 6, 4, 6, 9, 8, 7]


def test_commit_stops_at_the_length_limit(model):
    gen, _ = _generation(model, ChainDrafter([2]), max_new=2)
    assert commit(gen, np.array([9, 8, 7]), None) == 2 and gen.done


def test_feed_back_updates_the_masks_until_done(model):
    gen, _ = _generation(model, ChainDrafter([2]))
    gen.masks = type("Masks", (), {"updates": [], "update": lambda self, e: self.updates.append(e.shape)})()
    verdict = type("Verdict", (), {"path": np.array([0]), "tokens": np.array([3, 4])})()
    feed_back(gen, TokenTree.root_only(6), verdict, torch.zeros(1, 16), None)
    assert gen.masks.updates == [(2, 32)]
    gen.done = True
    feed_back(gen, TokenTree.root_only(6), verdict, torch.zeros(1, 16), None)
    assert gen.masks.updates == [(2, 32)]


def test_the_lossless_step_knows_nothing_of_confadapt():
    import inspect

    import probe_mtp.step as step

    source = inspect.getsource(step)
    assert "pending" not in source and "confadapt" not in source.replace("probe_mtp.confadapt", "")
    assert ProbeConfig(drafter="esp", acceptance="confadapt").acceptance == "confadapt"
