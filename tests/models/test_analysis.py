"""The alignment analysis (probe_mtp.analysis) on SmolLM2: the measurement against an independent
reference, its invariants, the table, and the study driver (the summaries on synthetic data are in
tests/unit/test_analysis_summaries.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe_mtp import ProbeConfig, generate
from probe_mtp.analysis import (
    TABLE_DTYPE,
    AlignmentTable,
    align_masks,
    mask_init_settings,
    run_alignment_study,
)
from probe_mtp.analysis.alignment import owner_mask_vectors
from probe_mtp.masks import initial_mask_vectors

from conftest import chat_ids

NEW_TOKENS = 20
K = 3


@pytest.fixture(scope="module")
def greedy_case(smollm2, specbench):
    """A translation prompt (the task where SmolLM2's masks hit most) and its greedy continuation."""
    model, tok = smollm2
    prompt = next(p for p in specbench if p.task == "translation")
    ids = chat_ids(tok, prompt.turns[0])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS)
    return ids, out[0, ids.shape[1] :]


@pytest.fixture(scope="module")
def ema_alignment(smollm2, greedy_case):
    model, _ = smollm2
    ids, cont = greedy_case
    return align_masks(model, ids, cont, ProbeConfig(mask_update=0.1), num_masks=K)


def test_shapes_ranges_and_invariants(smollm2, greedy_case, ema_alignment):
    model, _ = smollm2
    ids, cont = greedy_case
    a = ema_alignment
    n = cont.shape[0]
    layers = model.config.num_hidden_layers + 1
    assert a.cosine.shape == (n, K, layers) and a.rank.shape == (n, K)
    assert a.owner_positions.tolist() == list(range(ids.shape[1] - 1, ids.shape[1] - 1 + n))
    assert a.greedy_mismatches == 0  # the chain nodes reproduce the greedy continuation
    i, j = np.meshgrid(np.arange(n), np.arange(1, K + 1), indexing="ij")
    assert (a.valid == (i + j <= n - 1)).all()
    cos = a.cosine[a.valid]
    assert np.isfinite(cos).all() and (cos >= -1 - 1e-6).all() and (cos <= 1 + 1e-6).all()
    control = a.control[a.valid]
    assert np.isfinite(control).all() and (np.abs(control) <= 1 + 1e-6).all()
    assert np.isnan(a.cosine[~a.valid]).all() and (a.rank[~a.valid] == -1).all()
    # targets are the continuation's tokens x_{q+j+1}
    assert (a.target[a.valid] == cont.numpy()[(i + j)[a.valid]]).all()
    # rank 0 iff the mask's top-1 is the target; accepted is the chain of top-1 hits
    assert ((a.rank == 0) == (a.proposal == a.target))[a.valid].all()
    assert (a.top1 == (a.valid & (a.rank == 0))).all()
    assert (a.accepted[:, 0] == a.top1[:, 0]).all()
    assert (a.accepted[:, 1:] == (a.accepted[:, :-1] & a.top1[:, 1:])).all()
    assert a.top1.any() and (~a.top1[a.valid]).any()  # both outcomes occur on this prompt


def test_matches_a_plain_causal_reference(smollm2, greedy_case, ema_alignment):
    """Mask j of owner q reproduced by an ordinary causal pass over [x_0..x_q, m_1..m_j] (masks as
    input embeddings, default positions), the true token's hidden state by a causal pass over the
    greedy sequence; cosine per layer and rank must agree with align_masks."""
    model, _ = smollm2
    ids, cont = greedy_case
    embed = model.get_input_embeddings()
    seq = torch.cat([ids[0], cont])
    p = ids.shape[1]
    with torch.no_grad():
        true_hidden = torch.stack(model(input_ids=seq[None], output_hidden_states=True).hidden_states)[:, 0]
        for step in (0, 5, 11):
            q = p - 1 + step
            masks = initial_mask_vectors("prompt_mean", embed, ids[0], K, 0.1)
            for tok in cont[:step]:  # the EMA after x_P .. x_q
                masks.update(embed(tok[None]))
            inputs = torch.cat([embed(seq[: q + 1]), masks.vectors])[None]
            out = model(inputs_embeds=inputs, output_hidden_states=True)
            for j in range(1, K + 1):
                h_mask = torch.stack(out.hidden_states)[:, 0, q + j]
                ref_cos = torch.nn.functional.cosine_similarity(h_mask.double(), true_hidden[:, q + j].double(), dim=-1)
                assert np.allclose(ema_alignment.cosine[step, j - 1], ref_cos.numpy(), atol=2e-4)
                others = [pos for pos in range(p - 1, seq.shape[0] - 1) if pos != q + j]
                ref_control = torch.stack(
                    [torch.nn.functional.cosine_similarity(h_mask.double(), true_hidden[:, pos].double(), dim=-1) for pos in others]
                ).mean(0)
                assert np.allclose(ema_alignment.control[step, j - 1], ref_control.numpy(), atol=2e-4)
                logits = out.logits[0, q + j]
                target = int(seq[q + j + 1])
                assert ema_alignment.target[step, j - 1] == target
                assert ema_alignment.rank[step, j - 1] == int((logits > logits[target]).sum())


