"""Grouped matmul and SwiGLU: the expert FFN of Qwen3-MoE (spec npu_ops_moe §8, §9).

    h = npu_grouped_matmul([x], [w13], group_list=tok, group_type=0, group_list_type=1, split_item=3)[0]
    h = npu_swiglu(h)
    y = npu_grouped_matmul([h], [w2], group_list=tok, group_type=0, group_list_type=1, split_item=3)[0]

Numerics (spec §0): upcast to fp32, one fp32 matmul (+ bias) per group, round once to the output dtype.
MX modes (spec mx_quant.md §6.6, selected by per_token_scale_dtype / scale_dtype == 293): W4A8 (MXFP8 x,
MXFP4 weight, weight scale in antiquant_scale), MXFP8 W8A8 and A4W4 (weight scale in scale); both operands are
dequantized to fp32, then one fp32 matmul per group. Other quantized modes (int8 scale/offset, antiquant
without MX, act_type) raise NotImplementedError; `tuning_config` is a tiling hint and is ignored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import batch_invariant, cpu_gemm, mx_format as mxf
from .formats import check_nz_read, nz_operand
from .mx import check_mx_scale, mx_operand_format, mx_output_dtype
from .registry import register
from .validation import check, check_dim, check_dtype, check_npu_limit, check_shape, dtype_from_code, fail, unsupported

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Storage dtypes that only make sense for a quantized grouped matmul (int8 W8A8, fp8, packed fp4/int4).
QUANT_STORAGE_DTYPES = (torch.int8, torch.uint8, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2)
# Bias dtype the NPU kernel takes for each x dtype (spec §8.3); other float biases are a strict-mode limit.
NPU_BIAS_DTYPE = {torch.float16: torch.float16, torch.bfloat16: torch.float32, torch.float32: torch.float32}


# ---------------------------------------------------------------------------------------------------
# npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None,
#     Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None,
#     Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None,
#     Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0,
#     int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None,
#     int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None,
#     int? per_token_scale_dtype=None) -> Tensor[]
# npu_grouped_matmul.List(..., int[]? group_list=None, ..., ScalarType? output_dtype=None) -> Tensor[]
#
# Padding rule: with a single x grouped along M, rows at or past ends[-1] (Σ group_list < M, spec §13.12)
# belong to no group and are written as 0 in the concatenated output (split_item 2/3).
# ---------------------------------------------------------------------------------------------------
OP = "npu_grouped_matmul"
OP_LIST = "npu_grouped_matmul.List"


def _reject_quant(op: str, act_type, **args) -> None:
    for name, value in args.items():
        if value is not None:
            unsupported(op, f"{name} (quantized grouped matmul belongs to the MX/W4A8 family)")
    if act_type not in (None, 0):
        unsupported(op, f"act_type={act_type} (fused activation exists only for per-token quantization)")


def _out_dtype(op: str, x0: torch.Tensor, output_dtype) -> torch.dtype:
    if output_dtype is None:
        return x0.dtype
    dtype = output_dtype if isinstance(output_dtype, torch.dtype) else dtype_from_code(op, "output_dtype", output_dtype)
    check(
        dtype == x0.dtype,
        op,
        f"output_dtype is {dtype}; expected {x0.dtype} (x[0].dtype) for a non-quantized grouped matmul",
    )
    return dtype


def _check_x_weight_dtypes(op: str, x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor]) -> None:
    check(len(x) >= 1, op, "x must be a non-empty tensor list; got []")
    check(len(weight) >= 1, op, "weight must be a non-empty tensor list; got []")
    for name, tensors in (("x", x), ("weight", weight)):
        for i, t in enumerate(tensors):
            if t.dtype in QUANT_STORAGE_DTYPES:
                unsupported(op, f"{name}[{i}] dtype {t.dtype} (quantized grouped matmul belongs to the MX/W4A8 family)")
            check_dtype(op, f"{name}[{i}]", t, FLOAT_DTYPES)
            check(t.dtype == x[0].dtype, op, f"{name}[{i}] has dtype {t.dtype}; expected {x[0].dtype} (x[0].dtype)")
    check_npu_limit(
        len(x) <= 128 and len(weight) <= 128, op, f"len(x)={len(x)}, len(weight)={len(weight)}; at most 128 each"
    )
    for name, tensors in (("x", x), ("weight", weight)):
        for i, t in enumerate(tensors):
            check_npu_limit(
                t.dim() == 0 or t.shape[-1] < 65536,
                op,
                f"{name}[{i}] last dim is {t.shape[-1] if t.dim() else None}; must be < 65536",
            )


class _StackedGroups(Sequence):
    """The groups of one 3-D weight [G, K, N] as a sequence of [K, N] views, each made when it is read: a decode
    step routes to a few of many experts, and viewing every group on every call was a large part of its cost."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __len__(self) -> int:
        return self.weight.shape[0]

    def __getitem__(self, g):
        if isinstance(g, slice):
            return [self.weight[i] for i in range(*g.indices(len(self)))]
        return self.weight[g]


