"""The kernels of a prepared model (probe_mtp.kernels), on toy tensors: each place where a wide pass
could round differently from a one-token pass is shown row-invariant bit for bit, and the checks that
choose how rows reach a kernel are shown to catch a kernel that is not.  Both kernels of a linear
layer are covered: weights packed once for oneDNN and the stock product on the plain weight (what
an accelerator, a CPU without oneDNN for the dtype, or a moved layer computes with: on CUDA the same
checks decide at run time), in bf16 and float32; every tensor the kernels make is made on the
inputs' device (checked with torch's default device set to ``meta``)."""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from probe_mtp import kernels, mkl_gemm
from probe_mtp.kernels import (
    PLANS,
    PackedLinear,
    RowPlan,
    RowPlans,
    RowVarianceError,
    bucket_rows,
    choose_row_plan,
    describe_plans,
    exact_attention,
    math_settings,
    rows_agree,
    run_rows,
)

ONEDNN_BF16 = kernels.processor().onednn_bf16
PACKINGS = [pytest.param(True, id="packed"), pytest.param(False, id="stock")]
if not ONEDNN_BF16:
    PACKINGS = [pytest.param(False, id="stock")]
# float32 layers: stock everywhere, packed where oneDNN runs float32, packed per call width where
# this torch has MKL (what optimize takes for float32 there)
FLOAT32_PACKINGS = [pytest.param(kind, id=kind) for kind in (kernels.ONEDNN, kernels.MKL, kernels.STOCK)
                    if (kind != kernels.ONEDNN or kernels.processor().packs(torch.float32))
                    and (kind != kernels.MKL or mkl_gemm.available())]


class Module:
    """What transformers hands an attention function as ``module``."""

    is_causal = True
    training = False


def _bf16(*shape, seed=0, scale=1.0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cpu") * scale).to(dtype)


# ------------------------------------------------------------------------------- linear layers
# the hidden/intermediate shapes of SmolLM2 (576, 1536) and Gemma 3 270M (640, 2048), the down
# projections included: on an AMD EPYC their raw one-row product rounds differently from wider ones
SHAPES = [(1536, 576), (576, 1536), (192, 576), (640, 2048), (2048, 640), (37, 64)]


def _check_row_invariance(out_features, in_features, pack, dtype):
    layer = PackedLinear(_bf16(out_features, in_features, seed=1, scale=in_features**-0.5, dtype=dtype),
                         _bf16(out_features, seed=2, dtype=dtype), RowPlans(), pack=pack, dtype=dtype)
    expected_kind = pack if isinstance(pack, str) else kernels.ONEDNN if pack else kernels.STOCK
    assert layer.dtype == dtype and layer.kind == expected_kind
    x = _bf16(300, in_features, seed=3, dtype=dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    for width in (2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, 64, 65, 128, 300):
        assert torch.equal(layer(x[:width]), alone[:width]), f"width {width}"
    # a batch of rows shaped [B, N, H] is the same rows, and so is a row that starts off a 16-byte boundary
    assert torch.equal(layer(x[:24].reshape(3, 8, in_features)).reshape(24, -1), alone[:24])
    unaligned = torch.cat([x.new_zeros(1), x[1]])[1:]
    assert unaligned.data_ptr() % 16 and torch.equal(layer(unaligned[None]), alone[1:2])


@pytest.mark.parametrize("pack", PACKINGS)
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_linear_row_of_any_width_equals_the_one_row_product(out_features, in_features, pack):
    _check_row_invariance(out_features, in_features, pack, torch.bfloat16)


@pytest.mark.parametrize("pack", FLOAT32_PACKINGS)
@pytest.mark.parametrize("out_features,in_features", [(1536, 576), (576, 1536), (37, 64)])
def test_float32_linear_row_of_any_width_equals_the_one_row_product(out_features, in_features, pack):
    """The dtype is a parameter: float32 layers (MKL's stock product differs between widths here,
    so its plan differs; MKL's packed product is packed per call width) are checked and
    row-invariant the same way."""
    _check_row_invariance(out_features, in_features, pack, torch.float32)


@pytest.mark.skipif(not mkl_gemm.available(), reason="this torch has no MKL packed product")
def test_mkl_layer_packs_once_at_its_first_product_and_copies_and_moves_like_a_plain_one():
    weight, bias = _bf16(96, 64, seed=30, dtype=torch.float32), _bf16(96, seed=31, dtype=torch.float32)
    layer = PackedLinear(weight, bias, RowPlans(), pack=kernels.MKL, dtype=torch.float32)
    assert layer.kind == kernels.MKL and layer.plain.data_ptr() == weight.data_ptr() and layer.mkl_pack is None
    x = _bf16(40, 64, seed=32, dtype=torch.float32)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])  # the first product checks the plan
    packed = layer.mkl_pack
    assert packed is not None and packed.numel() > 0
    assert torch.allclose(alone, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer(x[:3]), alone[:3]) and torch.equal(layer(x), alone) and layer.mkl_pack is packed
    # a copy packs again where it lives (a packed buffer is valid only where MKL wrote it)
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert other.kind == kernels.MKL and torch.equal(other(x), alone)
        assert other.mkl_pack.data_ptr() != packed.data_ptr()
    assert set(layer.state_dict()) == {"weight", "bias"} and torch.equal(layer.state_dict()["weight"], weight)
    layer.load_state_dict({"weight": weight * 2, "bias": bias})
    assert torch.allclose(layer(x), F.linear(x, weight * 2, bias), rtol=1e-5, atol=1e-5)
    layer.to(torch.bfloat16)  # another dtype: a plain stock layer there
    assert layer.kind == kernels.STOCK and layer.mkl_pack is None
    with pytest.raises(ValueError, match="cannot compute as 'MKL'"):
        PackedLinear(weight, bias, RowPlans(), pack=kernels.MKL, dtype=torch.bfloat16)


