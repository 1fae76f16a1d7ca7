"""MoE routing family: gating top-k softmax, init_routing (v1, v2), compute_expert_tokens, finalize_routing,
re_routing. Contract: spec npu_ops_moe.md §2-§7.

Every op has, together: its schema name, the metadata checks (shared by the eager and the fake kernel), the data
checks (eager only: they read values), the kernel and the fake kernel. Row movement is bit-exact: payloads are
viewed as same-width integers before any gather/scatter, so fp8 bytes viewed as bf16 (NaN patterns included)
survive. Regions the NPU leaves unwritten are written deterministically (0 for data, the stated index values).
"""

from __future__ import annotations

import torch

from .registry import register
from .validation import (
    DIMS,
    FP32,
    check,
    check_dim,
    check_dtype,
    check_npu_limit,
    check_rows_and_ids,
    check_shape,
    dtype_from_code,
    unsupported,
)

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """Same storage viewed as a same-width integer type: gathers on it can never touch a float's bits."""
    return t.view(_INT_OF_WIDTH[t.element_size()]) if t.dtype != torch.bool else t


def _gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """src[index] along dim 0, bit-exact for every dtype."""
    return _as_bits(src).index_select(0, index.long()).view(src.dtype)


def _zeros_like_rows(src: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, *src.shape[1:]] of all-zero bits (0 in every float format) in src's dtype."""
    bits = torch.zeros((rows, *src.shape[1:]), dtype=_INT_OF_WIDTH[src.element_size()], device=src.device)
    return bits.view(src.dtype)