def _weights(op: str, weight: Sequence[torch.Tensor]) -> tuple[Sequence[torch.Tensor], bool]:
    """Ws (logical [K, N] per group; transposed views welcome) and whether weight was one 3-D tensor."""
    if len(weight) == 1 and weight[0].dim() == 3:
        check_npu_limit(weight[0].shape[0] <= 1024, op, f"weight[0] has {weight[0].shape[0]} groups; at most 1024")
        return _StackedGroups(weight[0]), True
    for i, w in enumerate(weight):
        check(
            w.dim() == 2,
            op,
            f"weight[{i}] has shape {tuple(w.shape)}; expected one 3-D weight [G, K, N] "
            f"or a list of 2-D weights [K, N]",
        )
    return list(weight), False


def _biases(op: str, bias, weight, Ws, single_3d: bool, out_dtype: torch.dtype) -> list:
    """Bs: one [N_g] bias (or None) per group. A single 3-D weight also takes bias=[b] with b [G, N] (spec §13.13)."""
    G = len(Ws)
    if bias is None:
        return [None] * G
    for i, b in enumerate(bias):
        check_dtype(op, f"bias[{i}]", b, (out_dtype, torch.float32))
        check_npu_limit(
            b.dtype == NPU_BIAS_DTYPE[out_dtype],
            op,
            f"bias[{i}] has dtype {b.dtype}; the NPU takes {NPU_BIAS_DTYPE[out_dtype]} for {out_dtype}",
        )
    if single_3d and len(bias) == 1 and bias[0].dim() == 2:
        check_shape(op, "bias[0]", bias[0], (G, weight[0].shape[-1]))
        return list(bias[0].unbind(0))
    check(
        len(bias) == G,
        op,
        f"bias has {len(bias)} tensors; expected {G} (one per group)"
        + (f" or one [{G}, N] tensor" if single_3d else ""),
    )
    for i, (b, w) in enumerate(zip(bias, Ws)):
        check_shape(op, f"bias[{i}]", b, (w.shape[-1],))
    return list(bias)


def _mm(a: torch.Tensor, w: torch.Tensor, b, out_dtype: torch.dtype) -> torch.Tensor:
    if a.shape[0] == 0:  # an empty group: no rows to compute, so never touch (upcast) its weight
        return a.new_empty((*a.shape[:-1], w.shape[-1]), dtype=out_dtype)
    if batch_invariant.enabled() and a.dim() == 2 and a.device.type == "cpu" and (a.shape[0] > 1 or a.data_ptr() % 64):
        return batch_invariant.by_row(_mm, a, w, b, out_dtype)  # each row alone, aligned, whatever the group's size
    if b is None and a.device.type == "cpu" and a.dtype in (torch.bfloat16, torch.float16) and out_dtype == a.dtype:
        # CPU 16-bit GEMMs accumulate in fp32 and round once: the same single rounding, without materializing
        # an fp32 copy of every routed expert's weight on each call (the decode bottleneck otherwise). bf16: on
        # oneDNN's prepacked copy of the expert's [N, K] weight, bitwise `a @ w` and ~2x faster as a GEMV (cpu_gemm).
        return cpu_gemm.linear(a, w.t()) if cpu_gemm.packable(a, w) else a @ w
    y = a.float() @ w.float()
    if b is not None:
        y = y + b.float()
    return y.to(out_dtype)