@pytest.mark.skipif(not mkl_gemm.available(), reason="this torch has no MKL packed product")
@pytest.mark.parametrize("rows", [0, 1, 2, 7, 64, 65])
def test_mkl_packed_product_matches_the_stock_one(rows):
    """One copy packed for PACK_ROWS rows multiplies any row count (MKL's format checked by value)."""
    weight, bias = _bf16(130, 70, seed=33, dtype=torch.float32), _bf16(130, seed=34, dtype=torch.float32)
    x = _bf16(rows, 70, seed=35, dtype=torch.float32)
    out = mkl_gemm.product(x, mkl_gemm.pack(weight), 130, bias)
    assert out.shape == (rows, 130) and torch.allclose(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        mkl_gemm.pack(weight.to(torch.bfloat16))


@pytest.mark.parametrize("pack", PACKINGS)
def test_linear_matches_a_float_reference(pack):
    weight, bias, x = _bf16(96, 80, seed=4), _bf16(96, seed=5), _bf16(10, 80, seed=6)
    layer = PackedLinear(weight, bias, RowPlans(), pack=pack)
    reference = F.linear(x.double(), weight.double(), bias.double())
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), reference, rtol=2e-2, atol=2e-2)


def _one_row_path_differs(weight):
    """A kernel that, like oneDNN on some processors, sums a lone row in another order."""

    def kernel(x2d):
        out = (x2d.double()[:, None, :] * weight.double()[None]).sum(-1)  # the same sum for every row
        if x2d.shape[0] == 1:  # an error of a few units in the last place of bf16
            out = out * (1 + 2**-7)
        return out.to(torch.bfloat16)

    return kernel


def _row_position_matters(weight):
    """A kernel whose result for a row depends on where in the call the row sits (no plan fixes it)."""

    def kernel(x2d):
        out = (x2d.double()[:, None, :] * weight.double()[None]).sum(-1)
        return (out * (1 + 2**-6 * torch.arange(x2d.shape[0], dtype=out.dtype))[:, None]).to(torch.bfloat16)

    return kernel


