"""npu_grouped_matmul (both overloads) and npu_swiglu vs plain per-group math (spec npu_ops_moe §8, §9)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import optimized.ops  # noqa: F401  (registers torch.ops.npu.*)
from equivalence.support.compare import assert_bitwise_equal, assert_close, op_tolerance
from optimized.ops.registry import portable_kernel

GMM = torch.ops.npu.npu_grouped_matmul.default
GMM_LIST = torch.ops.npu.npu_grouped_matmul.List
SWIGLU = torch.ops.npu.npu_swiglu.default
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --- strategies ------------------------------------------------------------------------------------


@st.composite
def group_counts(draw, min_groups=1, max_groups=4):
    """Per-group row counts, including empty groups and 'every row in one group'."""
    g = draw(st.integers(min_groups, max_groups))
    shape = draw(st.sampled_from(["random", "one_group", "empty_groups"]))
    if shape == "one_group":
        counts = [0] * g
        counts[draw(st.integers(0, g - 1))] = draw(st.integers(1, 6))
    elif shape == "empty_groups":
        counts = [draw(st.sampled_from([0, 0, 3])) for _ in range(g)]
    else:
        counts = draw(st.lists(st.integers(0, 5), min_size=g, max_size=g))
    return counts


@st.composite
def gmm_cases(draw, overload=None, split_item=None, min_pad=0):
    """A single-x, group-along-M call as Qwen3 makes it, with every knob the spec allows drawn."""
    overload = overload or draw(st.sampled_from(["tensor", "list"]))
    counts = draw(group_counts(min_groups=2 if overload == "list" else 1))
    split_item = split_item or draw(st.sampled_from([1, 3]))
    # Σ counts < M is allowed (tail rows zero) except List + several weights + concatenated output.
    pad = 0 if (overload == "list" and split_item == 3) else draw(st.integers(min_pad, 3))
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)),
        counts=counts,
        pad=pad,
        K=draw(st.integers(1, 8)),
        N=draw(st.integers(1, 8)),
        dtype=draw(st.sampled_from(DTYPES)),
        overload=overload,
        group_list_type=0 if overload == "list" else draw(st.sampled_from([0, 1])),
        split_item=split_item,
        layout=draw(st.sampled_from(["3d", "list", "transposed"])),
        bias=draw(st.sampled_from([None, "per_group", "stacked"])),
    )


def make_inputs(case):
    """x [M, K], weights (in the drawn layout), the logical [G, K, N] weight and the biases [G, N] fp32."""
    gen = torch.Generator().manual_seed(case["seed"])
    counts, K, N, dtype = case["counts"], case["K"], case["N"], case["dtype"]
    G, M = len(counts), sum(counts) + case["pad"]
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = torch.randn(G, K, N, generator=gen).to(dtype)
    if case["layout"] == "3d":
        weight = [w]
    elif case["layout"] == "list":
        weight = list(w.unbind(0))
    else:  # a transposed view of [G, N, K] storage, as the NPU stores w13/w2
        weight = [w.transpose(1, 2).contiguous().transpose(1, 2)]
    bias_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    b = torch.randn(G, N, generator=gen).to(bias_dtype)
    if case["bias"] is None:
        bias = None
    elif case["bias"] == "stacked" and case["layout"] != "list":
        bias = [b]
    else:
        bias = list(b.unbind(0))
    return x, weight, w, (None if bias is None else b), bias


def call_gmm(case, x, weight, bias):
    counts = case["counts"]
    ends = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    if case["overload"] == "list":
        return GMM_LIST([x], weight, bias=bias, group_list=ends.tolist(), split_item=case["split_item"])
    group_list = ends if case["group_list_type"] == 0 else torch.tensor(counts, dtype=torch.int64)
    return GMM(
        [x],
        weight,
        bias=bias,
        group_list=group_list,
        group_type=0,
        group_list_type=case["group_list_type"],
        split_item=case["split_item"],
    )


def reference_groups(x, w, b, counts, out_dtype):
    """Plain per-group matmuls in float64, rows walked by counts, rounded once."""
    outs, row = [], 0
    for g, c in enumerate(counts):
        y = x[row : row + c].double() @ w[g].double()
        if b is not None:
            y = y + b[g].double()
        outs.append(y.to(out_dtype))
        row += c
    return outs


# --- grouped matmul: group along M -----------------------------------------------------------------


@given(gmm_cases())
def test_gmm_groups_equal_per_group_matmul_and_tail_is_zero(case):
    x, weight, w, b, bias = make_inputs(case)
    out = call_gmm(case, x, weight, bias)
    expected = reference_groups(x, w, b, case["counts"], case["dtype"])
    tol = op_tolerance(case["dtype"])
    if case["split_item"] == 1:
        assert len(out) == len(case["counts"])
        for g, (y, e) in enumerate(zip(out, expected)):
            assert y.dtype == case["dtype"]
            assert_close(y, e, tol, f"group {g} of {case}")
    else:
        (y,) = out
        valid = sum(case["counts"])
        assert y.shape == (x.shape[0], case["N"]) and y.dtype == case["dtype"]
        assert_close(y[:valid], torch.cat(expected), tol, f"valid rows of {case}")
        assert_bitwise_equal(y[valid:], torch.zeros_like(y[valid:]), "padded tail rows (spec §13.12: zero)")


@given(gmm_cases(overload="tensor", split_item=3, min_pad=1))
def test_gmm_rows_past_group_sum_are_zero(case):
    """Spec §13.12: Σ group_list < M is allowed; the valid rows are the groups, the tail is exactly 0."""
    x, weight, w, b, bias = make_inputs(case)
    (y,) = call_gmm(case, x, weight, bias)
    valid = sum(case["counts"])
    assert y.shape == (valid + case["pad"], case["N"])
    assert_close(
        y[:valid],
        torch.cat(reference_groups(x, w, b, case["counts"], case["dtype"])),
        op_tolerance(case["dtype"]),
        f"valid rows of {case}",
    )
    assert_bitwise_equal(y[valid:], torch.zeros_like(y[valid:]), "padded tail rows")


@given(gmm_cases(overload="tensor"))
def test_gmm_count_and_cumsum_group_lists_agree(case):
    x, weight, _, _, bias = make_inputs(case)
    counts = torch.tensor(case["counts"], dtype=torch.int64)
    kw = dict(bias=bias, group_type=0, split_item=case["split_item"])
    by_count = GMM([x], weight, group_list=counts, group_list_type=1, **kw)
    by_cumsum = GMM([x], weight, group_list=counts.cumsum(0), group_list_type=0, **kw)
    assert len(by_count) == len(by_cumsum)
    for a, c in zip(by_count, by_cumsum):
        assert_bitwise_equal(a, c, "count vs cumsum group_list")


@given(gmm_cases())
def test_gmm_tensor_and_list_overloads_agree(case):
    if len(case["counts"]) == 1 or (case["split_item"] == 3 and case["pad"]):
        case = dict(case, counts=case["counts"] + [0], pad=0)  # List overload: length != 1, Σ == M for split 3
    x, weight, w, _, _ = make_inputs(dict(case, layout="3d"))
    ends = torch.tensor(case["counts"], dtype=torch.int64).cumsum(0)
    by_tensor = GMM([x], [w], group_list=ends, group_type=0, group_list_type=0, split_item=case["split_item"])
    by_list = GMM_LIST([x], [w], group_list=ends.tolist(), split_item=case["split_item"])
    for a, c in zip(by_tensor, by_list, strict=True):
        assert_bitwise_equal(a, c, "Tensor vs List overload")


@given(gmm_cases())
def test_gmm_weight_layouts_agree(case):
    """Single 3-D weight, list of 2-D weights and a transposed view compute the same groups."""
    outs = []
    for layout in ("3d", "list", "transposed"):
        layout_case = dict(case, layout=layout, bias=None)
        x, weight, _, _, _ = make_inputs(layout_case)
        outs.append(call_gmm(layout_case, x, weight, None))
    for other in outs[1:]:
        for a, c in zip(outs[0], other, strict=True):
            assert_close(a, c, op_tolerance(case["dtype"]), f"weight layouts of {case}")


def test_gmm_qwen3_ffn_call_with_padding():
    """The exact Qwen3 call (spec §8.4): bf16, transposed [L, K, N] view, int64 counts, M > Σtok."""
    gen = torch.Generator().manual_seed(0)
    tok = torch.tensor([3, 0, 5, 1], dtype=torch.int64)
    x = torch.randn(12, 16, generator=gen).bfloat16()
    w = torch.randn(4, 32, 16, generator=gen).bfloat16().transpose(1, 2)  # logical [L, K=16, N=32]
    (y,) = GMM([x], [w], group_list=tok, group_type=0, group_list_type=1, split_item=3)
    expected = torch.cat(reference_groups(x, w, None, tok.tolist(), torch.bfloat16))
    assert y.shape == (12, 32)
    assert_close(y[:9], expected, op_tolerance(torch.bfloat16), "Qwen3 FFN gmm")
    assert not y[9:].any(), "rows past Σtok are zero"


def test_gmm_split_item_1_with_counts_uses_resolved_ends():
    """Spec §13.14: the C++ sizes split_item 0/1 outputs from raw value differences; the golden uses the ends."""
    x = torch.randn(9, 3)
    w = torch.randn(3, 3, 2)
    outs = GMM([x], [w], group_list=torch.tensor([4, 1, 2]), group_type=0, group_list_type=1, split_item=1)
    assert [o.shape[0] for o in outs] == [4, 1, 2]
    assert_close(outs[1], x[4:5] @ w[1], op_tolerance(torch.float32), "group 1 rows 4:5")


def test_gmm_stacked_and_per_group_bias_agree():
    """Spec §13.13: a single 3-D weight takes bias=[b] with b [G, N] or one [N] per group."""
    x, w, b = torch.randn(7, 4), torch.randn(3, 4, 5), torch.randn(3, 5)
    kw = dict(group_list=torch.tensor([2, 2, 3]), group_type=0, group_list_type=1, split_item=3)
    stacked = GMM([x], [w], bias=[b], **kw)[0]
    per_group = GMM([x], [w], bias=list(b.unbind(0)), **kw)[0]
    assert_bitwise_equal(stacked, per_group, "bias [G, N] vs G x [N]")
    assert_close(stacked, torch.cat(reference_groups(x, w, b, [2, 2, 3], torch.float32)), op_tolerance(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_item", [0, 2])
@pytest.mark.parametrize("with_group_list", [False, True])
def test_gmm_multiple_x_one_per_group(dtype, split_item, with_group_list):
    gen = torch.Generator().manual_seed(1)
    rows = [2, 0, 3]
    xs = [torch.randn(r, 4, generator=gen).to(dtype) for r in rows]
    ws = [torch.randn(4, 3, generator=gen).to(dtype) for _ in rows]
    group_list = torch.tensor(rows) if with_group_list else None
    out = GMM(xs, ws, group_list=group_list, group_type=0, group_list_type=1, split_item=split_item)
    expected = [(a.double() @ b.double()).to(dtype) for a, b in zip(xs, ws)]
    if split_item == 2:
        out, expected = out[0:1], [torch.cat(expected)]
    for y, e in zip(out, expected, strict=True):
        assert_close(y, e, op_tolerance(dtype), "multiple x")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gmm_no_grouping_contracts_last_dim_of_nd_x(dtype):
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(2, 3, 4, generator=gen).to(dtype), torch.randn(5, 6, generator=gen).to(dtype)]
    ws = [torch.randn(4, 7, generator=gen).to(dtype), torch.randn(6, 2, generator=gen).to(dtype)]
    bias_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    bs = [torch.randn(7, generator=gen).to(bias_dtype), torch.randn(2, generator=gen).to(bias_dtype)]
    out = GMM(xs, ws, bias=bs, group_type=-1, split_item=0, output_dtype=dtype)
    for y, a, w, b in zip(out, xs, ws, bs, strict=True):
        assert_close(y, (a.double() @ w.double() + b.double()).to(dtype), op_tolerance(dtype), "group_type=-1")


@given(
    seed=st.integers(0, 2**31 - 1),
    counts=group_counts(),
    M=st.integers(1, 5),
    N=st.integers(1, 5),
    extra_k=st.integers(0, 2),
    split_item=st.sampled_from([1, 3]),
    dtype=st.sampled_from(DTYPES),
)
def test_gmm_k_grouping_sums_to_full_matmul(seed, counts, M, N, extra_k, split_item, dtype):
    """group_type=2: y_g = X[:, K_g] @ W[K_g]; with fp32 Σ_g y_g = X @ W over the grouped columns."""
    gen = torch.Generator().manual_seed(seed)
    K = sum(counts) + extra_k
    x = torch.randn(K, M, generator=gen).to(dtype).t()  # logical [M, K], a transposed view as on the NPU
    w = torch.randn(K, N, generator=gen).to(dtype)
    ends = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    out = GMM([x], [w], group_list=ends, group_type=2, group_list_type=0, split_item=split_item)
    ys = list(out[0].unbind(0)) if split_item == 3 else out
    assert len(ys) == len(counts) and all(y.shape == (M, N) for y in ys)
    start = 0
    for g, c in enumerate(counts):
        expected = (x[:, start : start + c].double() @ w[start : start + c].double()).to(dtype)
        assert_close(ys[g], expected, op_tolerance(dtype), f"K group {g}")
        start += c
    if dtype == torch.float32:
        total = torch.stack(ys).double().sum(0)
        assert_close(
            total.float(), (x[:, :start].double() @ w[:start].double()).float(), op_tolerance(dtype), "Σ_g y_g = X @ W"
        )


@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES))
def test_gmm_output_dtype_code_and_tuning_config_are_accepted(seed, dtype):
    x, w = torch.randn(4, 3).to(dtype), torch.randn(2, 3, 2).to(dtype)
    kw = dict(group_list=torch.tensor([1, 3]), group_type=0, group_list_type=1, split_item=3)
    plain = GMM([x], [w], **kw)[0]
    assert_bitwise_equal(GMM([x], [w], output_dtype=dtype, tuning_config=[0], **kw)[0], plain, "output_dtype")
    assert_bitwise_equal(GMM_LIST([x], [w], group_list=[1, 4], split_item=3, output_dtype=dtype)[0], plain, "List")


# --- swiglu ----------------------------------------------------------------------------------------


@st.composite
def swiglu_cases(draw):
    ndim = draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    dim = draw(st.integers(-ndim, ndim - 1))
    shape[dim] *= 2
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)),
        shape=shape,
        dim=dim,
        dtype=draw(st.sampled_from(DTYPES)),
        transposed=draw(st.booleans()),
    )


@given(swiglu_cases())
def test_swiglu_equals_silu_gate_times_up(case):
    gen = torch.Generator().manual_seed(case["seed"])
    x = (torch.randn(case["shape"], generator=gen) * 3).to(case["dtype"])
    if case["transposed"] and x.dim() >= 2:  # non-contiguous input: the golden accepts any layout
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    out = SWIGLU(x, dim=case["dim"])
    a, b = x.chunk(2, case["dim"])
    expected = (F.silu(a.float()) * b.float()).to(case["dtype"])
    assert out.dtype == x.dtype and out.shape == expected.shape
    assert_close(out, expected, op_tolerance(case["dtype"]), f"swiglu {case}")


@given(swiglu_cases())
def test_swiglu_swapping_halves_changes_the_result(case):
    shape = list(case["shape"])
    shape[case["dim"]] = 16  # 8 random elements per half: equal outputs would need equal halves
    x = torch.randn(shape, generator=torch.Generator().manual_seed(case["seed"])).to(case["dtype"])
    a, b = x.chunk(2, case["dim"])
    swapped = torch.cat([b, a], case["dim"])
    assert not torch.equal(SWIGLU(x, dim=case["dim"]), SWIGLU(swapped, dim=case["dim"]))


def test_swiglu_gate_is_the_first_half():
    """Qwen3's w13 stores gate first: npu_swiglu([gate | up]) = silu(gate) * up."""
    gate, up = torch.tensor([[1.0, -2.0]]), torch.tensor([[3.0, 0.5]])
    out = SWIGLU(torch.cat([gate, up], -1))
    assert_close(out, F.silu(gate) * up, op_tolerance(torch.float32), "gate first")