def _check_nz_weights(op: str, weight) -> None:
    """NZ weights read by the NZ rules (formats.py): whole (as cast or transposed), as their own dtype."""
    for i, w in enumerate(weight):
        check_nz_read(op, f"weight[{i}]", nz_operand(op, f"weight[{i}]", w))


def _check_k(op: str, name: str, a: torch.Tensor, w: torch.Tensor, g: int) -> None:
    check(
        a.shape[-1] == w.shape[0],
        op,
        f"{name} has K={a.shape[-1]} (shape {tuple(a.shape)}) but weight group {g} has K={w.shape[0]} "
        f"(logical [K, N] = {tuple(w.shape)})",
    )


def _plan(op: str, x, weight, bias, n_list: int | None, split_item, group_type, output_dtype):
    """Static validation shared by the eager and the fake kernels. Returns (mode, Ws, Bs, out_dtype).

    mode: 'none' (group_type -1), 'm_single' (one x split along M by group_list), 'm_multi' (one x per
    group), 'k' (group_type 2). n_list is len(group_list) or None when group_list is absent.
    """
    _check_x_weight_dtypes(op, x, weight)
    out_dtype = _out_dtype(op, x[0], output_dtype)
    check(split_item in (0, 1, 2, 3), op, f"split_item={split_item}; allowed: 0, 1, 2, 3")
    Ws, single_3d = _weights(op, weight)
    G = len(Ws)
    check_npu_limit(single_3d or G <= 128, op, f"{G} weights in the list; at most 128")

    if group_type == -1:
        check(n_list is None, op, "group_list must be None with group_type=-1 (no grouping)")
        check(split_item in (0, 1), op, f"split_item={split_item} with group_type=-1; allowed: 0, 1 (one output per x)")
        check(len(x) == G, op, f"len(x)={len(x)} but there are {G} weight groups; group_type=-1 needs one x per weight")
        for g, (a, w) in enumerate(zip(x, Ws)):
            check(2 <= a.dim() <= 6, op, f"x[{g}] has shape {tuple(a.shape)}; expected 2 to 6 dims")
            _check_k(op, f"x[{g}]", a, w, g)
        return "none", Ws, _biases(op, bias, weight, Ws, single_3d, out_dtype), out_dtype

    if group_type == 2:
        check(n_list is not None, op, "group_type=2 (group along K) needs a group_list")
        check(
            len(x) == 1 and len(weight) == 1 and weight[0].dim() == 2,
            op,
            f"group_type=2 needs one x [M, K] and one 2-D weight [K, N]; got {len(x)} x and weight shapes "
            f"{[tuple(w.shape) for w in weight]}",
        )
        check(n_list >= 1, op, "group_list is empty; group_type=2 needs at least one group")
        check(bias is None, op, "bias is not supported with group_type=2 (undocumented; spec §13.15)")
        check_dim(op, "x[0]", x[0], (2,))
        _check_k(op, "x[0]", x[0], weight[0], 0)
        return "k", [weight[0]] * n_list, [None] * n_list, out_dtype

    check(group_type == 0, op, f"group_type={group_type}; allowed: -1 (none), 0 (group along M), 2 (group along K)")
    for i, a in enumerate(x):
        check_dim(op, f"x[{i}]", a, (2,))
    Bs = _biases(op, bias, weight, Ws, single_3d, out_dtype)
    if split_item in (2, 3) and not single_3d:
        check(
            all(w.shape[-1] == Ws[0].shape[-1] for w in Ws),
            op,
            f"split_item={split_item} concatenates the outputs, so every group needs the same N; "
            f"got {[w.shape[-1] for w in Ws]}",
        )
    if n_list is not None:
        check(n_list == G, op, f"group_list has {n_list} entries; expected {G} (one per weight group)")
    if n_list is not None and len(x) == 1:
        for g, w in enumerate(Ws[:1] if single_3d else Ws):  # one 3-D weight: every group has its K
            _check_k(op, "x[0]", x[0], w, g)
        return "m_single", Ws, Bs, out_dtype
    check(
        len(x) == G,
        op,
        f"len(x)={len(x)} but there are {G} weight groups; with several x (or no group_list) "
        f"group_type=0 needs one x per group",
    )
    for g, (a, w) in enumerate(zip(x, Ws)):
        _check_k(op, f"x[{g}]", a, w, g)
    return "m_multi", Ws, Bs, out_dtype