def test_the_check_catches_a_kernel_whose_one_row_path_differs_and_pads_it():
    weight = _bf16(64, 256, seed=7)
    kernel = _one_row_path_differs(weight)
    x = _bf16(40, 256, seed=8)
    plain = RowPlan(block=0)
    # without the plan's padding the rows differ (the test can fail)
    raw_alone = torch.cat([kernel(x[i : i + 1]) for i in range(40)])
    assert not torch.equal(kernel(x), raw_alone)
    # the plan pads a lone row, so every width agrees
    assert rows_agree(kernel, 256, plain, tuple(range(1, 41)))
    assert choose_row_plan(kernel, 64, 256) == RowPlan(0, 512)
    assert choose_row_plan(kernel, 64, 256, weight_columns=lambda positions: weight[:, positions].t()) == RowPlan(0, 512)


def test_the_check_refuses_a_kernel_no_plan_makes_row_invariant():
    weight = _bf16(64, 128, seed=9)
    kernel = _row_position_matters(weight)
    for plan in PLANS:
        assert not rows_agree(kernel, 128, plan, (1, 2, 3, 17, 40))
    with pytest.raises(RowVarianceError, match="rounds a row differently.*decode in float32"):
        choose_row_plan(kernel, 64, 128)


def _sums_in_another_order_past_two_rows(weight):
    """A kernel that, like the stock bf16 product on this Xeon, sums a row in another order when a
    call holds more than two rows: float32 sums, one after another for up to two rows, in 8
    interleaved lanes beyond.  The results differ only where a sum falls near a rounding boundary
    of bf16 (in about one output of 10^4 on random rows)."""
    w = weight.float()

    def in_order(parts):
        total = torch.zeros(parts.shape[:-1])
        for k in range(parts.shape[-1]):
            total = total + parts[..., k]
        return total

    def kernel(x2d):
        products = x2d.float()[:, None, :] * w[None]  # exact: bf16 times bf16
        if x2d.shape[0] <= 2:
            return in_order(products).to(torch.bfloat16)
        lanes = in_order(products.unflatten(-1, (-1, 8)).transpose(-1, -2))  # [M, N, 8]
        return in_order(lanes).to(torch.bfloat16)

    return kernel