# --- opcheck and torch.compile ---------------------------------------------------------------------


def _opcheck_cases():
    x, w = torch.randn(9, 4, dtype=torch.bfloat16), torch.randn(3, 4, 6, dtype=torch.bfloat16)
    tok = torch.tensor([2, 0, 5])
    xs, ws = [torch.randn(2, 3, 4), torch.randn(5, 4)], [torch.randn(4, 2), torch.randn(4, 3)]
    return {
        "split3_counts": (GMM, ([x], [w]), dict(group_list=tok, group_type=0, group_list_type=1, split_item=3)),
        "split1_cumsum_dynamic": (GMM, ([x], [w]), dict(group_list=tok.cumsum(0), group_type=0, split_item=1)),
        "no_grouping_bias": (GMM, (xs, ws), dict(bias=[torch.randn(2), torch.randn(3)], group_type=-1)),
        "k_grouping": (
            GMM,
            ([torch.randn(6, 3).t()], [torch.randn(6, 2)]),
            dict(group_list=torch.tensor([2, 6]), group_type=2, split_item=3),
        ),
        "list_split3": (GMM_LIST, ([x], [w]), dict(group_list=[2, 2, 9], split_item=3)),
        "list_split1": (GMM_LIST, ([x], [w]), dict(group_list=[2, 2, 7], split_item=1)),
        "swiglu": (SWIGLU, (torch.randn(3, 2, 8, dtype=torch.float16),), dict(dim=1)),
    }