def _ends_from_tensor(op: str, group_list: torch.Tensor, group_list_type) -> list[int]:
    """Resolve a Tensor group_list to cumulative ends (spec §8.1)."""
    check_dtype(op, "group_list", group_list, (torch.int64,))
    if group_list_type == 2:
        fail(
            op,
            "group_list_type=2 ((group_id, size) pairs) is documented for int8 (quantized) x only; "
            "the non-quantized grouped matmul takes 0 (cumsum) or 1 (count)",
        )
    check(group_list_type in (0, 1), op, f"group_list_type={group_list_type}; allowed: 0 (cumsum), 1 (count)")
    check_dim(op, "group_list", group_list, (1,))
    values = group_list.tolist()
    if group_list_type == 1:
        bad = [v for v in values if v < 0]
        check(not bad, op, f"group_list (group_list_type=1, counts) must be >= 0; got {values}")
        ends, total = [], 0
        for v in values:
            total += v
            ends.append(total)
        return ends
    _check_cumsum(op, "group_list (group_list_type=0, cumsum)", values)
    return values


def _check_cumsum(op: str, name: str, values: list[int]) -> None:
    check(all(v >= 0 for v in values), op, f"{name} must be non-negative; got {values}")
    check(all(a <= b for a, b in zip(values, values[1:])), op, f"{name} must be non-decreasing; got {values}")


def _run(op: str, mode: str, x, Ws, Bs, ends, split_item: int, out_dtype: torch.dtype) -> list[torch.Tensor]:
    if mode == "none":
        return [_mm(a, w, b, out_dtype) for a, w, b in zip(x, Ws, Bs)]

    if mode == "k":
        X, W = x[0], Ws[0]
        check(
            not ends or ends[-1] <= X.shape[1],
            op,
            f"group_list ends at {ends[-1] if ends else 0} but x[0] has K={X.shape[1]} columns",
        )
        starts = [0] + ends[:-1]
        ys = [_mm(X[:, s:e], W[s:e], None, out_dtype) for s, e in zip(starts, ends)]
        return [torch.stack(ys)] if split_item in (2, 3) else ys

    if mode == "m_single":
        X = x[0]
        M = X.shape[0]
        check(not ends or ends[-1] <= M, op, f"group_list sums to {ends[-1] if ends else 0} rows but x[0] has M={M}")
        starts = [0] + ends[:-1]
        pieces = [X[s:e] for s, e in zip(starts, ends)]
    else:  # m_multi
        pieces, M = list(x), sum(a.shape[0] for a in x)
        if ends is not None:
            sizes = [e - s for s, e in zip([0] + ends[:-1], ends)]
            check(
                sizes == [a.shape[0] for a in x],
                op,
                f"group_list sizes {sizes} must equal the row counts of x {[a.shape[0] for a in x]}",
            )

    ys = [_mm(a, w, b, out_dtype) for a, w, b in zip(pieces, Ws, Bs)]
    if split_item in (0, 1):
        return ys
    Y = torch.zeros(M, Ws[0].shape[-1], dtype=out_dtype, device=x[0].device)  # tail rows stay 0
    row = 0
    for y in ys:
        Y[row : row + y.shape[0]] = y
        row += y.shape[0]
    return [Y]


