"""Ready for an accelerator, checked without one.

- Device hygiene: decoding runs with torch's default device set to "meta" while the model and its
  inputs stay on the CPU.  A tensor made without an explicit device then has no data, so a place
  that forgets the model's device fails or changes the tokens.  Every decoding path must stay
  identical to ``model.generate`` (which runs unchanged under it).
- Host synchronisations: the calls that make the host wait for the device (``item``, ``tolist``,
  ``cpu``, ``numpy``, ``bool`` / ``int`` / ``float`` / ``index`` of a tensor) made by probe_mtp's
  code are counted per decoding step and must stay within budget, whatever tau.

Tiny random models of several architectures here; SmolLM2 in tests/models/test_device_on_models.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

import probe_mtp
from probe_mtp import ProbeDecoder
from probe_mtp.device_audit import HostSyncCounter, meta_default_device
from probe_mtp.request import check_generator_device

from oracle import OracleDrafter

H, VOCAB = 32, 64
STD = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
           vocab_size=VOCAB, max_position_embeddings=256)
ARCHS = {
    "llama": ("LlamaConfig", STD),
    "qwen2": ("Qwen2Config", STD),
    "gemma3-sliding": ("Gemma3TextConfig", dict(STD, head_dim=8, sliding_window=8,
                                                layer_types=["sliding_attention", "full_attention"])),
    "gpt2": ("GPT2Config", dict(n_embd=H, n_layer=2, n_head=4, n_positions=256, vocab_size=VOCAB)),
}
CURVE = {1: 1.0, 4: 1.1, 16: 1.3, 64: 2.0}
NEW = 40
# at most this many host synchronisations per decoding step (issue 42)
SYNC_BUDGET = 3


def build(name: str):
    config_class, kwargs = ARCHS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(pad_token_id=0, bos_token_id=None, eos_token_id=None, **kwargs)
    if hasattr(config, "initializer_range"):
        config.initializer_range = 0.3  # a context-dependent next token, so that trees are rejected too
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request):
    return build(request.param)


@pytest.fixture(scope="module")
def llama():
    return build("llama")


def prompt(seed: int = 0, length: int = 12) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    base = torch.randint(3, VOCAB, (1, length // 2), generator=g, device="cpu")
    return torch.cat([base, base], dim=1)  # a repeat for the context drafters


def reference(model, ids, **kwargs):
    return model.generate(ids, do_sample=False, max_new_tokens=NEW, **kwargs)


def on_meta(fn, *args, **kwargs):
    with meta_default_device():
        return fn(*args, **kwargs)


def test_meta_default_device_leaves_nothing_behind():
    before = torch.get_default_device()
    with meta_default_device():
        assert torch.empty(1).device.type == "meta"
    assert torch.get_default_device() == before


def test_default_decoder_under_meta_is_generate(tiny):
    """The default decoder (hybrid, budget="auto" with its cost curve measured under meta too)."""
    ids = prompt()
    decoder = ProbeDecoder(tiny, cost_cache=False)
    out = on_meta(decoder.generate, ids, max_new_tokens=NEW)
    assert torch.equal(out, reference(tiny, ids))


@pytest.mark.parametrize("drafter", probe_mtp.drafters.drafter_names())
def test_every_drafter_under_meta_is_generate(tiny, drafter):
    ids = prompt(1)
    out = on_meta(probe_mtp.generate, tiny, ids, max_new_tokens=NEW, drafter=drafter, cost_curve=CURVE,
                  decoder=ProbeDecoder(tiny, memory=False))
    assert torch.equal(out, reference(tiny, ids))


def test_oracle_blocks_under_meta_are_generate(tiny):
    """Long accepted blocks: cache rollback past sliding windows, stops inside a block."""
    ids = prompt(2)
    ref = reference(tiny, ids)
    continuation = ref[0, ids.shape[1]:].tolist()
    res = on_meta(probe_mtp.generate, tiny, ids, max_new_tokens=NEW, return_dict_in_generate=True,
                  drafter=OracleDrafter(continuation, ids.shape[1], budget=16), decoder=ProbeDecoder(tiny, memory=False))
    assert torch.equal(res.sequences, ref)
    assert res.stats.mean_accepted_length > 4
    eos = continuation[9]
    ref_eos = reference(tiny, ids, eos_token_id=eos)
    out = on_meta(probe_mtp.generate, tiny, ids, max_new_tokens=NEW, eos_token_id=eos,
                  drafter=OracleDrafter(continuation, ids.shape[1], budget=16), decoder=ProbeDecoder(tiny, memory=False))
    assert torch.equal(out, ref_eos)


def test_padded_batch_with_scores_under_meta_is_generate(tiny):
    a, b = prompt(3, 12), prompt(4, 8)
    ids = torch.cat([a, torch.cat([torch.zeros((1, 4), dtype=torch.long), b], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=24, return_dict_in_generate=True, output_scores=True,
                  do_sample=False)
    ref = tiny.generate(ids, **kwargs)
    res = on_meta(probe_mtp.generate, tiny, ids, cost_curve=CURVE, decoder=ProbeDecoder(tiny, memory=False), **kwargs)
    assert torch.equal(res.sequences, ref.sequences)
    assert len(res.scores) == len(ref.scores)
    for mine, theirs in zip(res.scores, ref.scores):
        assert mine.device.type == "cpu"
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_num_return_sequences_under_meta_matches_cpu_run(llama):
    """Sampled (greedy refuses several sequences): the same seed, with and without meta."""
    ids = prompt(5)
    kwargs = dict(max_new_tokens=16, num_return_sequences=3, do_sample=True, budget=12)
    plain = probe_mtp.generate(llama, ids, generator=torch.Generator(device="cpu").manual_seed(3),
                               decoder=ProbeDecoder(llama, memory=False), **kwargs)
    meta = on_meta(probe_mtp.generate, llama, ids, generator=torch.Generator(device="cpu").manual_seed(3),
                   decoder=ProbeDecoder(llama, memory=False), **kwargs)
    assert plain.shape == (3, ids.shape[1] + 16)
    assert torch.equal(plain, meta)


def test_seeded_sampling_under_meta_matches_cpu_run(llama):
    """Sampling: the same seeded generator gives the same tokens under meta as without it."""
    ids = prompt(6)
    # a fixed budget: the adaptive one sizes trees from timings, and the draws follow the tree
    kwargs = dict(max_new_tokens=24, do_sample=True, temperature=0.8, top_k=20, budget=12)
    plain = probe_mtp.generate(llama, ids, generator=torch.Generator(device="cpu").manual_seed(7),
                               decoder=ProbeDecoder(llama, memory=False), **kwargs)
    meta = on_meta(probe_mtp.generate, llama, ids, generator=torch.Generator(device="cpu").manual_seed(7),
                   decoder=ProbeDecoder(llama, memory=False), **kwargs)
    assert torch.equal(plain, meta)
    for rule in ("match", "rejection"):
        on_meta(probe_mtp.generate, llama, ids, generator=torch.Generator(device="cpu").manual_seed(7),
                drafter="esp", sampling_rule=rule, decoder=ProbeDecoder(llama, memory=False), **kwargs)


def test_custom_generate_path_under_meta_is_generate(llama):
    ids = prompt(8)
    out = on_meta(llama.generate, ids, custom_generate=probe_mtp.custom_generate, max_new_tokens=NEW,
                  do_sample=False, cost_curve=CURVE)
    assert torch.equal(out, reference(llama, ids))


def test_confadapt_under_meta_matches_cpu_run(llama):
    ids = prompt(9)
    kwargs = dict(max_new_tokens=NEW, acceptance="confadapt", drafter="esp", num_masks=2, budget=12, threshold=0.2)
    plain = probe_mtp.generate(llama, ids, decoder=ProbeDecoder(llama, memory=False), **kwargs)
    meta = on_meta(probe_mtp.generate, llama, ids, decoder=ProbeDecoder(llama, memory=False), **kwargs)
    assert torch.equal(plain, meta)


def test_warm_decoder_with_saved_memory_under_meta_is_generate(llama, tmp_path):
    warm = ProbeDecoder(llama, cost_curve=CURVE)
    for seed in range(3):
        warm.generate(prompt(10 + seed), max_new_tokens=NEW)
    path = warm.save_memory(tmp_path / "memory.safetensors")
    ids = prompt(10)
    restored = on_meta(ProbeDecoder, llama, memory=path, cost_curve=CURVE)
    out = on_meta(restored.generate, ids, max_new_tokens=NEW)
    assert torch.equal(out, reference(llama, ids))


def test_generator_on_another_device_is_refused(llama):
    """Checked up front (a CPU generator cannot draw on a GPU's tensors, deep inside torch)."""
    with pytest.raises(ValueError, match=r"generator is on cpu but the model is on cuda.*torch.Generator\(device='cuda'\)"):
        check_generator_device(torch.Generator(device="cpu"), torch.device("cuda"))
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        probe_mtp.generate(llama, prompt(), max_new_tokens=4, do_sample=True, generator=7)
    check_generator_device(torch.Generator(device="cpu"), torch.device("cpu"))
    check_generator_device(None, torch.device("cuda"))


# ---------------------------------------------------------------------------------- host syncs
def count(model, ids, **kwargs):
    with HostSyncCounter() as syncs:
        res = probe_mtp.generate(model, ids, return_dict_in_generate=True, **kwargs)
    return syncs.total, res


def per_step(model, ids, **kwargs) -> tuple[float, object]:
    """Host synchronisations per decoding step and the result: the syncs of the whole generation
    less those of the request's set-up and prefill alone (the same call for one new token), over
    the steps after the prefill."""
    total, res = count(model, ids, **kwargs)
    setup, _ = count(model, ids, **dict(kwargs, max_new_tokens=1))
    steps = res.stats.forward_passes - 1
    assert steps >= 3
    return (total - setup) / steps, res


def test_default_decoder_stays_within_the_sync_budget(tiny):
    ids = prompt(11)
    rate, res = per_step(tiny, ids, max_new_tokens=NEW, cost_curve=CURVE, decoder=ProbeDecoder(tiny, memory=False))
    assert torch.equal(res.sequences, reference(tiny, ids))
    assert rate <= SYNC_BUDGET, rate


class ReadingOracle(OracleDrafter):
    """The oracle, reading every node's top tokens as the default drafter does (so the greedy walk
    reads its targets from them, not from the device node by node)."""

    node_top_k = 4


def test_long_accepted_blocks_stay_within_the_sync_budget(llama):
    """Whatever tau: an oracle drafter accepts blocks of 8+ tokens, with an EOS criterion."""
    ids = prompt(12)
    continuation = reference(llama, ids)[0, ids.shape[1]:].tolist()
    rate, res = per_step(llama, ids, max_new_tokens=NEW, eos_token_id=VOCAB - 1,
                         drafter=ReadingOracle(continuation, ids.shape[1], budget=16),
                         decoder=ProbeDecoder(llama, memory=False))
    assert res.stats.mean_accepted_length > 4
    assert rate <= SYNC_BUDGET, rate


class NeverStop(StoppingCriteria):
    """A criterion of the user's own: run on the device, read back once per step."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def test_a_users_stopping_criterion_is_read_once_per_step(llama):
    ids = prompt(13)
    continuation = reference(llama, ids)[0, ids.shape[1]:].tolist()
    rate, res = per_step(llama, ids, max_new_tokens=NEW, stopping_criteria=StoppingCriteriaList([NeverStop()]),
                         drafter=ReadingOracle(continuation, ids.shape[1], budget=16),
                         decoder=ProbeDecoder(llama, memory=False))
    assert res.stats.mean_accepted_length > 4
    assert rate <= SYNC_BUDGET, rate


def test_a_batch_stays_within_the_sync_budget(tiny):
    ids = torch.cat([prompt(s) for s in range(14, 18)])
    rate, res = per_step(tiny, ids, max_new_tokens=24, cost_curve=CURVE, decoder=ProbeDecoder(tiny, memory=False))
    assert torch.equal(res.sequences, tiny.generate(ids, do_sample=False, max_new_tokens=24))
    assert rate <= SYNC_BUDGET, rate


def test_the_counter_sees_a_sync_and_charges_its_line():
    x = torch.ones(3)
    with HostSyncCounter(package=__file__.rsplit("/", 1)[0]) as syncs:
        float(x.sum())
        x.cpu().numpy()  # one wait, not two
        x.tolist()
    assert syncs.total == 3
    assert all(site.endswith(tuple(f"test_device_hygiene.py:{n}" for n in range(1000))) for site in syncs.sites)
    with HostSyncCounter(package=__file__.rsplit("/", 1)[0], chained=True) as every:
        x.cpu().numpy()
    assert every.total == 2


# ---------------------------------------------------------------------------------- a static guard
CONSTRUCTORS = {"tensor", "as_tensor", "arange", "zeros", "ones", "empty", "full", "eye", "linspace", "rand", "randn",
                "randint", "randperm"}


def test_every_tensor_constructor_in_the_package_names_its_device():
    """A ``torch.zeros(...)`` without ``device=`` lands on torch's default device, which need not
    be the model's: every constructor call in probe_mtp names one (the meta-device runs above find
    the ones a test reaches; this finds the rest)."""
    import ast
    from pathlib import Path

    root = Path(probe_mtp.__file__).parent
    files = list(root.rglob("*.py")) + list((root.parent / "tree").rglob("*.py"))
    missing = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CONSTRUCTORS
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and not any(k.arg == "device" for k in node.keywords)):
                missing.append(f"{path.relative_to(root.parent)}:{node.lineno} torch.{node.func.attr}")
    assert not missing, "tensors made without a device:\n" + "\n".join(missing)


def test_reduced_precision_warns_once_per_decoder(llama):
    """fp16 / bf16 with stock kernels: outputs can differ at near-ties, said once, with the way out."""
    import copy
    import warnings

    from probe_mtp.decoder import InexactPrecisionWarning

    half = copy.deepcopy(llama).to(torch.float16)
    decoder = ProbeDecoder(half, memory=False, cost_curve=CURVE)
    with pytest.warns(InexactPrecisionWarning, match=r"float16 .*near-ties.*float32"):
        decoder.generate(prompt(), max_new_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InexactPrecisionWarning)
        decoder.generate(prompt(1), max_new_tokens=4)  # said once
        ProbeDecoder(llama, memory=False, cost_curve=CURVE).generate(prompt(), max_new_tokens=4)  # float32: exact


# ---------------------------------------------------------------------------------- sampling at once
def random_tree(rng: np.random.Generator, vocab: int):
    """A tree of 1-20 nodes over a small vocabulary (children of one parent carry distinct tokens)."""
    from probe_mtp.tree import TokenTree

    paths = [rng.integers(0, vocab, size=rng.integers(1, 5)).tolist() for _ in range(rng.integers(1, 6))]
    return TokenTree.from_paths(int(rng.integers(0, vocab)), paths)


def test_sampling_at_once_draws_what_the_walk_draws():
    """The accelerator's rule (every node's draw up front, one read) and the CPU's (a draw when the
    walk arrives) give the same path, the same bonus, and leave the generator in the same state,
    with a user's generator and with torch's default one."""
    from probe_mtp.verify import accept_sample_and_match, accept_sample_and_match_at_once

    rng = np.random.default_rng(0)
    vocab = 6  # few tokens, so that walks go deep
    for case in range(200):
        tree = random_tree(rng, vocab)
        probs = torch.softmax(torch.from_numpy(rng.normal(size=(tree.size, vocab)) * 2), dim=-1).float()
        seed = int(rng.integers(1 << 30))
        one, two = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        path_a, bonus_a = accept_sample_and_match(tree, probs, one)
        path_b, bonus_b = accept_sample_and_match_at_once(tree, probs, two)
        assert path_a.tolist() == path_b.tolist() and bonus_a == bonus_b, case
        assert torch.equal(torch.rand(4, generator=one), torch.rand(4, generator=two)), case
    tree = random_tree(np.random.default_rng(1), vocab)
    probs = torch.full((tree.size, vocab), 1.0 / vocab)
    torch.manual_seed(5)
    a = accept_sample_and_match(tree, probs, None)
    after_a = torch.rand(2)
    torch.manual_seed(5)
    with HostSyncCounter() as syncs:
        b = accept_sample_and_match_at_once(tree, probs, None)
    after_b = torch.rand(2)
    assert a[0].tolist() == b[0].tolist() and a[1] == b[1] and torch.equal(after_a, after_b)
    assert syncs.total == 1  # every draw read back at once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_prepared_model_under_meta_is_its_own_generate(dtype):
    """optimize's kernels (float32 packed once by MKL, bf16 for oneDNN) make every tensor they need on
    the inputs' device: under a meta default device a product writing into a tensor made without one
    would have no memory to write to."""
    model = probe_mtp.optimize(build("llama").to(dtype), dtype, require_matrix_units=False)
    ids = prompt(3)
    expected = reference(model, ids)
    out = on_meta(probe_mtp.generate, model, ids, max_new_tokens=NEW, cost_curve=CURVE)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("kernel", ["mkl", "onednn"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_model_packed_for_wide_passes_under_meta_is_generate(name, kernel):
    """pack_wide's layers (MKL or oneDNN for two rows or more, the stock product for one) make the
    tensors they need on the inputs' device: under a meta default device decoding gives the stock
    model's tokens (a tiny random model, whose logits are far from ties at float32 rounding)."""
    model = build(name)
    ids = prompt(3)
    expected = reference(model, ids)
    reason = probe_mtp.wide.why_not_pack_wide(model, kernel)
    if reason is not None:
        pytest.skip(reason)
    probe_mtp.pack_wide(model, kernel)
    with meta_default_device():  # packed again there: the copy is made on the weight's device
        model.lm_head._wide_pack = None
        out = probe_mtp.generate(model, ids, max_new_tokens=NEW, cost_curve=CURVE)
    assert torch.equal(out, expected)