def test_a_mask_equal_to_the_true_token_aligns_perfectly(smollm2, greedy_case):
    """Frozen masks set to the embedding of x_P: mask 1 of the prefill's owner then *is* the true
    token at its position, so its hidden state equals the true one at every layer (cosine 1) and
    it proposes the greedy token."""
    model, _ = smollm2
    ids, cont = greedy_case
    token = int(cont[0])
    a = align_masks(model, ids, cont, ProbeConfig(mask_init="token", mask_token=token, mask_update=0.0), num_masks=K)
    assert np.allclose(a.cosine[0, 0], 1.0, atol=1e-4)
    assert a.rank[0, 0] == 0 and a.accepted[0, 0]
    # every other owner whose next token is also x_P aligns perfectly too; the others do not
    same = np.flatnonzero(cont.numpy()[:-1] == token)
    assert np.allclose(a.cosine[same, 0, -1], 1.0, atol=1e-4)
    others = np.setdiff1d(np.arange(cont.shape[0] - 1), same)
    assert (a.cosine[others, 0, -1] < 0.999).all()


def test_bad_inputs_raise_clear_errors(smollm2, greedy_case):
    model, _ = smollm2
    ids, cont = greedy_case
    with pytest.raises(ValueError, match="num_masks"):
        align_masks(model, ids, cont, num_masks=0)
    with pytest.raises(ValueError, match="at least 2"):
        align_masks(model, ids, cont[:1])
    with pytest.raises(TypeError, match="torch.Tensor"):
        align_masks(model, ids.tolist(), cont)
    with pytest.raises(ValueError, match="1D"):
        align_masks(model, ids.expand(2, -1), cont)


def test_table_rows_and_selection(ema_alignment):
    a = ema_alignment
    t = AlignmentTable.from_alignment(a, init="ema", task="translation", prompt=7)
    layers = a.num_layers
    assert len(t) == a.valid.sum() * layers and t.records.dtype == TABLE_DTYPE
    assert t.last_layer == layers - 1
    last = t.select(layer=t.last_layer)
    assert len(last) == a.valid.sum()
    assert np.allclose(np.sort(last.select(mask=1)["cosine"]), np.sort(a.cosine[a.valid[:, 0], 0, -1]))
    assert (t["position"] == t["step"] + (a.owner_positions[0]) + t["mask"]).all()
    assert len(t.select(mask=[1, 2])) + len(t.select(mask=3)) == len(t)
    assert (t.select(rank=lambda r: r < 5)["rank"] < 5).all()
    assert len(t.where(lambda r: r["top1"] & (r["mask"] == 1))) == a.top1[:, 0].sum() * layers
    with pytest.raises(KeyError, match="unknown column"):
        t.select(colour=1)
    both = AlignmentTable.concat([t, t])
    assert len(both) == 2 * len(t)
    with pytest.raises(TypeError):
        AlignmentTable(np.zeros(3))


def test_study_measures_tau_and_tables_every_setting(smollm2, greedy_case):
    model, tok = smollm2
    settings = mask_init_settings(token_id=int(tok.encode(" the")[0]))
    chosen = {name: settings[name] for name in ("prompt mean + EMA", "token")}
    text = "Translate German to English: Guten Morgen, wie geht es dir?"
    study = run_alignment_study(model, tok, [text], chosen, max_new_tokens=12, num_masks=2)
    assert set(study.table.unique("init")) == set(chosen)
    assert set(study.table.unique("mask")) == {1, 2}
    assert study.tau.shape == (2,)
    ids = chat_ids(tok, text)
    ref = generate(model, ids, config=chosen["token"], max_new_tokens=12, return_dict_in_generate=True)
    row = study.tau[study.tau["init"] == "token"][0]
    assert row["tau"] == pytest.approx(ref.stats.mean_accepted_length)
    assert study.pooled_tau("token") == pytest.approx(ref.stats.mean_accepted_length)
    with pytest.raises(KeyError):
        study.pooled_tau("nope")
    with pytest.raises(TypeError, match="Prompt objects or strings"):
        run_alignment_study(model, tok, [ids], chosen, max_new_tokens=4)


def test_every_mask_setting_runs_and_owner_vectors_follow_the_ema(smollm2, greedy_case):
    model, tok = smollm2
    ids, cont = greedy_case
    embed = model.get_input_embeddings()
    for label, config in mask_init_settings(token_id=int(tok.encode(" the")[0])).items():
        a = align_masks(model, ids, cont[:6], config, num_masks=2)
        assert a.cosine.shape[:2] == (6, 2) and np.isfinite(a.cosine[a.valid]).all(), label
        vectors = owner_mask_vectors(embed, ids[0], cont, 6, config, 2)
        frozen = config.mask_update == 0.0
        assert torch.equal(vectors[0], vectors[5]) == frozen, label
    ema = owner_mask_vectors(embed, ids[0], cont, 3, ProbeConfig(mask_update=0.5), 1)
    first = embed(ids[0]).double().mean(0)
    expected = 0.25 * first + 0.25 * embed(cont[0]).double() + 0.5 * embed(cont[1]).double()
    assert torch.allclose(ema[2, 0].double(), expected, atol=1e-5)