def _run_stacked(op: str, X: torch.Tensor, W: torch.Tensor, Bs, ends: list[int], out_dtype: torch.dtype):
    """Fast path of `_run` for one x grouped along M by one 3-D weight [G, K, N] with concatenated output (the
    MoE experts' call): only the non-empty groups are visited, each with the same `_mm` as `_run`, so the result
    is bit-identical (equivalence/ops/test_ops_gmm.py proves it); a decode step routes a few rows to few of many
    experts, where `_run`'s per-group slicing of every weight and row range is most of the time."""
    M = X.shape[0]
    check(not ends or ends[-1] <= M, op, f"group_list sums to {ends[-1] if ends else 0} rows but x[0] has M={M}")
    if (
        all(b is None for b in Bs)
        and out_dtype == X.dtype
        and M > 0
        and not W.is_inference()
        and cpu_gemm.packable(X, W[0])
        and not batch_invariant.enabled()
    ):
        return [cpu_gemm.grouped_linear(X, W, ends)]  # what _mm does per group, with one cache lookup per call
    if cpu_gemm.wants_k_major(X, W) and not W.is_inference():
        # An NZ-cast [G, K, N] weight is row-major on the CPU, where a 16-bit GEMM without oneDNN is several times
        # slower than on K-contiguous rows: read it from the K-major copy made on first use (the ND layout).
        W = cpu_gemm.k_major(W)
    Y = torch.empty(M, W.shape[-1], dtype=out_dtype, device=X.device)
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            Y[start:end] = _mm(X[start:end], W[g], Bs[g], out_dtype)
        start = end
    Y[start:] = 0  # rows past the last group (spec §13.12)
    return [Y]


def _tensor_plan(x, weight, bias, group_list, split_item, group_type, act_type, output_dtype, quant_args):
    """Validation shared by the kernel and the fake kernel of the Tensor-group_list overload."""
    _reject_quant(OP, act_type, **quant_args)
    check(group_type is not None, OP, "group_type is None: Requires manual passing group_type (-1, 0 or 2)")
    n_list = None if group_list is None else (group_list.shape[0] if group_list.dim() >= 1 else 1)
    return _plan(OP, x, weight, bias, n_list, split_item, group_type, output_dtype)


# --- MX modes (spec mx_quant.md §6.6) ---------------------------------------------------------------------
# y[m, n] = Σ_k (x[m,k] 2^(xs[m, k//64, (k//32)%2] - 127)) (w[e,k,n] 2^(ws[e, k//64, n, (k//32)%2] - 127)), rows of
# expert e(m); fp32 accumulation, rounded once to output_dtype (None -> bfloat16). Rows past the last group: 0.
# W4A8:   x fp8 [M, K], weight uint8 [E, K/2, N] (weight_dtype=296; a transposed view of [E, N, K/2]),
#         antiquant_scale=[ws [E, ceil(K/64), N, 2]] read as E8M0 bytes, per_token_scale=[xs [M, ceil(K/64), 2]].
# MXFP8:  x fp8, weight fp8 [E, K, N], scale=[ws], scale_dtype=293.
# A4W4:   x uint8 [M, K/2] (x_dtype=296), weight uint8 [E, K, N/2] (weight_dtype=296), scale=[ws], scale_dtype=293.
_MX_UNUSED = ("offset", "antiquant_offset", "activation_input", "activation_quant_scale", "activation_quant_offset")


def _is_mx(quant_args) -> bool:
    return mxf.float8_e8m0fnu in (quant_args.get("per_token_scale_dtype"), quant_args.get("scale_dtype"))


def _one(op: str, name: str, tensors):
    check(
        tensors is not None and len(tensors) == 1,
        op,
        f"{name} must be a list of one tensor in MX mode; got {None if tensors is None else len(tensors)}",
    )
    return tensors[0]