def _exclusive_cumsum(t: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(t, 0) - t


# ==================================================================================================
# npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor, Tensor)   §2
# Tie rule: stable descending sort of the fp32 probabilities, so equal probabilities go to the lower expert id.
# Padding rule: none (no unspecified region); finished rows get expert id E, their y is left unchanged.
# ==================================================================================================
_GATING = "npu_moe_gating_top_k_softmax"


def _gating_check(x, finished, k):
    check_dim(_GATING, "x", x, (2, 3))
    check_dtype(_GATING, "x", x, _FLOATS)
    num_experts = x.shape[-1]
    check(0 <= k <= num_experts, _GATING, f"k={k} must satisfy 0 <= k <= E={num_experts} (x.shape[-1])")
    if finished is not None:
        check_dtype(_GATING, "finished", finished, (torch.bool,))
        check_shape(_GATING, "finished", finished, tuple(x.shape[:-1]))
    check_npu_limit(k <= 1024, _GATING, f"k={k} must be <= 1024")
    check_npu_limit(num_experts <= 2048, _GATING, f"E={num_experts} must be <= 2048")


def moe_gating_top_k_softmax(x, finished=None, k=1):
    _gating_check(x, finished, k)
    lead, num_experts = tuple(x.shape[:-1]), x.shape[-1]
    n = 1
    for d in lead:  # flatten the leading dims: N = B*S for 3-D input (spec §2 ambiguity)
        n *= d
    out_shape = lead + (k,)
    row_idx = torch.arange(n * k, dtype=torch.int32, device=x.device).reshape(k, n).t().contiguous()
    if k == 0 or n == 0:
        return (
            x.new_zeros(out_shape),
            torch.zeros(out_shape, dtype=torch.int32, device=x.device),
            row_idx.reshape(out_shape),
        )
    probs = torch.softmax(x.reshape(n, num_experts).float(), dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    y = probs.gather(-1, order).to(x.dtype)
    expert_idx = order.to(torch.int32)
    if finished is not None:
        expert_idx = torch.where(finished.reshape(n, 1), torch.full_like(expert_idx, num_experts), expert_idx)
    return y.reshape(out_shape), expert_idx.reshape(out_shape), row_idx.reshape(out_shape)


def _gating_fake(x, finished=None, k=1):
    _gating_check(x, finished, k)
    out_shape = tuple(x.shape[:-1]) + (k,)
    return (
        x.new_empty(out_shape),
        x.new_empty(out_shape, dtype=torch.int32),
        x.new_empty(out_shape, dtype=torch.int32),
    )


register(_GATING, moe_gating_top_k_softmax, _gating_fake, traceable=moe_gating_top_k_softmax)


# ==================================================================================================
# npu_moe_init_routing(Tensor x, Tensor row_idx, Tensor expert_idx, int active_num) -> (Tensor, Tensor, Tensor)  §3
# Tie rule: stable sort by expert id over flat slot position f = i*K + j (within an expert: ascending token, then j),
#           not by row_idx value (spec §3 ambiguity: follow the test golden).
# Padding rule: none; expanded_x holds min(N, active_num)*K rows, all valid (active_num counts tokens).
# ==================================================================================================
_V1 = "npu_moe_init_routing"


def _v1_check(x, row_idx, expert_idx, active_num):
    check_dim(_V1, "x", x, (2,))
    check_dtype(_V1, "x", x, _FLOATS)
    check_dim(_V1, "row_idx", row_idx, (2,))
    check_dim(_V1, "expert_idx", expert_idx, (2,))
    check_dtype(_V1, "row_idx", row_idx, (torch.int32,))
    check_dtype(_V1, "expert_idx", expert_idx, (torch.int32,))
    check_shape(_V1, "row_idx", row_idx, tuple(expert_idx.shape))
    check(
        x.shape[0] == expert_idx.shape[0],
        _V1,
        f"x has {x.shape[0]} rows but expert_idx has {expert_idx.shape[0]}; they must match",
    )
    check(active_num >= 0, _V1, f"active_num={active_num} must be >= 0")
    check_npu_limit(x.numel() < 2**24, _V1, f"x.numel()={x.numel()} must be < 2^24")


def moe_init_routing(x, row_idx, expert_idx, active_num):
    _v1_check(x, row_idx, expert_idx, active_num)
    n, k = expert_idx.shape
    nk = n * k
    flat_rows = row_idx.reshape(-1)
    if nk:
        check(
            bool((flat_rows >= 0).all())
            and bool((flat_rows < nk).all())
            and int(torch.bincount(flat_rows.long(), minlength=nk).max()) == 1,
            _V1,
            f"row_idx must be a permutation of [0, N*K={nk})",
        )
    flat_e = expert_idx.reshape(-1)
    perm = torch.sort(flat_e, stable=True).indices
    expanded_expert_idx = flat_e.index_select(0, perm)
    dst2src = flat_rows.index_select(0, perm).long()
    expanded_row_idx = torch.empty(nk, dtype=torch.int32, device=x.device)
    expanded_row_idx[dst2src] = torch.arange(nk, dtype=torch.int32, device=x.device)
    rows = min(n, active_num) * k
    expanded_x = _gather_rows(x, dst2src[:rows] % max(n, 1))
    return expanded_x, expanded_row_idx, expanded_expert_idx


def _v1_fake(x, row_idx, expert_idx, active_num):
    _v1_check(x, row_idx, expert_idx, active_num)
    n, k = expert_idx.shape
    rows = torch.sym_min(n, active_num) * k
    return (
        x.new_empty((rows, x.shape[1])),
        x.new_empty((n * k,), dtype=torch.int32),
        x.new_empty((n * k,), dtype=torch.int32),
    )


register(_V1, moe_init_routing, _v1_fake)


# ==================================================================================================
# npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, int active_num=-1,
#   int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, int expert_tokens_num_type=0,
#   bool expert_tokens_num_flag=False, int quant_mode=-1, int[2] active_expert_range=[], int row_idx_type=0,
#   int? x_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)                                           §4
# Tie rule: stable sort by key (in-range and above-range ids by id, below-range ids last) over slot f = i*K + j.
# Padding rule: rows past n_valid (dropless) / unfilled capacity slots (drop/pad) are 0, scales there 0, dropped or
#               out-of-range slots get expanded_row_idx = -1 (type 0); type 1 keeps the full stable order.
# ==================================================================================================
_V2 = "npu_moe_init_routing_v2"
_V2_X_DTYPES = _FLOATS + (torch.int8, torch.uint8, torch.float8_e5m2, torch.float8_e4m3fn)
_V2_QUANT_MODES = (-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15, 16, 17)
_X_DTYPE_CODES = (290, 291, 292, 296, 297, 23, 24)  # reinterpretations of 1-byte storage (hif8, fp8, fp4)
_FP4_CODES = (296, 297)


def _v2_resolve(
    x,
    expert_idx,
    scale,
    offset,
    active_num,
    expert_capacity,
    expert_num,
    drop_pad_mode,
    expert_tokens_num_type,
    quant_mode,
    active_expert_range,
    row_idx_type,
    x_dtype,
):
    """Metadata checks; returns (s, e, rows_out) with rows_out the dropless row count."""
    check_rows_and_ids(_V2, x, _V2_X_DTYPES, expert_idx, "expert_idx")
    check(quant_mode in _V2_QUANT_MODES, _V2, f"quant_mode={quant_mode}; allowed: {list(_V2_QUANT_MODES)}")
    if quant_mode != -1:
        unsupported(_V2, f"quant_mode={quant_mode} (only -1, no quantization, is implemented)")
    check(expert_num > 0, _V2, f"expert_num={expert_num} must be > 0 (the default -1 is invalid)")
    check(drop_pad_mode in (0, 1), _V2, f"drop_pad_mode={drop_pad_mode}; allowed: 0, 1")
    check(
        expert_tokens_num_type in (0, 1, 2),
        _V2,
        f"expert_tokens_num_type={expert_tokens_num_type}; allowed: 0 (cumsum), 1 (count), 2 (key-value)",
    )
    check(row_idx_type in (0, 1), _V2, f"row_idx_type={row_idx_type}; allowed: 0 (gather), 1 (scatter)")
    check(active_num >= -1, _V2, f"active_num={active_num} must be -1 or 0 (all) or > 0")
    rng = list(active_expert_range)
    check(len(rng) in (0, 2), _V2, f"active_expert_range={rng} must be [] or [start, end]")
    s, e = (0, expert_num) if not rng else (int(rng[0]), int(rng[1]))
    check(
        0 <= s < e <= expert_num,
        _V2,
        f"active_expert_range=[{s}, {e}] must satisfy 0 <= start < end <= expert_num={expert_num}",
    )
    check(offset is None, _V2, "offset must be None when quant_mode=-1 (it is a static-quant input)")
    if x_dtype is not None:
        check(x_dtype in _X_DTYPE_CODES, _V2, f"x_dtype={x_dtype}; allowed: None, {list(_X_DTYPE_CODES)}")
        check(
            x.element_size() == dtype_from_code(_V2, "x_dtype", x_dtype).itemsize,
            _V2,
            f"x_dtype={x_dtype} reinterprets 1-byte storage; x has dtype {x.dtype}",
        )
    n = x.shape[0]
    if scale is not None:
        check(
            scale.dim() >= 1 and scale.shape[0] == n,
            _V2,
            f"scale has shape {tuple(scale.shape)}; expected [N={n}] (or [N, ...] for MX-scaled 1-byte x)",
        )
        if scale.dim() == 1:
            check_dtype(_V2, "scale", scale, (torch.float32,))
        else:
            h = x.shape[1] * (2 if x_dtype in _FP4_CODES else 1)
            check(
                x.element_size() == 1 and drop_pad_mode == 0,
                _V2,
                f"scale of shape {tuple(scale.shape)} (MX row scales) needs a 1-byte x in dropless mode; "
                f"x has dtype {x.dtype}, drop_pad_mode={drop_pad_mode}",
            )
            check_shape(_V2, "scale", scale, (n, -(-h // 64), 2))
    if drop_pad_mode == 1:
        check(
            (s, e) == (0, expert_num),
            _V2,
            f"drop_pad_mode=1 needs the full active_expert_range [0, {expert_num}); got [{s}, {e}]",
        )
        check(row_idx_type == 0, _V2, f"drop_pad_mode=1 needs row_idx_type=0; got {row_idx_type}")
        check(
            0 < expert_capacity <= n,
            _V2,
            f"drop_pad_mode=1 needs 0 < expert_capacity <= N={n}; got expert_capacity={expert_capacity}",
        )
    check_npu_limit(
        expert_num <= (5120 if expert_tokens_num_type == 2 else 10240),
        _V2,
        f"expert_num={expert_num} exceeds the NPU cap",
    )
    nk = n * expert_idx.shape[1]
    rows_out = nk if active_num <= 0 else torch.sym_min(active_num, nk)
    return s, e, rows_out


def _v2_counts_shape(expert_num, s, e, expert_tokens_num_type):
    return (expert_num, 2) if expert_tokens_num_type == 2 else (e - s,)


def _v2_scale_shape(scale, rows):
    return (rows,) if scale is None else (rows, *scale.shape[1:])


def moe_init_routing_v2(
    x,
    expert_idx,
    *,
    scale=None,
    offset=None,
    active_num=-1,
    expert_capacity=-1,
    expert_num=-1,
    drop_pad_mode=0,
    expert_tokens_num_type=0,
    expert_tokens_num_flag=False,
    quant_mode=-1,
    active_expert_range=(),
    row_idx_type=0,
    x_dtype=None,
):
    s, e, rows_out = _v2_resolve(
        x,
        expert_idx,
        scale,
        offset,
        active_num,
        expert_capacity,
        expert_num,
        drop_pad_mode,
        expert_tokens_num_type,
        quant_mode,
        active_expert_range,
        row_idx_type,
        x_dtype,
    )
    dev = x.device
    n, k = expert_idx.shape
    nk = n * k
    ef = expert_idx.reshape(-1).long()
    # Spec §4.1: ids are in [0, expert_num]; expert_num itself is gating's "finished" marker (dropped like any
    # id outside the active range). Anything else is a caller bug: refused, never silently dropped.
    check(nk == 0 or int(ef.min()) >= 0, _V2, f"expert_idx values must be >= 0; got {int(ef.min()) if nk else 0}")
    check(
        nk == 0 or int(ef.max()) <= expert_num,
        _V2,
        f"expert_idx value {int(ef.max()) if nk else 0} is outside [0, expert_num={expert_num}] (expert_num itself "
        f"marks a finished row); pass the global expert count as expert_num",
    )
    in_range, perm, counts = _sorted_slots(ef, s, e)
    avail = int(in_range.sum())
    if expert_tokens_num_type == 1:
        tokens_out = counts
    elif expert_tokens_num_type == 0:
        tokens_out = torch.cumsum(counts, 0)
    else:  # key-value: (absolute id, count) of non-empty experts packed on top, (0, 0) terminator / fill
        tokens_out = torch.zeros((expert_num, 2), dtype=torch.int64, device=dev)
        nonzero = counts.nonzero().reshape(-1)
        tokens_out[: nonzero.numel(), 0] = nonzero + s
        tokens_out[: nonzero.numel(), 1] = counts.index_select(0, nonzero)

    if drop_pad_mode == 1:
        cap = expert_capacity
        sorted_expert = ef.index_select(0, perm[:avail])
        start = _exclusive_cumsum(counts)  # full range, so s == 0
        slot_in_expert = torch.arange(avail, device=dev) - start.index_select(0, sorted_expert)
        kept = slot_in_expert < cap  # earliest tokens of an expert win, later ones are dropped
        kept_slots = perm[:avail][kept]
        dest = sorted_expert[kept] * cap + slot_in_expert[kept]
        expanded_x = _zeros_like_rows(x, expert_num * cap)
        _as_bits(expanded_x).index_copy_(0, dest, _as_bits(_gather_rows(x, kept_slots // k)))
        expanded_x = expanded_x.reshape(expert_num, cap, x.shape[1])
        expanded_row_idx = torch.full((nk,), -1, dtype=torch.int32, device=dev)
        expanded_row_idx[kept_slots] = dest.to(torch.int32)
        expanded_scale = torch.zeros(expert_num * cap, dtype=torch.float32, device=dev)
        if scale is not None:
            _as_bits(expanded_scale).index_copy_(0, dest, _as_bits(_gather_rows(scale, kept_slots // k)))
        return expanded_x, expanded_row_idx, tokens_out, expanded_scale

    expanded_x, expanded_row_idx, expanded_scale = _dropless_rows(x, scale, perm, avail, k, rows_out, row_idx_type)
    return expanded_x, expanded_row_idx, tokens_out, expanded_scale


def _sorted_slots(ef: torch.Tensor, s: int, e: int):
    """(in_range [NK] bool, perm [NK], counts [e - s] int64) of the flat expert ids: perm[p] is the slot at sorted
    position p (in-range ids first, by id, stable), counts the slots per in-range expert (a scatter-add: no
    host-sized output, so a compiled graph can trace it)."""
    in_range = (ef >= s) & (ef < e)
    key = torch.where(ef < s, torch.iinfo(torch.int64).max, ef)
    perm = torch.sort(key, stable=True).indices
    counts = torch.zeros(e - s, dtype=torch.int64, device=ef.device).scatter_add(
        0, torch.where(in_range, ef - s, 0), in_range.long()
    )
    return in_range, perm, counts


def _dropless_rows(x, scale, perm, avail, k: int, rows_out, row_idx_type: int):
    """Dropless outputs (expanded_x, expanded_row_idx, expanded_scale) from the sorted slots. avail, the in-range
    slot count, is an int (eager) or a 0-d tensor (traced): rows and indices are masked by it, never sliced."""
    dev, nk = x.device, perm.shape[0]
    position = torch.arange(nk, device=dev)
    if row_idx_type == 0:  # slot perm[p] numbered p while p < avail, else -1
        numbered = torch.where(position < avail, position, -1).to(torch.int32)
        expanded_row_idx = torch.full((nk,), -1, dtype=torch.int32, device=dev).scatter(0, perm, numbered)
    else:
        expanded_row_idx = perm.to(torch.int32)
    src_tokens = perm[:rows_out] // max(k, 1)
    valid_row = position[:rows_out] < avail

    def rows_of(t):  # row p: t's row of sorted slot p while p < avail, else all-zero bits
        bits = _as_bits(t).index_select(0, src_tokens)
        keep = valid_row.reshape(-1, *([1] * (t.dim() - 1)))
        return torch.where(keep, bits, torch.zeros((), dtype=bits.dtype, device=dev)).view(t.dtype)

    expanded_scale = torch.zeros(rows_out, dtype=torch.float32, device=dev) if scale is None else rows_of(scale)
    return rows_of(x), expanded_row_idx, expanded_scale


def moe_init_routing_v2_traced(
    x,
    expert_idx,
    *,
    scale=None,
    offset=None,
    active_num=-1,
    expert_capacity=-1,
    expert_num=-1,
    drop_pad_mode=0,
    expert_tokens_num_type=0,
    expert_tokens_num_flag=False,
    quant_mode=-1,
    active_expert_range=(),
    row_idx_type=0,
    x_dtype=None,
):
    """The dropless kernel as a compiled graph inlines it: the same `_sorted_slots` and `_dropless_rows`, with the
    in-range count kept a tensor and without the host reads of the id range (equivalence/ops/test_ops_routing.py:
    bitwise the kernel). Drop/pad mode and key-value counts size their outputs by the data: NotImplemented keeps
    those calls operators."""
    if drop_pad_mode != 0 or expert_tokens_num_type == 2:
        return NotImplemented
    s, e, rows_out = _v2_resolve(
        x,
        expert_idx,
        scale,
        offset,
        active_num,
        expert_capacity,
        expert_num,
        drop_pad_mode,
        expert_tokens_num_type,
        quant_mode,
        active_expert_range,
        row_idx_type,
        x_dtype,
    )
    in_range, perm, counts = _sorted_slots(expert_idx.reshape(-1).long(), s, e)
    tokens_out = counts if expert_tokens_num_type == 1 else torch.cumsum(counts, 0)
    expanded_x, expanded_row_idx, expanded_scale = _dropless_rows(
        x, scale, perm, in_range.sum(), expert_idx.shape[1], rows_out, row_idx_type
    )
    return expanded_x, expanded_row_idx, tokens_out, expanded_scale


def _v2_fake(
    x,
    expert_idx,
    *,
    scale=None,
    offset=None,
    active_num=-1,
    expert_capacity=-1,
    expert_num=-1,
    drop_pad_mode=0,
    expert_tokens_num_type=0,
    expert_tokens_num_flag=False,
    quant_mode=-1,
    active_expert_range=(),
    row_idx_type=0,
    x_dtype=None,
):
    s, e, rows_out = _v2_resolve(
        x,
        expert_idx,
        scale,
        offset,
        active_num,
        expert_capacity,
        expert_num,
        drop_pad_mode,
        expert_tokens_num_type,
        quant_mode,
        active_expert_range,
        row_idx_type,
        x_dtype,
    )
    nk = expert_idx.shape[0] * expert_idx.shape[1]
    counts = x.new_empty(_v2_counts_shape(expert_num, s, e, expert_tokens_num_type), dtype=torch.int64)
    row_idx = x.new_empty((nk,), dtype=torch.int32)
    if drop_pad_mode == 1:
        cap = expert_capacity
        return (
            x.new_empty((expert_num, cap, x.shape[1])),
            row_idx,
            counts,
            x.new_empty((expert_num * cap,), dtype=torch.float32),
        )
    scale_dtype = torch.float32 if scale is None else scale.dtype
    return (
        x.new_empty((rows_out, x.shape[1])),
        row_idx,
        counts,
        x.new_empty(_v2_scale_shape(scale, rows_out), dtype=scale_dtype),
    )


register(_V2, moe_init_routing_v2, _v2_fake, traceable=moe_init_routing_v2_traced)


# ==================================================================================================
# npu_moe_compute_expert_tokens(Tensor sorted_expert_for_source_row, int num_expert) -> Tensor        §5
# Tie rule: out[i] = #{m : sorted[m] <= i} (binary search, right side: equal ids all count for their expert).
# Padding rule: none; experts with no tokens repeat the previous end, ids >= num_expert are never counted.
# ==================================================================================================
_CET = "npu_moe_compute_expert_tokens"


def _cet_check(sorted_expert_for_source_row, num_expert):
    check_dim(_CET, "sorted_expert_for_source_row", sorted_expert_for_source_row, (1,))
    check_dtype(_CET, "sorted_expert_for_source_row", sorted_expert_for_source_row, (torch.int32,))
    check(num_expert > 0, _CET, f"num_expert={num_expert} must be > 0")
    check_npu_limit(num_expert <= 2048, _CET, f"num_expert={num_expert} must be <= 2048")
    check_npu_limit(
        sorted_expert_for_source_row.shape[0] < 2**24,
        _CET,
        f"sorted_expert_for_source_row has {sorted_expert_for_source_row.shape[0]} rows; must be < 2^24",
    )


def moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert):
    _cet_check(sorted_expert_for_source_row, num_expert)
    rows = sorted_expert_for_source_row
    check_npu_limit(
        rows.numel() < 2 or bool((rows[1:] >= rows[:-1]).all()),
        _CET,
        "sorted_expert_for_source_row must be non-decreasing",
    )
    experts = torch.arange(num_expert, dtype=torch.int32, device=rows.device)
    return torch.searchsorted(rows.contiguous(), experts, right=True, out_int32=True)


def _cet_fake(sorted_expert_for_source_row, num_expert):
    _cet_check(sorted_expert_for_source_row, num_expert)
    return sorted_expert_for_source_row.new_empty((num_expert,))


register(_CET, moe_compute_expert_tokens, _cet_fake)


# ==================================================================================================
# npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias,
#   Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0,
#   int? k=1) -> Tensor                                                                               §6
# Tie rule: fixed fp32 accumulation order: skip1, then skip2, then choices j = 0..K-1 ascending; one rounding.
# Padding rule: index -1 contributes exactly nothing (no row, no bias) in every drop_pad_mode; rows past the indexed
#               ones are never read.
# ==================================================================================================
_FIN = "npu_moe_finalize_routing"


def _fin_resolve(rows, skip1, skip2, bias, scales, idx, export, drop_pad_mode, k):
    """Metadata checks; returns (mode, N, K, H)."""
    mode = 0 if drop_pad_mode is None else drop_pad_mode
    k = 1 if k is None else k
    check(mode in (0, 1, 2, 3), _FIN, f"drop_pad_mode={mode}; allowed: 0, 1, 2, 3")
    check_dim(_FIN, "expanded_permuted_rows", rows, (3,) if mode in (1, 3) else (2,))
    check_dtype(_FIN, "expanded_permuted_rows", rows, _FLOATS)
    check_dim(_FIN, "expanded_src_to_dst_row", idx, (1,))
    check_dtype(_FIN, "expanded_src_to_dst_row", idx, (torch.int32,))
    h = rows.shape[-1]
    if scales is not None:
        check_dim(_FIN, "scales", scales, (2,))
        allowed = (rows.dtype, torch.float32) if rows.dtype == torch.bfloat16 else (rows.dtype,)
        check_dtype(_FIN, "scales", scales, allowed)
        n, kk = scales.shape
    else:
        check(k >= 1, _FIN, f"k={k} must be >= 1 when scales is None")
        check(
            idx.shape[0] % k == 0, _FIN, f"expanded_src_to_dst_row has {idx.shape[0]} entries, not a multiple of k={k}"
        )
        n, kk = idx.shape[0] // k, k
    check_shape(_FIN, "expanded_src_to_dst_row", idx, (n * kk,))
    for name, skip in (("skip1", skip1), ("skip2", skip2)):
        if skip is not None:
            check_dtype(_FIN, name, skip, (rows.dtype,))
            check_shape(_FIN, name, skip, (n, h))
    check(skip2 is None or skip1 is not None, _FIN, "skip2 requires skip1 (skip1 is None)")
    if export is not None:
        check_dtype(_FIN, "export_for_source_row", export, (torch.int32,))
        check_shape(_FIN, "export_for_source_row", export, (n, kk))
    if bias is not None:
        check_dim(_FIN, "bias", bias, (2,))
        check_dtype(_FIN, "bias", bias, (rows.dtype,))
        check(bias.shape[1] == h, _FIN, f"bias has shape {tuple(bias.shape)}; expected [E, H={h}]")
        check(export is not None, _FIN, "bias requires export_for_source_row (it is None)")
    return mode, n, kk, h


def moe_finalize_routing(
    expanded_permuted_rows,
    skip1,
    skip2,
    bias,
    scales,
    expanded_src_to_dst_row,
    export_for_source_row,
    drop_pad_mode=0,
    k=1,
):
    return _finalize(
        expanded_permuted_rows,
        skip1,
        skip2,
        bias,
        scales,
        expanded_src_to_dst_row,
        export_for_source_row,
        drop_pad_mode,
        k,
        read_data=True,
    )


def moe_finalize_routing_traced(
    expanded_permuted_rows,
    skip1,
    skip2,
    bias,
    scales,
    expanded_src_to_dst_row,
    export_for_source_row,
    drop_pad_mode=0,
    k=1,
):
    """The kernel as a compiled graph inlines it: the same code without the host reads of the index ranges."""
    return _finalize(
        expanded_permuted_rows,
        skip1,
        skip2,
        bias,
        scales,
        expanded_src_to_dst_row,
        export_for_source_row,
        drop_pad_mode,
        k,
        read_data=False,
    )


def _finalize(
    expanded_permuted_rows,
    skip1,
    skip2,
    bias,
    scales,
    expanded_src_to_dst_row,
    export_for_source_row,
    drop_pad_mode,
    k,
    read_data: bool,
):
    rows, idx, export = expanded_permuted_rows, expanded_src_to_dst_row, export_for_source_row
    mode, n, kk, h = _fin_resolve(rows, skip1, skip2, bias, scales, idx, export, drop_pad_mode, k)
    rows2 = rows.reshape(-1, h)
    num_rows = rows2.shape[0]
    slot = idx.reshape(kk, n).t() if mode in (0, 1) else idx.reshape(n, kk)  # [N, K]: destination row of choice j
    valid = slot >= 0
    check(
        not read_data or idx.numel() == 0 or (int(idx.min()) >= -1 and int(idx.max()) < num_rows),
        _FIN,
        f"expanded_src_to_dst_row values must lie in [-1, {num_rows})",
    )
    # One choice j at a time over [N, H] rows (cache-sized pieces, nothing [N, K, H] materialized), each step the
    # literal loop's arithmetic: the row gathered and widened, + bias, x scale, then added in ascending j.
    # -1 gathers row 0 (a zero row if there is none) and the where() makes it contribute exactly 0; eagerly the
    # where() is skipped when no index is -1 (adding the where()'s 0.0 to the accumulator changes no bit).
    src = rows2 if num_rows else rows2.new_zeros((1, h))
    index = torch.where(valid, slot, 0).long().t().contiguous()  # [K, N]
    masked = not read_data or not bool(valid.all())
    ex = None
    if bias is not None:
        ex = export.long()
        check(
            not read_data
            or not bool(valid.any())
            or (int(ex[valid].min()) >= 0 and int(ex[valid].max()) < bias.shape[0]),
            _FIN,
            f"export_for_source_row values must lie in [0, {bias.shape[0]}) (bias rows) where an index is valid",
        )
        ex, bias_f = torch.where(valid, ex, 0).t().contiguous(), bias.float()
    acc = torch.zeros((n, h), dtype=torch.float32, device=rows.device)
    if skip1 is not None:
        acc = acc + skip1.float()
    if skip2 is not None:
        acc = acc + skip2.float()
    for j in range(kk):  # over the K choices (top-k, small), never over tokens: the spec's fixed ascending-j order
        value = src.index_select(0, index[j]).float()  # [N, H]
        if bias is not None:
            value = value + bias_f.index_select(0, ex[j])
        if scales is not None:
            value = scales[:, j : j + 1].float() * value
        if masked:
            value = torch.where(valid[:, j : j + 1], value, 0.0)
        acc = acc + value
    return acc.to(rows.dtype)


def _fin_fake(
    expanded_permuted_rows,
    skip1,
    skip2,
    bias,
    scales,
    expanded_src_to_dst_row,
    export_for_source_row,
    drop_pad_mode=0,
    k=1,
):
    _, n, _, h = _fin_resolve(
        expanded_permuted_rows,
        skip1,
        skip2,
        bias,
        scales,
        expanded_src_to_dst_row,
        export_for_source_row,
        drop_pad_mode,
        k,
    )
    return expanded_permuted_rows.new_empty((n, h))


register(_FIN, moe_finalize_routing, _fin_fake, traceable=moe_finalize_routing_traced)


# ==================================================================================================
# npu_moe_re_routing(Tensor tokens, Tensor expert_token_num_per_rank, *, Tensor? per_token_scales=None,
#   int expert_token_num_type=1, int idx_type=0, int? tokens_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)   §7
# Tie rule: output blocks in (local expert, source rank) order; arrival order kept inside a block.
# Padding rule: without per_token_scales, permute_per_token_scales is 0 ([A] f32); no other unspecified region.
# ==================================================================================================
_RR = "npu_moe_re_routing"
_RR_TOKEN_CODES = (290, 296, 297)


def _rr_check(tokens, counts, per_token_scales, expert_token_num_type, idx_type, tokens_dtype):
    check_dim(_RR, "tokens", tokens, (2,))
    check_dim(_RR, "expert_token_num_per_rank", counts, (2,))
    check_dtype(_RR, "expert_token_num_per_rank", counts, (torch.int32, torch.int64))
    check(
        expert_token_num_type in (0, 1),
        _RR,
        f"expert_token_num_type={expert_token_num_type}; allowed: 0 (cumsum), 1 (count)",
    )
    check(idx_type in (0, 1), _RR, f"idx_type={idx_type}; allowed: 0 (gather), 1 (scatter)")
    if tokens_dtype is not None:
        check(tokens_dtype in _RR_TOKEN_CODES, _RR, f"tokens_dtype={tokens_dtype}; allowed: None, 290, 296, 297")
        check_dtype(_RR, "tokens", tokens, (torch.uint8, torch.int8))
    if per_token_scales is not None:
        check(
            per_token_scales.dim() >= 1 and per_token_scales.shape[0] == tokens.shape[0],
            _RR,
            f"per_token_scales has shape {tuple(per_token_scales.shape)}; expected [A={tokens.shape[0]}, ...]",
        )
    # The NPU kernel takes f16/bf16/int8 (and 1-byte storage via tokens_dtype); the movement here is dtype-agnostic.
    check_npu_limit(
        tokens.dtype in (torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.float32),
        _RR,
        f"tokens has dtype {tokens.dtype}; allowed: float16, bfloat16, int8",
    )
    check_npu_limit(
        tokens.dtype != torch.float32, _RR, "tokens has dtype torch.float32; allowed: float16, bfloat16, int8", FP32
    )
    check_npu_limit(0 < tokens.shape[1] < 16384, _RR, f"H={tokens.shape[1]} must satisfy 0 < H < 16384", DIMS)


def moe_re_routing(
    tokens, expert_token_num_per_rank, *, per_token_scales=None, expert_token_num_type=1, idx_type=0, tokens_dtype=None
):
    counts = expert_token_num_per_rank
    _rr_check(tokens, counts, per_token_scales, expert_token_num_type, idx_type, tokens_dtype)
    a = tokens.shape[0]
    dev = tokens.device
    cnt = counts.long()
    check(counts.numel() == 0 or int(cnt.min()) >= 0, _RR, "expert_token_num_per_rank values must be >= 0")
    check(
        int(cnt.sum()) == a,
        _RR,
        f"expert_token_num_per_rank sums to {int(cnt.sum())} but tokens has A={a} rows; they must match",
    )
    src_start = _exclusive_cumsum(cnt.reshape(-1)).view(cnt.shape)  # rank-major input blocks (r, e)
    cnt_out = cnt.t().reshape(-1)  # expert-major output blocks (e, r)
    src_start_out = src_start.t().reshape(-1)
    dst_start_out = _exclusive_cumsum(cnt_out)
    block = torch.repeat_interleave(torch.arange(cnt_out.numel(), device=dev), cnt_out, output_size=a)
    perm = src_start_out.index_select(0, block) + torch.arange(a, device=dev) - dst_start_out.index_select(0, block)
    permute_tokens = _gather_rows(tokens, perm)
    if per_token_scales is None:
        permute_scales = torch.zeros(a, dtype=torch.float32, device=dev)
    else:
        permute_scales = _gather_rows(per_token_scales, perm)
    if idx_type == 0:
        permute_idx = perm.to(torch.int32)
    else:
        permute_idx = torch.empty(a, dtype=torch.int32, device=dev)
        permute_idx[perm] = torch.arange(a, dtype=torch.int32, device=dev)
    per_expert = counts.sum(0, dtype=counts.dtype)
    if expert_token_num_type == 0:
        per_expert = torch.cumsum(per_expert, 0, dtype=counts.dtype)
    return permute_tokens, permute_scales, permute_idx, per_expert


def _rr_fake(
    tokens, expert_token_num_per_rank, *, per_token_scales=None, expert_token_num_type=1, idx_type=0, tokens_dtype=None
):
    counts = expert_token_num_per_rank
    _rr_check(tokens, counts, per_token_scales, expert_token_num_type, idx_type, tokens_dtype)
    a = tokens.shape[0]
    scales = (
        tokens.new_empty((a,), dtype=torch.float32)
        if per_token_scales is None
        else per_token_scales.new_empty(per_token_scales.shape)
    )
    return (
        tokens.new_empty(tokens.shape),
        scales,
        tokens.new_empty((a,), dtype=torch.int32),
        counts.new_empty((counts.shape[1],)),
    )


register(_RR, moe_re_routing, _rr_fake)