@pytest.mark.parametrize("name", sorted(_opcheck_cases()))
def test_opcheck(name):
    op, args, kwargs = _opcheck_cases()[name]
    torch.library.opcheck(op, args, kwargs)


def _qwen3_ffn(x, w13, w2, tok):
    h = torch.ops.npu.npu_grouped_matmul([x], [w13], group_list=tok, group_type=0, group_list_type=1, split_item=3)[0]
    h = torch.ops.npu.npu_swiglu(h)
    return torch.ops.npu.npu_grouped_matmul.List([h], [w2], group_list=[2, 2, 10], split_item=3)[0]


def _split_groups(x, w, ends):
    ys = torch.ops.npu.npu_grouped_matmul([x], [w], group_list=ends, group_type=0, split_item=1)
    return [y * 2 for y in ys]


def test_compile_qwen3_ffn_fullgraph_equals_eager():
    torch._dynamo.reset()
    x = torch.randn(10, 4, dtype=torch.bfloat16)
    w13, w2 = torch.randn(3, 4, 8, dtype=torch.bfloat16), torch.randn(3, 4, 4, dtype=torch.bfloat16)
    tok = torch.tensor([2, 0, 5])
    compiled = torch.compile(_qwen3_ffn, fullgraph=True, backend="aot_eager")
    assert_bitwise_equal(compiled(x, w13, w2, tok), _qwen3_ffn(x, w13, w2, tok), "compiled FFN")