def _mx_plan(x, weight, bias, group_list, split_item, group_type, act_type, output_dtype, q):
    """Validation shared by the MX kernel and its fake. Returns (fx, fw, K, N, xs, ws, out_dtype)."""
    op = OP
    check(
        group_type == 0 and split_item in (2, 3),
        op,
        f"MX mode takes group_type=0 with split_item 2 or 3; got group_type={group_type}, split_item={split_item}",
    )
    check(group_list is not None, op, "MX mode needs a group_list (one entry per expert)")
    check(bias is None, op, "bias must be None in MX mode")
    check(act_type in (None, 0), op, f"act_type={act_type}; MX mode takes 0")
    for name in _MX_UNUSED:
        check(q.get(name) is None, op, f"{name} must be None in MX mode")
    check(
        q.get("per_token_scale_dtype") == mxf.float8_e8m0fnu,
        op,
        f"per_token_scale_dtype={q.get('per_token_scale_dtype')} in MX mode; allowed: 293 (float8_e8m0fnu)",
    )
    if q.get("scale") is not None:
        check(
            q.get("scale_dtype") == mxf.float8_e8m0fnu and q.get("antiquant_scale") is None,
            op,
            f"MX weight scale in `scale` needs scale_dtype=293 and no antiquant_scale; got "
            f"scale_dtype={q.get('scale_dtype')}",
        )
        ws = _one(op, "scale", q["scale"])
    else:
        check(q.get("scale_dtype") is None, op, f"scale_dtype={q.get('scale_dtype')} without a scale")
        ws = _one(op, "antiquant_scale (the W4A8 weight scale)", q.get("antiquant_scale"))
    a, w = _one(op, "x", x), _one(op, "weight", weight)
    xs = _one(op, "per_token_scale", q.get("per_token_scale"))
    fx = mx_operand_format(op, "x[0]", a, "x_dtype", q.get("x_dtype"))
    fw = mx_operand_format(op, "weight[0]", w, "weight_dtype", q.get("weight_dtype"))
    check(a.dim() == 2, op, f"x[0] must be [M, K]; got shape {tuple(a.shape)}")
    check(w.dim() == 3, op, f"weight[0] must be one [E, K, N] tensor in MX mode; got shape {tuple(w.shape)}")
    k = a.shape[1] * (2 if fx.packed else 1)
    if fw.packed:
        axis = mxf.fp4_packed_axis(w.shape, k)
        check(
            axis is not None,
            op,
            f"weight[0] has shape {tuple(w.shape)}; FP4 expects [E, K/2, N] (packed along "
            f"K) or [E, K, N/2] (packed along N) with K={k} from x[0]",
        )
        n = w.shape[2] * (2 if axis == -1 else 1)
    else:
        check(w.shape[1] == k, op, f"weight[0] has shape {tuple(w.shape)}; expected [E, K={k}, N]")
        n = w.shape[2]
    kb = math.ceil(k / 64)
    check_mx_scale(op, "per_token_scale[0]", xs, (a.shape[0], kb, 2))
    check_mx_scale(op, "weight scale", ws, (w.shape[0], kb, n, 2))
    n_list = group_list.shape[0] if group_list.dim() >= 1 else 1
    check(n_list == w.shape[0], op, f"group_list has {n_list} entries; expected {w.shape[0]} (one per expert)")
    _check_mx_limits(op, a, w)
    return fx, fw, k, n, xs, ws, mx_output_dtype(op, "output_dtype", output_dtype, 15)


def _check_mx_limits(op: str, a: torch.Tensor, w: torch.Tensor) -> None:
    """The grouped matmul's NPU limits (spec npu_ops_moe.md §8.5) hold in the MX modes too: one 3-D weight of at most
    1024 groups, and every x / weight last dim (as stored: packed FP4 counts bytes) below 65536."""
    check_npu_limit(w.shape[0] <= 1024, op, f"weight[0] has {w.shape[0]} groups; at most 1024")
    for name, t in (("x[0]", a), ("weight[0]", w)):
        check_npu_limit(t.shape[-1] < 65536, op, f"{name} last dim is {t.shape[-1]}; must be < 65536")


def _mx_grouped_matmul(
    x, weight, bias, group_list, split_item, group_type, group_list_type, act_type, output_dtype, quant_args
):
    fx, fw, k, n, xs, ws, out_dtype = _mx_plan(
        x, weight, bias, group_list, split_item, group_type, act_type, output_dtype, quant_args
    )
    ends = _ends_from_tensor(OP, group_list, group_list_type)
    a, w = x[0], weight[0]
    fp4_axis = mxf.fp4_packed_axis(w.shape, k) if fw.packed else None
    check_nz_read(OP, "weight[0]", nz_operand(OP, "weight[0]", w), fp4_axis)  # an NZ weight read by the NZ rules
    m = a.shape[0]
    check(not ends or ends[-1] <= m, OP, f"group_list sums to {ends[-1] if ends else 0} rows but x[0] has M={m}")
    xd = mxf.dequantize(a, xs, fx)  # [M, K] fp32
    y = torch.zeros(m, n, dtype=out_dtype, device=a.device)  # rows past the last group stay 0
    for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        if end > start:  # an empty expert's weight is never decoded
            y[start:end] = (xd[start:end] @ mxf.dequantize_weight(w[e], ws[e], fw, k)).to(out_dtype)
    return [y]