def test_the_check_sees_a_kernel_that_sums_in_another_order_at_another_width():
    """Each check row holds pairs of large entries whose products with one output's weights cancel
    exactly, so that output is the sum of the small products only where they were added while no
    large one was pending: any other summation order shows in its bits."""
    weight = _bf16(40, 64, seed=14, scale=0.125)
    kernel = _sums_in_another_order_past_two_rows(weight)
    columns = lambda positions: weight[:, positions].t()  # noqa: E731
    assert not rows_agree(kernel, 64, RowPlan(0), (3, 8, 24), weight_columns=columns)
    assert choose_row_plan(kernel, 40, 64, weight_columns=columns) == RowPlan(16, 512)
    rows = kernels.check_rows(64, torch.float64, weight_columns=columns)
    target = rows.new_tensor([r * 40 // kernels.CHECK_ROWS for r in range(kernels.CHECK_ROWS)]).long()
    products = rows * weight.double()[target]
    assert (products.abs().amax(-1) > 2**12 * products.sum(-1).abs()).float().mean() > 0.9  # large terms, small sums


def test_a_kernel_whose_narrow_calls_differ_gets_its_lone_rows_padded_further():
    """MKL's plans first leave a lone row alone, then pad it (and 2-3 rows) to 4, then to 8: a kernel
    summing calls of up to two rows in another order gets the plan padding to 4."""
    weight = _bf16(40, 64, seed=14, scale=0.125)
    kernel = _sums_in_another_order_past_two_rows(weight)
    columns = lambda positions: weight[:, positions].t()  # noqa: E731
    plans = kernels.plans_for(40, 64, kernels.MKL)
    assert [plan.least for plan in plans[:3]] == [1, 4, 8] and plans[0].widths()[:3] == (1, 2, 3)
    assert RowPlan(0, least=4).widths()[:3] == (4, 5, 6) and RowPlan(0, least=8).widths()[:2] == (8, 16)
    assert choose_row_plan(kernel, 40, 64, weight_columns=columns, kind=kernels.MKL) == RowPlan(0, 512, least=4)
    calls = []
    assert torch.equal(run_rows(lambda x: calls.append(x.shape[0]) or x * 2, weight[:1], RowPlan(0, least=4)), weight[:1] * 2)
    assert calls == [4]


def test_block_plans_run_fixed_blocks_and_long_inputs_in_chunks():
    calls = []

    def kernel(x2d):
        calls.append(x2d.shape[0])
        return x2d * 2

    x = _bf16(40, 8, seed=10)
    assert torch.equal(run_rows(kernel, x, RowPlan(16)), x * 2) and calls == [16, 16, 16]
    calls.clear()
    assert torch.equal(run_rows(kernel, x[:1], RowPlan(0)), x[:1] * 2) and calls == [2]
    calls.clear()
    assert torch.equal(run_rows(kernel, x, RowPlan(0, most=16)), x * 2) and calls == [16, 16, 8]


@pytest.mark.cpu_only  # oneDNN's kernel per row count
def test_calls_are_padded_to_a_few_row_counts_that_the_check_covers():
    """oneDNN keeps a kernel per row count it is called with (0.6 MB each for a 1536 x 576 weight):
    every call is padded to one of a few widths, and the check covers every one of them."""
    for most in (512, 128):
        plan = RowPlan(0, most)
        widths = plan.widths()
        assert len(widths) == (38 if most == 512 else 22) and widths[0] == 2 and widths[-1] == most
        for rows in range(1, most + 1):
            padded = bucket_rows(rows, most)
            assert padded in widths and padded >= rows
            assert padded - rows <= (1 if rows == 1 else 0 if rows <= 8 else 7 if rows <= 64 else rows / 8)
    assert RowPlan(16).widths() == (16,)
    calls = []

    def kernel(x2d):
        calls.append(x2d.shape[0])
        return x2d * 2

    x = _bf16(700, 8, seed=11)
    for rows in (1, 5, 9, 63, 65, 300, 512, 513, 700):
        calls.clear()
        assert torch.equal(run_rows(kernel, x[:rows], RowPlan(0)), x[:rows] * 2)
        assert set(calls) <= set(RowPlan(0).widths()), (rows, calls)
    # what the check runs: exactly the widths a call can have, each once, besides the lone rows
    calls.clear()
    assert rows_agree(kernel, 8, RowPlan(0, 128))
    assert sorted(set(calls)) == list(RowPlan(0, 128).widths()) and calls.count(16) == 1


def test_the_plans_of_a_model_are_told_in_one_phrase():
    """What describe() shows: the padding scheme once, the largest calls and lone-row padding
    merged (not one copy of the scheme per layer shape), then each block size."""
    mixed = describe_plans({RowPlan(0, 128, 1), RowPlan(0, 512, 1), RowPlan(0, 512, 2), RowPlan(16)})
    assert mixed.count("zero-padded") == 1 and "at most 128 or 512 rows a call" in mixed
    assert "a lone row padded to 2 in some layers" in mixed and mixed.endswith("rows in blocks of 16")
    assert describe_plans({RowPlan(0, 512, 2)}).endswith("at most 512 rows a call; a lone row padded to 2)")
    assert "lone" not in describe_plans({RowPlan(0, 128, 1)})
    assert describe_plans({RowPlan(8)}) == RowPlan(8).describe() == "rows in blocks of 8"


# ------------------------------------------------------------------------------- PackedLinear as a layer
@pytest.mark.cpu_only  # oneDNN packing
@pytest.mark.parametrize("pack", PACKINGS)
def test_packed_layer_state_dict_copy_pickle_and_to(pack):
    weight, bias = _bf16(48, 32, seed=11), _bf16(48, seed=12)
    layer = PackedLinear(weight, bias, RowPlans(), pack=pack)
    x = _bf16(5, 32, seed=13)
    expected = layer(x)
    state = layer.state_dict()
    assert set(state) == {"weight", "bias"} and torch.equal(state["weight"], weight)
    assert torch.equal(layer.weight, weight)
    other = PackedLinear(torch.zeros(48, 32), torch.zeros(48), RowPlans(), pack=pack)
    other.load_state_dict(state)
    assert torch.equal(other(x), expected)
    assert torch.equal(copy.deepcopy(layer)(x), expected)
    assert torch.equal(pickle.loads(pickle.dumps(layer))(x), expected)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(x), expected)
    with pytest.raises(RuntimeError, match="size mismatch"):
        other.load_state_dict({"weight": torch.zeros(3, 3), "bias": torch.zeros(48)})
    # .to() another dtype: a plain layer of that dtype, computing the same product
    layer.to(torch.float32)
    assert layer.packed is None and layer.weight.dtype == torch.float32
    assert torch.allclose(layer(x.float()), expected.float(), rtol=1e-2, atol=1e-2)


def test_a_stock_layer_uses_its_weight_as_it_is_and_is_checked_per_dtype_and_settings():
    """The stock path keeps the weight it was given (no copy: a tied output layer shares the
    embedding's storage); its plan is checked at the first product in each dtype and under each
    setting of the math switches, and reused after that."""
    weight, x = _bf16(48, 32, seed=20), _bf16(5, 32, seed=21)
    plans = RowPlans()
    layer = PackedLinear(weight, None, plans, pack=False)
    assert layer.packed is None and layer.plain.data_ptr() == weight.data_ptr()
    assert plans.describe() == "row plans checked on first use"
    layer(x)
    layer(x[:3])
    assert len(plans._plans) == 1 and plans.describe(dtype=torch.float32) == "row plans checked on first use"
    layer.float()
    assert layer.dtype == torch.float32 and layer.packed is None
    assert torch.allclose(layer(x.float()), F.linear(x.float(), weight.float()))
    assert len(plans._plans) == 2 and plans.describe(dtype=torch.float32) != "row plans checked on first use"
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high" if precision == "highest" else "highest")
        before = math_settings(torch.device("cpu"))
        layer(x.float())
        assert len(plans._plans) == 3 and any(key.settings == before for key in plans._plans)
    finally:
        torch.set_float32_matmul_precision(precision)


@pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN does not run bf16 here")
def test_a_move_that_changes_nothing_keeps_the_packing_and_a_real_move_unpacks():
    weight, x = _bf16(48, 32, seed=22), _bf16(7, 32, seed=23)
    layer = PackedLinear(weight, None, RowPlans())
    expected = layer(x)
    layer.to("cpu").to(torch.bfloat16)
    assert layer.packed is not None and torch.equal(layer(x), expected)
    layer.to(torch.float32).to(torch.bfloat16)  # there and back: the same weight, now with the stock product
    assert layer.packed is None and layer.dtype == torch.bfloat16 and torch.equal(layer.weight, weight)
    assert torch.allclose(layer(x).float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_a_layer_whose_kernel_is_row_variant_where_it_moved_refuses_its_first_product(monkeypatch):
    """No plan makes a kernel row-invariant when a row's result depends on where in the call it sits:
    the first product on that device and dtype raises (nothing inexact is computed)."""
    monkeypatch.setattr(kernels, "stock_kernel", lambda weight, bias: _row_position_matters(weight))
    layer = PackedLinear(_bf16(64, 128, seed=24), None, RowPlans(), pack=False)
    with pytest.raises(RowVarianceError, match=r"\[64, 128\] weight rounds a row differently.*decode in float32"):
        layer(_bf16(3, 128, seed=25))


def test_on_meta_a_layer_computes_shapes_and_checks_nothing():
    plans = RowPlans()
    layer = PackedLinear(_bf16(48, 32, seed=26), _bf16(48, seed=27), plans, pack=False).to("meta")
    assert layer.device.type == "meta"
    out = layer(torch.empty(2, 9, 32, dtype=torch.bfloat16, device="meta"))
    assert out.shape == (2, 9, 48) and out.device.type == "meta" and not plans._plans


def test_the_kernels_make_their_tensors_on_the_inputs_device():
    """With torch's default device set to meta, a tensor made without a device has no data: the
    check's rows, the padding and the causal mask of attention without a mask are all made where
    the inputs are, so nothing changes."""
    layer = PackedLinear(_bf16(48, 32, seed=28), _bf16(48, seed=29), RowPlans(), pack=False)
    x = _bf16(11, 32, seed=30)
    q, k, v = _qkv(queries=6, keys=20, seed=31)
    reference = PackedLinear(layer.weight, layer.bias, RowPlans(), pack=False)(x), _attend(q, k, v)
    with torch.device("meta"):
        out = layer(x), _attend(q, k, v)
    assert all(o.device.type == "cpu" for o in out)
    assert torch.equal(out[0], reference[0]) and torch.equal(out[1], reference[1])


# ------------------------------------------------------------------------------- attention
def _attend(q, k, v, mask=None, **kwargs):
    out, _ = exact_attention(Module(), q, k, v, mask, scaling=q.shape[-1] ** -0.5, **kwargs)
    return out  # [B, N, H, Dv]


def _qkv(batch=1, heads=6, heads_kv=2, queries=12, keys=40, dim=32, seed=0):
    return (_bf16(batch, heads, queries, dim, seed=seed), _bf16(batch, heads_kv, keys, dim, seed=seed + 1),
            _bf16(batch, heads_kv, keys, dim, seed=seed + 2))


def test_attention_causal_rows_equal_one_token_passes():
    """Row i of a causal pass of N queries on top of a cache = the one-query pass at that point."""
    past, n = 30, 12
    q, k, v = _qkv(queries=n, keys=past + n)
    wide = _attend(q, k, v)  # no mask: causal, the queries being the last n keys
    for i in range(n):
        one = _attend(q[:, :, i : i + 1], k[:, :, : past + i + 1], v[:, :, : past + i + 1])
        assert torch.equal(wide[:, i : i + 1], one), f"row {i}"


def test_attention_tree_rows_equal_their_paths_alone():
    """A tree pass: node rows see the cache and their ancestors, spread among decoys and masks; each
    equals the one-query pass over its path laid out contiguously (as model.generate sees it)."""
    past = 50
    # inputs: root(0), a1(1), d1(2), a2(3), d2(4), a3(5), mask(6); the path is root-a1-a2-a3
    parents = {0: None, 1: 0, 2: 0, 3: 1, 4: 1, 5: 3, 6: 5}
    n = len(parents)
    q, k, v = _qkv(queries=n, keys=past + n, seed=20)
    visible = torch.zeros(n, past + n, dtype=torch.bool)
    visible[:, :past] = True
    for i in range(n):
        j = i
        while j is not None:
            visible[i, past + j] = True
            j = parents[j]
    wide = _attend(q, k, v, visible[None, None])
    path = [0, 1, 3, 5]
    for depth, node in enumerate(path):
        keys = list(range(past)) + [past + p for p in path[: depth + 1]]
        one = _attend(q[:, :, node : node + 1], k[:, :, keys], v[:, :, keys])
        assert torch.equal(wide[:, node : node + 1], one), f"node {node}"


def test_attention_padding_and_batches_do_not_change_a_row():
    """Left padding (masked keys first) and other rows of a batch leave a row's bits alone."""
    q, k, v = _qkv(batch=1, queries=1, keys=25, seed=30)
    alone = _attend(q, k, v)
    pad = 7
    kp = torch.cat([_bf16(1, 2, pad, 32, seed=31), k], dim=2)
    vp = torch.cat([_bf16(1, 2, pad, 32, seed=32), v], dim=2)
    mask = torch.ones(1, 1, 1, pad + 25, dtype=torch.bool)
    mask[..., :pad] = False
    assert torch.equal(_attend(q, kp, vp, mask), alone)
    q2, k2, v2 = _qkv(batch=1, queries=1, keys=pad + 25, seed=33)
    batch_mask = torch.cat([mask, torch.ones_like(mask)])
    both = _attend(torch.cat([q, q2]), torch.cat([kp, k2]), torch.cat([vp, v2]), batch_mask)
    assert torch.equal(both[:1], alone)


def test_attention_in_query_chunks_equals_one_call(monkeypatch):
    q, k, v = _qkv(queries=40, keys=80, seed=40)
    whole = _attend(q, k, v)
    monkeypatch.setattr(kernels, "ATTENTION_BYTES", 6 * 80 * 8 * 3)  # three queries per chunk
    assert torch.equal(_attend(q, k, v), whole)


def test_attention_is_attention():
    """Close to the textbook formula (and to sdpa), with boolean, additive and no masks, softcapping."""
    q, k, v = _qkv(queries=5, keys=17, dim=16, seed=50)
    mask = torch.rand(1, 1, 5, 17, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True
    kr, vr = k.double().repeat_interleave(3, dim=1), v.double().repeat_interleave(3, dim=1)
    scores = q.double() @ kr.transpose(-1, -2) / 4.0
    expected = torch.softmax(scores.masked_fill(~mask, -math.inf), -1) @ vr
    assert torch.allclose(_attend(q, k, v, mask).double().transpose(1, 2), expected, atol=1e-2, rtol=1e-2)
    additive = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(~mask, torch.finfo(torch.bfloat16).min)
    assert torch.equal(_attend(q, k, v, additive), _attend(q, k, v, mask))
    sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    assert torch.allclose(_attend(q, k, v, mask).float().transpose(1, 2), sdpa, atol=1e-2, rtol=1e-2)
    capped = torch.softmax((torch.tanh(scores / 5.0) * 5.0).masked_fill(~mask, -math.inf), -1) @ vr
    assert torch.allclose(_attend(q, k, v, mask, softcap=5.0).double().transpose(1, 2), capped, atol=1e-2, rtol=1e-2)


def test_attention_row_that_sees_nothing_is_zero_not_nan():
    q, k, v = _qkv(queries=2, keys=6, seed=60)
    mask = torch.ones(1, 1, 2, 6, dtype=torch.bool)
    mask[0, 0, 0] = False
    out = _attend(q, k, v, mask)
    assert not out.isnan().any() and torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))


def test_attention_refuses_sinks():
    q, k, v = _qkv(queries=1, keys=4)
    with pytest.raises(NotImplementedError, match="sinks"):
        exact_attention(Module(), q, k, v, None, s_aux=torch.zeros(6))


@pytest.mark.cpu_only  # the processor's flags
def test_processor_description_names_the_matrix_units():
    cpu = kernels.Processor("Some CPU", frozenset({"avx512_bf16", "amx_bf16"}), True)
    assert cpu.matrix_units == "AMX" and cpu.has_bf16_units and "AMX" in cpu.describe()
    assert kernels.Processor("Old CPU", frozenset(), True).matrix_units is None
    assert not kernels.Processor("Old CPU", frozenset(), True).has_bf16_units
    assert not kernels.Processor("x", frozenset({"avx512_bf16"}), False).has_bf16_units
    assert kernels.Processor("x", frozenset({"avx512_bf16"}), False).describe() == (
        "x (AVX512-BF16, unused: oneDNN runs no bf16 here)")  # oneDNN held back, e.g. ONEDNN_MAX_CPU_ISA=AVX2
    assert kernels.Processor("Old CPU", frozenset(), True).describe() == "Old CPU (no bf16 matrix units)"
    # what is packed for oneDNN and what runs at full speed, per dtype (float32 needs no bf16 units)
    old, no_onednn = kernels.Processor("Old CPU", frozenset(), True), kernels.Processor("x", frozenset({"amx_bf16"}), False, False)
    assert old.packs(torch.bfloat16) and old.packs(torch.float32) and not old.packs(torch.float16)
    assert not no_onednn.packs(torch.bfloat16) and not no_onednn.packs(torch.float32)
    assert old.fast_for(torch.float32) and not old.fast_for(torch.bfloat16) and cpu.fast_for(torch.bfloat16)


def test_attention_prefill_chunks_skip_keys_no_query_sees(monkeypatch):
    """A causal prefill of 40 queries in chunks of 8 (each chunk over the keys it can see), with and
    without left padding, equals one call over every key."""
    q, k, v = _qkv(queries=40, keys=40, seed=70)
    pad = torch.ones(1, 1, 40, 40, dtype=torch.bool).tril()
    pad[..., :5] = False
    whole, padded = _attend(q, k, v), _attend(q, k, v, pad)
    monkeypatch.setattr(kernels, "QUERY_CHUNK", 8)
    assert torch.equal(_attend(q, k, v), whole)
    assert torch.equal(_attend(q, k, v, pad), padded)


def test_float32_packing_falls_back_to_onednn_then_the_stock_product_without_mkl(monkeypatch):
    """Where torch carries no MKL (macOS, ARM), float32 layers are packed for oneDNN where it runs
    float32, else computed with the stock product; bf16 is never packed by MKL."""
    monkeypatch.setattr(mkl_gemm, "available", lambda: False)
    real = kernels.processor()
    assert kernels.packing(torch.float32, real) == (kernels.ONEDNN if real.packs(torch.float32) else kernels.STOCK)
    without = kernels.Processor(real.name, real.flags, False, False)
    assert kernels.packing(torch.float32, without) == kernels.STOCK
    assert kernels.packing(torch.bfloat16, without) == kernels.STOCK
    monkeypatch.undo()
    if mkl_gemm.available():
        assert kernels.packing(torch.float32, without) == kernels.MKL
        assert kernels.packing(torch.bfloat16, real) == (kernels.ONEDNN if real.onednn_bf16 else kernels.STOCK)
        # float32 with both: MKL on an Intel processor, oneDNN on others (MKL ran slower on AMD EPYCs)
        intel, amd = (kernels.Processor("x", frozenset(), False, True, v) for v in ("GenuineIntel", "AuthenticAMD"))
        assert kernels.packing(torch.float32, intel) == kernels.MKL
        assert kernels.packing(torch.float32, amd) == kernels.ONEDNN


def test_a_lone_row_goes_unpadded_where_the_kernel_sums_it_alike():
    """The bf16 plans first leave a lone row as it is (one row costs less than two: measured on the
    Xeon); a kernel that sums every row alike at every width keeps that plan, one whose one-row path
    differs falls back to padding the lone row to two."""
    weight = _bf16(64, 256, seed=7)
    columns = lambda positions: weight[:, positions].t()  # noqa: E731
    alike = lambda x2d: (x2d.double()[:, None, :] * weight.double()[None]).sum(-1).to(torch.bfloat16)  # noqa: E731
    plans = kernels.plans_for(64, 256)
    assert plans[0] == RowPlan(0, 512, least=1) and plans[0].widths()[:2] == (1, 2)
    assert choose_row_plan(alike, 64, 256, weight_columns=columns) == RowPlan(0, 512, least=1)
    calls = []
    run_rows(lambda x: calls.append(x.shape[0]) or x, weight[:1].float(), plans[0])
    assert calls == [1]
    assert choose_row_plan(_one_row_path_differs(weight), 64, 256, weight_columns=columns) == RowPlan(0, 512)