def test_compile_split_item_1_data_dependent_rows_equals_eager():
    torch._dynamo.reset()
    x, w, ends = torch.randn(9, 4), torch.randn(3, 4, 2), torch.tensor([2, 2, 7])
    compiled = torch.compile(_split_groups, fullgraph=True, backend="aot_eager")
    for a, e in zip(compiled(x, w, ends), _split_groups(x, w, ends), strict=True):
        assert_bitwise_equal(a, e, "compiled split_item=1")


# --- errors ----------------------------------------------------------------------------------------

_x, _w = torch.randn(6, 4), torch.randn(2, 4, 3)
_tok = torch.tensor([2, 3])
_M = dict(group_type=0, group_list_type=1, split_item=3)

ERRORS = {
    "group_type_none": (
        lambda: GMM([_x], [_w], group_list=_tok, split_item=3),
        ValueError,
        "npu_grouped_matmul: .*Requires manual passing group_type",
    ),
    "group_type_bad": (
        lambda: GMM([_x], [_w], group_list=_tok, group_type=1, split_item=3),
        ValueError,
        "npu_grouped_matmul: group_type=1",
    ),
    "split_item_bad": (
        lambda: GMM([_x], [_w], group_list=_tok, group_type=0, split_item=4),
        ValueError,
        "npu_grouped_matmul: split_item=4",
    ),
    "k_mismatch": (
        lambda: GMM([torch.randn(6, 5)], [_w], group_list=_tok, **_M),
        ValueError,
        r"npu_grouped_matmul: x\[0\] has K=5 .* K=4",
    ),
    "group_list_longer_than_weights": (
        lambda: GMM([_x], [_w], group_list=torch.tensor([1, 1, 1]), **_M),
        ValueError,
        "npu_grouped_matmul: group_list has 3 entries; expected 2",
    ),
    "negative_count": (
        lambda: GMM([_x], [_w], group_list=torch.tensor([3, -1]), **_M),
        ValueError,
        r"npu_grouped_matmul: group_list \(group_list_type=1, counts\) must be >= 0",
    ),
    "non_monotonic_cumsum": (
        lambda: GMM([_x], [_w], group_list=torch.tensor([4, 2]), group_type=0, group_list_type=0, split_item=3),
        ValueError,
        "npu_grouped_matmul: group_list .*cumsum.* non-decreasing",
    ),
    "sum_exceeds_m": (
        lambda: GMM([_x], [_w], group_list=torch.tensor([4, 3]), **_M),
        ValueError,
        "npu_grouped_matmul: group_list sums to 7 rows but x\\[0\\] has M=6",
    ),
    "group_list_int32": (
        lambda: GMM([_x], [_w], group_list=_tok.int(), **_M),
        ValueError,
        "npu_grouped_matmul: group_list has dtype torch.int32",
    ),
    "group_list_type_2": (
        lambda: GMM([_x], [_w], group_list=_tok, group_type=0, group_list_type=2, split_item=3),
        ValueError,
        "npu_grouped_matmul: group_list_type=2",
    ),
    "x_float64": (
        lambda: GMM([_x.double()], [_w.double()], group_list=_tok, **_M),
        ValueError,
        r"npu_grouped_matmul: x\[0\] has dtype torch.float64",
    ),
    "weight_dtype_differs": (
        lambda: GMM([_x], [_w.half()], group_list=_tok, **_M),
        ValueError,
        r"npu_grouped_matmul: weight\[0\] has dtype torch.float16; expected torch.float32",
    ),
    "output_dtype_differs": (
        lambda: GMM([_x], [_w], group_list=_tok, output_dtype=torch.bfloat16, **_M),
        ValueError,
        "npu_grouped_matmul: output_dtype is torch.bfloat16",
    ),
    "bias_shape": (
        lambda: GMM([_x], [_w], bias=[torch.randn(2, 4)], group_list=_tok, **_M),
        ValueError,
        r"npu_grouped_matmul: bias\[0\] has shape \(2, 4\); expected \(2, 3\)",
    ),
    "k_group_bias": (
        lambda: GMM([_x], [_w[0]], bias=[torch.randn(3)], group_list=_tok, group_type=2),
        ValueError,
        "npu_grouped_matmul: bias is not supported with group_type=2",
    ),
    "x_3d_grouped": (
        lambda: GMM([_x[None]], [_w], group_list=_tok, **_M),
        ValueError,
        r"npu_grouped_matmul: x\[0\] must have 2 dims",
    ),
    "unequal_n_concat": (
        lambda: GMM([_x], [_w[0], torch.randn(4, 5)], group_list=_tok, **_M),
        ValueError,
        "npu_grouped_matmul: split_item=3 concatenates .* same N",
    ),
    "multi_x_sizes": (
        lambda: GMM([_x[:2], _x[:3]], [_w], group_list=torch.tensor([2, 2]), **_M),
        ValueError,
        "npu_grouped_matmul: group_list sizes",
    ),
    "quant_scale": (
        lambda: GMM([_x], [_w], scale=[torch.ones(2, 3)], group_list=_tok, **_M),
        NotImplementedError,
        "npu_grouped_matmul: scale",
    ),
    "quant_antiquant": (
        lambda: GMM([_x], [_w], antiquant_scale=[torch.ones(2, 3)], group_list=_tok, **_M),
        NotImplementedError,
        "npu_grouped_matmul: antiquant_scale",
    ),
    "quant_per_token_scale": (
        lambda: GMM([_x], [_w], per_token_scale=[torch.ones(6)], group_list=_tok, **_M),
        NotImplementedError,
        "npu_grouped_matmul: per_token_scale",
    ),
    "quant_weight_dtype": (
        lambda: GMM([_x], [_w], weight_dtype=296, group_list=_tok, **_M),
        NotImplementedError,
        "npu_grouped_matmul: weight_dtype",
    ),
    "quant_act_type": (
        lambda: GMM([_x], [_w], act_type=5, group_list=_tok, **_M),
        NotImplementedError,
        "npu_grouped_matmul: act_type=5",
    ),
    "quant_int8_x": (
        lambda: GMM([_x.to(torch.int8)], [_w.to(torch.int8)], group_list=_tok, **_M),
        NotImplementedError,
        r"npu_grouped_matmul: x\[0\] dtype torch.int8",
    ),
    "list_group_type": (
        lambda: GMM_LIST([_x], [_w], group_list=[2, 5], group_type=0, split_item=3),
        ValueError,
        r"npu_grouped_matmul.List: group_type=0",
    ),
    "list_length_one": (
        lambda: GMM_LIST([_x], [_w[0]], group_list=[6], split_item=3),
        ValueError,
        r"npu_grouped_matmul.List: group_list=\[6\] has length 1",
    ),
    "list_decreasing": (
        lambda: GMM_LIST([_x], [_w], group_list=[5, 2], split_item=1),
        ValueError,
        r"npu_grouped_matmul.List: group_list \(cumulative ends\) must be non-decreasing",
    ),
    "list_split3_short": (
        lambda: GMM_LIST([_x], [_w], group_list=[2, 5], split_item=3),
        ValueError,
        r"npu_grouped_matmul.List: group_list ends at 5 but x\[0\] has M=6",
    ),
    "list_group_list_type": (
        lambda: GMM_LIST([_x], [_w], group_list=[2, 6], group_list_type=1, split_item=3),
        ValueError,
        r"npu_grouped_matmul.List: group_list_type=1",
    ),
    "list_quant": (
        lambda: GMM_LIST([_x], [_w], offset=[torch.ones(3)], group_list=[2, 6], split_item=3),
        NotImplementedError,
        r"npu_grouped_matmul.List: offset",
    ),
    "swiglu_odd": (lambda: SWIGLU(torch.randn(3, 5)), ValueError, "npu_swiglu: self has odd size 5 along dim=1"),
    "swiglu_dim_range": (lambda: SWIGLU(torch.randn(3, 4), dim=2), ValueError, "npu_swiglu: dim=2 is out of range"),
    "swiglu_dtype": (
        lambda: SWIGLU(torch.randn(3, 4).double()),
        ValueError,
        "npu_swiglu: self has dtype torch.float64",
    ),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_invalid_inputs_raise_naming_op_and_argument(name):
    call, error, match = ERRORS[name]
    with pytest.raises(error, match=match):
        call()


def test_npu_limits_only_in_strict_mode(monkeypatch):
    x, w = torch.randn(4, 3, dtype=torch.bfloat16), torch.randn(2, 3, 2, dtype=torch.bfloat16)
    kw = dict(bias=[torch.zeros(2, 2, dtype=torch.bfloat16)], group_list=torch.tensor([1, 3]), **_M)
    monkeypatch.delenv("QWEN3_MOE_STRICT_NPU_LIMITS", raising=False)  # whatever the caller's shell exported
    GMM([x], [w], **kw)  # bf16 bias is fine semantically
    monkeypatch.setenv("QWEN3_MOE_STRICT_NPU_LIMITS", "1")
    with pytest.raises(ValueError, match=r"npu_grouped_matmul: NPU limit: bias\[0\] has dtype torch.bfloat16"):
        GMM([x], [w], **kw)
    with pytest.raises(ValueError, match="npu_swiglu: NPU limit: self is empty"):
        SWIGLU(torch.randn(0, 4))


# --- NPU kernel vs portable kernel -----------------------------------------------------------------


def _npu_cases():
    gen = torch.Generator().manual_seed(3)
    bf, f16 = torch.bfloat16, torch.float16
    x = torch.randn(24, 32, generator=gen).to(bf)
    w = torch.randn(4, 64, 32, generator=gen).to(bf).transpose(1, 2)  # logical [4, 32, 64], NPU-style view
    tok = torch.tensor([5, 0, 11, 3], dtype=torch.int64)
    xh, wh = x.to(f16), w.to(f16)
    return {
        "qwen3_counts_padded": ("npu_grouped_matmul", ([x], [w]), dict(group_list=tok, **_M), 19),
        "cumsum_fp16_bias": (
            "npu_grouped_matmul",
            ([xh], [wh]),
            dict(
                bias=[torch.randn(4, 64, generator=gen).to(f16)],
                group_list=tok.cumsum(0),
                group_type=0,
                group_list_type=0,
                split_item=3,
            ),
            19,
        ),
        "split1_cumsum": (
            "npu_grouped_matmul",
            ([x], [w]),
            dict(group_list=tok.cumsum(0), group_type=0, group_list_type=0, split_item=1),
            None,
        ),
        "list_overload": ("npu_grouped_matmul.List", ([x], [w]), dict(group_list=[5, 5, 16, 24], split_item=3), 24),
        "swiglu_bf16": ("npu_swiglu", (torch.randn(16, 128, generator=gen).to(bf),), dict(dim=-1), None),
        "swiglu_fp16_dim0": ("npu_swiglu", (torch.randn(8, 6, generator=gen).to(f16),), dict(dim=0), None),
    }


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


@pytest.mark.npu
@pytest.mark.parametrize("name", sorted(_npu_cases()))
def test_npu_kernel_matches_portable(name):
    qualname, args, kwargs, valid_rows = _npu_cases()[name]
    op_name, _, overload = qualname.partition(".")
    npu_op = getattr(getattr(torch.ops.npu, op_name), overload or "default")
    device = torch.device("npu")
    actual = npu_op(*_to(args, device), **_to(kwargs, device))
    expected = portable_kernel(qualname)(*args, **kwargs)
    actual = [actual] if isinstance(actual, torch.Tensor) else list(actual)
    expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        a = a.cpu()
        assert a.shape == e.shape and a.dtype == e.dtype
        if valid_rows is not None:  # rows past Σ group_list are unspecified on the NPU (spec §0): masked out
            a, e = a[:valid_rows], e[:valid_rows]
        assert_close(a, e, op_tolerance(e.dtype), f"{qualname} {name}: NPU vs portable")


# --- the stacked-weight fast path (the MoE experts' call) vs the general per-group path ---------------------


@given(gmm_cases(overload="tensor", split_item=3))
def test_gmm_stacked_fast_path_is_bitwise_the_per_group_path(case):
    """One x, one 3-D weight, concatenated output: the kernel visits only the non-empty groups
    (`_run_stacked`; on CPU bf16 without bias, `cpu_gemm.grouped_linear`); `_run` over the unbound weights, every
    group visited, is the semantic path it must equal bit for bit (same kernel per group, zero tail)."""
    from optimized.ops import gmm

    case = dict(
        case,
        layout="transposed" if case["layout"] == "transposed" else "3d",
        bias=None if case["bias"] is None else "stacked",
    )
    x, weight, w, b, bias = make_inputs(case)
    (fast,) = call_gmm(case, x, weight, bias)
    ends = torch.tensor(case["counts"], dtype=torch.int64).cumsum(0).tolist()
    Bs = [None] * len(ends) if b is None else list(b.unbind(0))
    (general,) = gmm._run(gmm.OP, "m_single", [x], list(weight[0].unbind(0)), Bs, ends, 3, case["dtype"])
    assert_bitwise_equal(fast, general, f"stacked fast path vs per-group path, {case}")
    from optimized.ops import cpu_gemm

    w3 = weight[0]
    if cpu_gemm.ONEDNN_BF16 and case["dtype"] == torch.bfloat16 and b is None and x.shape[0] > 0:
        assert ("groups", w3.data_ptr(), tuple(w3.shape), w3.stride()) in cpu_gemm._PACKED, (
            "bf16 without bias: the grouped linear on packed groups (cpu_gemm.grouped_linear) was not taken"
        )


@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 9),
    st.sampled_from([1, 7, 64, 768, 2048]),
    st.integers(1, 40),
    st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_gmm_16bit_cpu_matmul_rounds_once_like_the_fp32_definition(seed, m, k, n, dtype):
    """`_mm`'s CPU fast path multiplies 16-bit operands directly (fp32 accumulation, one rounding at the output)
    instead of the spec's definition, fp32 upcast + fp32 matmul + one rounding. Both round once from an fp32 sum:
    they differ only where the two fp32 summation orders straddle a rounding boundary, i.e. by one ulp of the output
    dtype, plus what the orders' fp32 sums differ by: sqrt(K) * u32 * sum|a||w| (the probabilistic rounding-error
    bound of a K-term sum, Higham & Mary 2019), which only matters where the sum cancels (seed 10240, m2 k2048 n12,
    fp16: an output of -2.6e-4 from terms summing to 25 in magnitude differed by two ulps, 4.8e-7; the allowance
    there is 6.7e-5). A 16-bit accumulation or a second rounding errs by hundreds of ulps at K=2048."""
    from optimized.ops import gmm

    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype).t()  # a transposed view, as the experts store it
    fast = gmm._mm(a, w, None, dtype)
    definition = (a.float() @ w.float()).to(dtype)
    assert fast.dtype == dtype and fast.shape == definition.shape
    # one ulp at |definition| (the spacing of the output dtype at that magnitude) + the fp32 reordering allowance
    ulp = torch.finfo(dtype).eps * torch.exp2(
        torch.floor(torch.log2(definition.float().abs().clamp_min(torch.finfo(dtype).tiny)))
    )
    reorder = math.sqrt(k) * torch.finfo(torch.float32).eps / 2 * (a.float().abs() @ w.float().abs())
    diff = (fast.float() - definition.float()).abs()
    assert bool((diff <= ulp + reorder).all()), (
        f"max diff {diff.max().item()} exceeds one ulp + the fp32 reordering allowance (seed {seed}, m{m} k{k} n{n})"
    )