# The quantization arguments of the schema (scale, offset, antiquant_*, per_token_scale, activation_*,
# x/weight/scale/per_token_scale dtypes) arrive in **quant_args; outside the MX modes any of them set is rejected.
def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    group_list=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    tuning_config=None,
    output_dtype=None,
    **quant_args,
):
    op = OP
    if _is_mx(quant_args):
        return _mx_grouped_matmul(
            x, weight, bias, group_list, split_item, group_type, group_list_type, act_type, output_dtype, quant_args
        )
    mode, Ws, Bs, out_dtype = _tensor_plan(
        x, weight, bias, group_list, split_item, group_type, act_type, output_dtype, quant_args
    )
    _check_nz_weights(op, weight)
    ends = None if group_list is None else _ends_from_tensor(op, group_list, group_list_type)
    if mode == "m_single" and split_item in (2, 3) and len(weight) == 1 and weight[0].dim() == 3:
        return _run_stacked(op, x[0], weight[0], Bs, ends, out_dtype)
    # split_item 0/1 with a count group_list: the C++ sizes outputs from raw value differences (right only
    # for cumsum); the golden uses the resolved ends for both types (spec §13.14).
    return _run(op, mode, x, Ws, Bs, ends, split_item, out_dtype)


def _npu_grouped_matmul_fake(
    x,
    weight,
    *,
    bias=None,
    group_list=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    tuning_config=None,
    output_dtype=None,
    **quant_args,
):
    if _is_mx(quant_args):
        _, _, _, n, _, _, out_dtype = _mx_plan(
            x, weight, bias, group_list, split_item, group_type, act_type, output_dtype, quant_args
        )
        return [x[0].new_empty((x[0].shape[0], n), dtype=out_dtype)]
    mode, Ws, _, out_dtype = _tensor_plan(
        x, weight, bias, group_list, split_item, group_type, act_type, output_dtype, quant_args
    )
    if mode == "m_single" and split_item in (0, 1):
        # Per-group row counts live in group_list's values: data-dependent sizes.
        ctx = torch.library.get_ctx()
        rows = [
            ctx.new_dynamic_size(min=0, max=int(x[0].shape[0]))
            if isinstance(x[0].shape[0], int)
            else ctx.new_dynamic_size()
            for _ in Ws
        ]
        return [x[0].new_empty((r, w.shape[-1]), dtype=out_dtype) for r, w in zip(rows, Ws)]
    return _fake_outputs(mode, x, Ws, split_item, out_dtype)


def _fake_outputs(mode, x, Ws, split_item, out_dtype, rows=None):
    """Output shapes that do not depend on group_list values (or use the given static per-group rows)."""
    if mode == "none":
        return [a.new_empty((*a.shape[:-1], w.shape[-1]), dtype=out_dtype) for a, w in zip(x, Ws)]
    if mode == "k":
        M, N = x[0].shape[0], Ws[0].shape[-1]
        if split_item in (2, 3):
            return [x[0].new_empty((len(Ws), M, N), dtype=out_dtype)]
        return [x[0].new_empty((M, N), dtype=out_dtype) for _ in Ws]
    if mode == "m_single":
        if split_item in (2, 3):
            return [x[0].new_empty((x[0].shape[0], Ws[0].shape[-1]), dtype=out_dtype)]
        return [x[0].new_empty((r, w.shape[-1]), dtype=out_dtype) for r, w in zip(rows, Ws)]
    if split_item in (2, 3):
        return [x[0].new_empty((sum(a.shape[0] for a in x), Ws[0].shape[-1]), dtype=out_dtype)]
    return [a.new_empty((a.shape[0], w.shape[-1]), dtype=out_dtype) for a, w in zip(x, Ws)]


def _list_plan(x, weight, bias, group_list, split_item, group_type, group_list_type, output_dtype):
    op = OP_LIST
    check(
        group_type is None,
        op,
        f"group_type={group_type}; the List overload takes group_type=None (it always groups along M)",
    )
    check(
        group_list_type in (None, 0),
        op,
        f"group_list_type={group_list_type}; the List overload takes 0 only (cumulative ends)",
    )
    if group_list is not None:
        values = list(group_list)
        check(len(values) != 1, op, f"group_list={values} has length 1; the List overload needs 0 or >= 2 entries")
        _check_cumsum(op, "group_list (cumulative ends)", values)
    mode, Ws, Bs, out_dtype = _plan(
        op, x, weight, bias, None if group_list is None else len(group_list), split_item, 0, output_dtype
    )
    if group_list is not None and mode == "m_single":
        M = x[0].shape[0]
        check(group_list[-1] <= M, op, f"group_list ends at {group_list[-1]} but x[0] has M={M} rows")
        check(
            split_item in (0, 1) or len(Ws) == 1 or group_list[-1] == M,
            op,
            f"group_list ends at {group_list[-1]} but x[0] has M={M} rows; with one x, several weights and "
            f"split_item={split_item} they must be equal",
        )
    return mode, Ws, Bs, out_dtype


def npu_grouped_matmul_list(
    x,
    weight,
    *,
    bias=None,
    group_list=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    output_dtype=None,
    **quant_args,
):
    _reject_quant(OP_LIST, act_type, **quant_args)
    mode, Ws, Bs, out_dtype = _list_plan(
        x, weight, bias, group_list, split_item, group_type, group_list_type, output_dtype
    )
    _check_nz_weights(OP_LIST, weight)
    ends = None if group_list is None else list(group_list)
    return _run(OP_LIST, mode, x, Ws, Bs, ends, split_item, out_dtype)


def _npu_grouped_matmul_list_fake(
    x,
    weight,
    *,
    bias=None,
    group_list=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    output_dtype=None,
    **quant_args,
):
    _reject_quant(OP_LIST, act_type, **quant_args)
    mode, Ws, _, out_dtype = _list_plan(
        x, weight, bias, group_list, split_item, group_type, group_list_type, output_dtype
    )
    rows = None
    if group_list is not None:  # int[] values are static: the row counts are known at trace time
        rows = [e - s for s, e in zip([0] + list(group_list[:-1]), group_list)]
    return _fake_outputs(mode, x, Ws, split_item, out_dtype, rows)


register("npu_grouped_matmul", npu_grouped_matmul, _npu_grouped_matmul_fake)
register("npu_grouped_matmul.List", npu_grouped_matmul_list, _npu_grouped_matmul_list_fake)


# ---------------------------------------------------------------------------------------------------
# npu_swiglu(Tensor self, int dim=-1) -> Tensor
#
# Halves rule: a, b = self.chunk(2, dim) with a = the FIRST half (gate) and b = the second (up):
# out = silu(a) * b, computed in fp32 and rounded once to self.dtype.
# ---------------------------------------------------------------------------------------------------
OP_SWIGLU = "npu_swiglu"


def _swiglu_check(x: torch.Tensor, dim: int) -> int:
    op = OP_SWIGLU
    check_dtype(op, "self", x, FLOAT_DTYPES)
    check(
        -x.dim() <= dim < x.dim(),
        op,
        f"dim={dim} is out of range for self of shape {tuple(x.shape)} (allowed [{-x.dim()}, {x.dim() - 1}])",
    )
    dim = dim % x.dim()
    check(
        x.shape[dim] % 2 == 0,
        op,
        f"self has odd size {x.shape[dim]} along dim={dim} (shape {tuple(x.shape)}); "
        f"it must split into two equal halves",
    )
    check_npu_limit(1 <= x.dim() <= 8, op, f"self has {x.dim()} dims; the NPU takes 1 to 8")
    check_npu_limit(x.numel() > 0, op, f"self is empty (shape {tuple(x.shape)})")
    return dim


def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    dim = _swiglu_check(self, dim)
    a, b = self.float().chunk(2, dim)
    return (a * torch.sigmoid(a) * b).to(self.dtype)


def _npu_swiglu_fake(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    dim = _swiglu_check(self, dim)
    shape = list(self.shape)
    shape[dim] = shape[dim] // 2
    return self.new_empty(shape)


register("npu_swiglu", npu_swiglu, _npu_swiglu_fake, traceable=npu_swiglu)