@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 9),
    st.sampled_from([1, 7, 64, 768, 2048]),
    st.integers(1, 40),
    st.sampled_from(["stacked", "transposed"]),
)
def test_gmm_bf16_cpu_matmul_on_the_prepacked_weight_is_bitwise_a_matmul(seed, m, k, n, layout):
    """On CPU, `_mm`'s bf16 path runs on oneDNN's prepacked copy of the expert weight (optimized/ops/cpu_gemm.py):
    bitwise the plain `a @ w` it replaces, for the experts' stored layout ([K, N] rows of a stacked [E, K, N]) and a
    transposed view; the packed copy exists afterwards, so a silent fallback to `a @ w` cannot pass."""
    from optimized.ops import cpu_gemm, gmm

    if not cpu_gemm.ONEDNN_BF16:
        pytest.skip("oneDNN bf16 is not available on this CPU")
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).bfloat16()
    if layout == "stacked":
        w = (torch.randn(3, k, n, generator=gen) * 0.02).bfloat16()[1]
    else:
        w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16().t()
    with torch.no_grad():
        got = gmm._mm(a, w, None, torch.bfloat16)
    wt = w.t()
    assert (wt.data_ptr(), tuple(wt.shape), wt.stride()) in cpu_gemm._PACKED, "the prepacked path was not taken"
    assert_bitwise_equal(got, a @ w, f"prepacked expert matmul vs a @ w (m{m} k{k} n{n}, {layout})")
