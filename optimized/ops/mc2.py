"""MC2 family: the expert-parallel token dispatch and combine collectives, npu_moe_distribute_dispatch_v2 and
npu_moe_distribute_combine_v2. Contract: spec npu_ops_moe.md §10, §11 (and §13 items 16-18).

The portable kernels are the spec's explicit all-to-all steps over torch.distributed, on the EP group named by
`group_ep` (resolved in `process_groups`, which optimized/distributed fills with the HCCL name on an NPU host and the
ProcessGroup's own name elsewhere), reusing the routing family's kernels for the local steps:

    dispatch (rank r):  init_routing_v2 over all experts (sorted by (dest rank, local expert, token), counts)
                        -> all_to_all of the counts [W, L] (with each rank's BS, checked when global_bs = 0)
                        -> all_to_all_v of the rows, bit-exact as bytes, with each row's (token, k slot)
                        -> re_routing (s, e, t) -> (e, s, t): expand_x grouped by local expert
    combine (rank r):   re_routing with rank and expert swapped, (e, s, t) -> (s, e, t)
                        -> all_to_all_v back -> finalize_routing in fp32 (ascending j), one rounding

W = 1 needs no group (the spec's relaxation of the NPU's W >= 2). Both kernels report the bytes they send to other
ranks through `process_groups.report_traffic`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .process_groups import group_by_name, report_traffic
from .registry import register
from .routing import _as_bits, _zeros_like_rows, moe_finalize_routing, moe_init_routing_v2, moe_re_routing
from .validation import (
    DIMS,
    FP32,
    check,
    check_dim,
    check_dtype,
    check_npu_limit,
    check_rows_and_ids,
    check_shape,
    unsupported,
)

_DISPATCH = "npu_moe_distribute_dispatch_v2"
_COMBINE = "npu_moe_distribute_combine_v2"
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the NPU takes bf16 / f16 (strict mode)
_COMM_ALGS = ("", "fullmesh", "fullmesh_v2", "hierarchy")
# The kernels' size limits on Atlas A3 (§10.4); the model checks its layout against them at start-up
# (distributed/decode_plan.py `mc2_limit_violations`).
MAX_EP_WORLD_SIZE, MAX_EXPERTS, MAX_SLOTS = 768, 1024, 2048  # W, E, L * W
MAX_TOP_K = {"fullmesh_v2": 12}  # else 16
MAX_BS = {"fullmesh_v2": 256, "hierarchy": 256}  # else 512
HIDDEN_RANGE = (1024, 8192)


def max_top_k(comm_alg: str) -> int:
    return MAX_TOP_K.get(comm_alg, 16)


def max_bs(comm_alg: str) -> int:
    return MAX_BS.get(comm_alg, 512)


# The last element of a portable handle: combine refuses a handle this golden's dispatch did not write (§13.16).
HANDLE_MAGIC = 0x4D433256


def capacity(bs: int, ep_world_size: int, local_experts: int, top_k: int, global_bs: int) -> int:
    """A: the rows expand_x can hold, (global_bs or BS * W) * min(L, K) (§10.2)."""
    return (global_bs or bs * ep_world_size) * min(local_experts, top_k)


def handle_length(bs: int, top_k: int, a: int) -> int:
    return max(bs * top_k, 128 * a)


# Handle layout (int32, handle_length entries; BS*K <= A and W <= A, so the regions never overlap):
#   [0, 3A)          per received row i < n_recv: (source rank, source token, k slot); -1 elsewhere
#   [3A, 3A + BS*K)  this rank's slot f = t*K + j -> its position in this rank's send order (-1: not sent)
#   [4A, 4A + W)     rows this rank sent to each EP rank
#   [-2], [-1]       H, HANDLE_MAGIC
def _handle_regions(a: int, bs: int, k: int, w: int) -> tuple[slice, slice, slice]:
    return slice(0, 3 * a), slice(3 * a, 3 * a + bs * k), slice(4 * a, 4 * a + w)


# ---------------------------------------------------------------------------------------------- checks


def _common_check(
    op,
    bs,
    k,
    h,
    w,
    r,
    e,
    *,
    tp_world_size,
    tp_rank_id,
    expert_shard_type,
    shared_expert_num,
    shared_expert_rank_num,
    global_bs,
    comm_alg,
    zero_expert_num,
    copy_expert_num,
    const_expert_num,
    elastic_info,
    performance_info,
) -> tuple[int, int]:
    """The metadata checks both operators share; returns (L, A)."""
    check(w >= 1, op, f"ep_world_size={w} must be >= 1")
    check(0 <= r < w, op, f"ep_rank_id={r} must satisfy 0 <= ep_rank_id < ep_world_size={w}")
    check(
        0 <= shared_expert_rank_num < w,
        op,
        f"shared_expert_rank_num={shared_expert_rank_num} must satisfy 0 <= it < ep_world_size={w}",
    )
    check(
        e > 0 and e % (w - shared_expert_rank_num) == 0,
        op,
        f"moe_expert_num={e} must be > 0 and divisible by ep_world_size - shared_expert_rank_num = "
        f"{w - shared_expert_rank_num}",
    )
    combo = (shared_expert_num, shared_expert_rank_num)
    check(
        combo in ((1, 0), (0, 0)) or (shared_expert_num > 0 and shared_expert_rank_num % shared_expert_num == 0),
        op,
        f"(shared_expert_num, shared_expert_rank_num)={combo}; allowed: (1, 0), (0, 0), or "
        f"shared_expert_rank_num a multiple of shared_expert_num",
    )
    if shared_expert_rank_num > 0:
        unsupported(op, f"shared experts (shared_expert_rank_num={shared_expert_rank_num})")
    check(expert_shard_type == 0, op, f"expert_shard_type={expert_shard_type}; allowed: 0")
    check(tp_world_size in (0, 1, 2), op, f"tp_world_size={tp_world_size}; allowed: 0, 1, 2")
    if tp_world_size == 2:
        unsupported(op, "a TP domain (tp_world_size=2)")
    check(tp_rank_id == 0, op, f"tp_rank_id={tp_rank_id} must be 0 without a TP domain (tp_world_size <= 1)")
    for name, value in (
        ("zero_expert_num", zero_expert_num),
        ("copy_expert_num", copy_expert_num),
        ("const_expert_num", const_expert_num),
    ):
        check(value >= 0, op, f"{name}={value} must be >= 0")
        if value:
            unsupported(op, f"special experts ({name}={value})")
    if elastic_info is not None:
        unsupported(op, "elastic_info (elastic scale-in)")
    if performance_info is not None:
        unsupported(op, "performance_info (profiling)")
    check(comm_alg in _COMM_ALGS, op, f"comm_alg={comm_alg!r}; allowed: {', '.join(map(repr, _COMM_ALGS))}")
    check(1 <= k <= e, op, f"top-k K={k} (expert_ids.shape[1]) must satisfy 1 <= K <= moe_expert_num={e}")
    check(global_bs >= 0, op, f"global_bs={global_bs} must be >= 0 (0: BS * ep_world_size)")
    if global_bs:
        check(
            global_bs % w == 0 and bs * w <= global_bs,
            op,
            f"global_bs={global_bs} must be a multiple of ep_world_size={w} and >= BS * ep_world_size = {bs * w}",
        )
    else:
        check(bs >= 1, op, "x has 0 rows; with global_bs=0 every rank needs BS >= 1 (pass global_bs to send none)")
    local = e // w
    # NPU limits (Atlas A3) on sizes (DIMS: the tiny test models are below H 1024). W = 1 is allowed although the
    # NPU needs W >= 2: Qwen3 on one device runs with W = 1.
    check_npu_limit(w <= MAX_EP_WORLD_SIZE, op, f"ep_world_size={w} must be <= {MAX_EP_WORLD_SIZE}", kind=DIMS)
    check_npu_limit(e <= MAX_EXPERTS, op, f"moe_expert_num={e} must be <= {MAX_EXPERTS}", kind=DIMS)
    k_max = max_top_k(comm_alg)
    check_npu_limit(k <= k_max, op, f"K={k} must be <= {k_max} (comm_alg={comm_alg!r})", kind=DIMS)
    bs_max = max_bs(comm_alg)
    check_npu_limit(bs <= bs_max, op, f"BS={bs} must be <= {bs_max} (comm_alg={comm_alg!r})", kind=DIMS)
    lo, hi = HIDDEN_RANGE
    check_npu_limit(lo <= h <= hi, op, f"H={h} must satisfy {lo} <= H <= {hi}", kind=DIMS)
    check_npu_limit(local * w <= MAX_SLOTS, op, f"L * W = {local * w} must be <= {MAX_SLOTS}", kind=DIMS)
    return local, capacity(bs, w, local, k, global_bs)


def _mask_check(op, x_active_mask, bs, k):
    if x_active_mask is not None:
        check_dtype(op, "x_active_mask", x_active_mask, (torch.bool,))
        check(
            tuple(x_active_mask.shape) in ((bs,), (bs, k)),
            op,
            f"x_active_mask has shape {tuple(x_active_mask.shape)}; expected [BS={bs}] or [BS, K]=[{bs}, {k}]",
        )


def _active_slots(x_active_mask, expert_ids) -> torch.Tensor:
    """[BS, K] bool: the slots that are sent (a 1-D mask must be a True prefix, spec §10.4)."""
    if x_active_mask is None:
        return torch.ones_like(expert_ids, dtype=torch.bool)
    if x_active_mask.dim() == 1:
        m = x_active_mask.to(torch.int8)
        check(
            m.numel() < 2 or bool((m[1:] <= m[:-1]).all()),
            _DISPATCH,
            "a 1-D x_active_mask must be a True prefix (active tokens first)",
        )
        return x_active_mask.unsqueeze(1).expand_as(expert_ids)
    return x_active_mask


def _ep_group(op: str, group_ep: str, w: int, r: int) -> "dist.ProcessGroup | None":
    """The EP process group named `group_ep` (None for W = 1, which needs no group)."""
    if w == 1:
        return None
    try:
        group = group_by_name(group_ep)
    except KeyError as err:
        raise ValueError(f"{op}: group_ep={group_ep!r} names no process group ({err.args[0]})") from None
    size = 1 if group is None else group.size()
    check(size == w, op, f"group_ep={group_ep!r} has {size} ranks but ep_world_size={w}")
    me = dist.get_rank(group)
    check(me == r, op, f"ep_rank_id={r} but this process is rank {me} of group_ep={group_ep!r}")
    return group


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """[n, H] of any dtype -> [n, H * itemsize] uint8, the same bits (what every backend moves)."""
    return (
        _as_bits(rows.contiguous())
        .view(torch.uint8)
        .reshape(rows.shape[0], math.prod(rows.shape[1:]) * rows.element_size())
    )


def _exchange_rows(op: str, payload: torch.Tensor, group, send: list[int], recv: list[int]) -> torch.Tensor:
    """all_to_all_v of uint8 rows: send[d] rows to rank d, recv[s] rows from rank s; the bytes sent are reported."""
    if group is None:
        return payload
    out = payload.new_empty((sum(recv), payload.shape[1]))
    me = dist.get_rank(group)
    report_traffic(op, (sum(send) - send[me]) * payload.shape[1])
    dist.all_to_all_single(out, payload.contiguous(), recv, send, group=group)
    return out


# ==================================================================================================
# npu_moe_distribute_dispatch_v2(Tensor x, Tensor expert_ids, str group_ep, int ep_world_size, int ep_rank_id,
#   int moe_expert_num, *, ..., int quant_mode=0, int global_bs=0, int expert_token_nums_type=1, str comm_alg="",
#   ...) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)                                 §10
# Tie rule: within a local expert, rows ordered by source rank, then source token (= the global init_routing_v2).
# Padding rule: expand_x rows past n_recv are 0; dynamic_scales / expand_scales / tp_recv_counts are 0; the
#               handle's unused entries are -1 (its encoding is this golden's own, spec §13.16).
# ==================================================================================================


def _dispatch_check(
    x,
    expert_ids,
    ep_world_size,
    ep_rank_id,
    moe_expert_num,
    scales,
    x_active_mask,
    expert_scales,
    quant_mode,
    expert_token_nums_type,
    y_dtype,
    x_dtype,
    scales_dtype,
    **common,
):
    op = _DISPATCH
    check_rows_and_ids(op, x, _X_DTYPES, expert_ids, "expert_ids")
    bs, k = expert_ids.shape
    local, a = _common_check(op, bs, k, x.shape[1], ep_world_size, ep_rank_id, moe_expert_num, **common)
    check(quant_mode in (0, 2), op, f"quant_mode={quant_mode}; allowed: 0 (none), 2 (dynamic int8)")
    if quant_mode == 2:
        unsupported(op, "quant_mode=2 (dynamic int8)")
    check(scales is None, op, "scales (smooth quantization scales) is only used with quant_mode=2; pass None")
    if expert_scales is not None:
        unsupported(op, "expert_scales (carried to expand_scales on A2 / hierarchy only)")
    check(
        expert_token_nums_type in (0, 1),
        op,
        f"expert_token_nums_type={expert_token_nums_type}; allowed: 0 (cumsum), 1 (count)",
    )
    for name, value in (("y_dtype", y_dtype), ("x_dtype", x_dtype), ("scales_dtype", scales_dtype)):
        if value is not None:
            unsupported(op, f"{name}={value} (storage reinterpretation)")
    _mask_check(op, x_active_mask, bs, k)
    check_npu_limit(
        x.dtype in (torch.float16, torch.bfloat16), op, f"x has dtype {x.dtype}; allowed: bf16, f16", kind=FP32
    )
    return bs, k, local, a


def _check_expert_ids(op: str, expert_ids: torch.Tensor, e: int) -> None:
    """Values in [0, E) and no expert twice in a row (data checks: eager only)."""
    if expert_ids.numel() == 0:
        return
    lo, hi = int(expert_ids.min()), int(expert_ids.max())
    check(lo >= 0 and hi < e, op, f"expert_ids values must lie in [0, moe_expert_num={e}); got [{lo}, {hi}]")
    ordered = torch.sort(expert_ids, dim=1).values
    check(
        not bool((ordered[:, 1:] == ordered[:, :-1]).any()),
        op,
        "expert_ids has an expert twice in one row; each token's K experts must be distinct",
    )


def moe_distribute_dispatch_v2(
    x,
    expert_ids,
    group_ep,
    ep_world_size,
    ep_rank_id,
    moe_expert_num,
    *,
    scales=None,
    x_active_mask=None,
    expert_scales=None,
    elastic_info=None,
    performance_info=None,
    group_tp="",
    tp_world_size=0,
    tp_rank_id=0,
    expert_shard_type=0,
    shared_expert_num=1,
    shared_expert_rank_num=0,
    quant_mode=0,
    global_bs=0,
    expert_token_nums_type=1,
    comm_alg="",
    zero_expert_num=0,
    copy_expert_num=0,
    const_expert_num=0,
    y_dtype=None,
    x_dtype=None,
    scales_dtype=None,
):
    w, r, e = ep_world_size, ep_rank_id, moe_expert_num
    bs, k, local, a = _dispatch_check(
        x,
        expert_ids,
        w,
        r,
        e,
        scales,
        x_active_mask,
        expert_scales,
        quant_mode,
        expert_token_nums_type,
        y_dtype,
        x_dtype,
        scales_dtype,
        tp_world_size=tp_world_size,
        tp_rank_id=tp_rank_id,
        expert_shard_type=expert_shard_type,
        shared_expert_num=shared_expert_num,
        shared_expert_rank_num=shared_expert_rank_num,
        global_bs=global_bs,
        comm_alg=comm_alg,
        zero_expert_num=zero_expert_num,
        copy_expert_num=copy_expert_num,
        const_expert_num=const_expert_num,
        elastic_info=elastic_info,
        performance_info=performance_info,
    )
    group = _ep_group(_DISPATCH, group_ep, w, r)
    _check_expert_ids(_DISPATCH, expert_ids, e)
    dev, h = x.device, x.shape[1]
    # 1. local sort by (dest rank d, local expert, token): init_routing_v2 over all experts; an inactive slot gets
    #    id E (init_routing's "finished" marker), so it is never sent.
    ids = torch.where(_active_slots(x_active_mask, expert_ids), expert_ids, e)
    sorted_x, row_idx, send_cnt, _ = moe_init_routing_v2(
        x,
        ids,
        active_num=bs * k,
        expert_num=e,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        active_expert_range=[0, e],
    )
    sent = row_idx >= 0
    n_send = int(sent.sum())
    slot_of_row = torch.empty(n_send, dtype=torch.int64, device=dev)  # send position -> slot f
    slot_of_row[row_idx[sent].long()] = torch.arange(bs * k, device=dev)[sent]
    # 2. counts: cnt[s, e'] = rows rank s sends to this rank's local expert e' (each rank's BS rides along)
    send_counts = torch.cat([send_cnt.view(w, local), torch.full((w, 1), bs, dtype=torch.int64, device=dev)], dim=1)
    if group is None:
        recv_counts = send_counts
    else:
        recv_counts = torch.empty_like(send_counts)
        report_traffic(_DISPATCH, (w - 1) * send_counts[0].numel() * send_counts.element_size())
        dist.all_to_all_single(recv_counts, send_counts, group=group)
    cnt, bs_of = recv_counts[:, :local], recv_counts[:, local]
    if global_bs == 0:
        check(
            bool((bs_of == bs).all()),
            _DISPATCH,
            f"with global_bs=0 every EP rank needs the same BS; got {bs_of.tolist()} (pass global_bs = max BS * W)",
        )
    else:
        check(
            bool((bs_of * w <= global_bs).all()),
            _DISPATCH,
            f"global_bs={global_bs} is below BS * ep_world_size on some rank (BS per rank {bs_of.tolist()})",
        )
    # 3. payload: the rows bit-exact as bytes, each with its (source token, k slot), rank d's rows to rank d
    meta = torch.stack([slot_of_row // k, slot_of_row % k], dim=1).to(torch.int32)
    payload = torch.cat([_as_bytes(sorted_x[:n_send]), _as_bytes(meta)], dim=1)
    row_bytes = h * x.element_size()
    recv = _exchange_rows(_DISPATCH, payload, group, send_cnt.view(w, local).sum(1).tolist(), cnt.sum(1).tolist())
    recv_x = recv[:, :row_bytes].contiguous().view(x.dtype)
    recv_meta = recv[:, row_bytes:].contiguous().view(torch.int32)
    # 4. regroup (s, e', t) -> (e', s, t)
    grouped, _, gather_idx, per_expert = moe_re_routing(recv_x, cnt)
    n_recv = grouped.shape[0]
    # 5. outputs
    expand_x = _zeros_like_rows(x, a)
    expand_x[:n_recv] = grouped
    src_rank = torch.repeat_interleave(torch.arange(w, device=dev), cnt.sum(1), output_size=n_recv)
    handle = torch.full((handle_length(bs, k, a),), -1, dtype=torch.int32, device=dev)
    received, slots, sends = _handle_regions(a, bs, k, w)
    triplets = torch.stack(
        [
            src_rank.index_select(0, gather_idx.long()).to(torch.int32),
            recv_meta.index_select(0, gather_idx.long())[:, 0],
            recv_meta.index_select(0, gather_idx.long())[:, 1],
        ],
        dim=1,
    )
    handle[received][: 3 * n_recv] = triplets.reshape(-1)
    handle[slots] = row_idx
    handle[sends] = send_cnt.view(w, local).sum(1).to(torch.int32)
    handle[-2], handle[-1] = h, HANDLE_MAGIC
    expert_token_nums = per_expert if expert_token_nums_type == 1 else torch.cumsum(per_expert, 0)
    ep_recv_counts = torch.cumsum(cnt.t().reshape(-1), 0).to(torch.int32)  # [e'*W + s]: inclusive block end
    zeros = torch.zeros(a, dtype=torch.float32, device=dev)
    tp_recv_counts = torch.zeros(tp_world_size, dtype=torch.int32, device=dev)
    return expand_x, zeros, handle, expert_token_nums, ep_recv_counts, tp_recv_counts, zeros.clone()


def _dispatch_fake(
    x,
    expert_ids,
    group_ep,
    ep_world_size,
    ep_rank_id,
    moe_expert_num,
    *,
    scales=None,
    x_active_mask=None,
    expert_scales=None,
    elastic_info=None,
    performance_info=None,
    group_tp="",
    tp_world_size=0,
    tp_rank_id=0,
    expert_shard_type=0,
    shared_expert_num=1,
    shared_expert_rank_num=0,
    quant_mode=0,
    global_bs=0,
    expert_token_nums_type=1,
    comm_alg="",
    zero_expert_num=0,
    copy_expert_num=0,
    const_expert_num=0,
    y_dtype=None,
    x_dtype=None,
    scales_dtype=None,
):
    w = ep_world_size
    bs, k, local, a = _dispatch_check(
        x,
        expert_ids,
        w,
        ep_rank_id,
        moe_expert_num,
        scales,
        x_active_mask,
        expert_scales,
        quant_mode,
        expert_token_nums_type,
        y_dtype,
        x_dtype,
        scales_dtype,
        tp_world_size=tp_world_size,
        tp_rank_id=tp_rank_id,
        expert_shard_type=expert_shard_type,
        shared_expert_num=shared_expert_num,
        shared_expert_rank_num=shared_expert_rank_num,
        global_bs=global_bs,
        comm_alg=comm_alg,
        zero_expert_num=zero_expert_num,
        copy_expert_num=copy_expert_num,
        const_expert_num=const_expert_num,
        elastic_info=elastic_info,
        performance_info=performance_info,
    )
    return (
        x.new_empty((a, x.shape[1])),
        x.new_empty((a,), dtype=torch.float32),
        x.new_empty((handle_length(bs, k, a),), dtype=torch.int32),
        x.new_empty((local,), dtype=torch.int64),
        x.new_empty((w * local,), dtype=torch.int32),
        x.new_empty((tp_world_size,), dtype=torch.int32),
        x.new_empty((a,), dtype=torch.float32),
    )


register(_DISPATCH, moe_distribute_dispatch_v2, _dispatch_fake)


# ==================================================================================================
# npu_moe_distribute_combine_v2(Tensor expand_x, Tensor expert_ids, Tensor assist_info_for_combine,
#   Tensor ep_send_counts, Tensor expert_scales, str group_ep, int ep_world_size, int ep_rank_id,
#   int moe_expert_num, *, ..., int global_bs=0, int comm_quant_mode=0, str comm_alg="", ...) -> Tensor    §11
# Tie rule: out[t] = sum over j = 0..K-1 ascending of expert_scales[t, j] * row(t, j), in fp32, one rounding.
# Padding rule: a slot never sent (masked) contributes 0; a fully masked token's row is 0.
# ==================================================================================================


def _combine_check(
    expand_x,
    expert_ids,
    handle,
    ep_send_counts,
    expert_scales,
    ep_world_size,
    ep_rank_id,
    moe_expert_num,
    tp_send_counts,
    x_active_mask,
    expand_scales,
    shared_expert_x,
    ori_x,
    const_expert_alpha_1,
    const_expert_alpha_2,
    const_expert_v,
    comm_quant_mode,
    **common,
):
    op = _COMBINE
    check_dim(op, "expand_x", expand_x, (2,))
    check_dtype(op, "expand_x", expand_x, _X_DTYPES)
    check_dim(op, "expert_ids", expert_ids, (2,))
    check_dtype(op, "expert_ids", expert_ids, (torch.int32,))
    check_shape(op, "expert_scales", expert_scales, tuple(expert_ids.shape))
    check_dtype(op, "expert_scales", expert_scales, (torch.float32,))
    bs, k = expert_ids.shape
    w = ep_world_size
    local, a = _common_check(op, bs, k, expand_x.shape[1], w, ep_rank_id, moe_expert_num, **common)
    check_shape(op, "expand_x", expand_x, (a, expand_x.shape[1]))
    check_dtype(op, "assist_info_for_combine", handle, (torch.int32,))
    check_shape(op, "assist_info_for_combine", handle, (handle_length(bs, k, a),))
    check_dtype(op, "ep_send_counts", ep_send_counts, (torch.int32,))
    check_shape(op, "ep_send_counts", ep_send_counts, (w * local,))
    check(comm_quant_mode in (0, 2), op, f"comm_quant_mode={comm_quant_mode}; allowed: 0 (none), 2 (int8)")
    if comm_quant_mode == 2:
        unsupported(op, "comm_quant_mode=2 (int8 on the wire)")
    for name, value in (
        ("expand_scales", expand_scales),
        ("shared_expert_x", shared_expert_x),
        ("ori_x", ori_x),
        ("const_expert_alpha_1", const_expert_alpha_1),
        ("const_expert_alpha_2", const_expert_alpha_2),
        ("const_expert_v", const_expert_v),
    ):
        if value is not None:
            unsupported(op, f"{name} (shared / special experts, A2 scales)")
    _mask_check(op, x_active_mask, bs, k)
    check_npu_limit(
        expand_x.dtype in (torch.float16, torch.bfloat16),
        op,
        f"expand_x has dtype {expand_x.dtype}; allowed: bf16, f16",
        kind=FP32,
    )
    return bs, k, local, a


def moe_distribute_combine_v2(
    expand_x,
    expert_ids,
    assist_info_for_combine,
    ep_send_counts,
    expert_scales,
    group_ep,
    ep_world_size,
    ep_rank_id,
    moe_expert_num,
    *,
    tp_send_counts=None,
    x_active_mask=None,
    expand_scales=None,
    shared_expert_x=None,
    elastic_info=None,
    ori_x=None,
    const_expert_alpha_1=None,
    const_expert_alpha_2=None,
    const_expert_v=None,
    performance_info=None,
    group_tp="",
    tp_world_size=0,
    tp_rank_id=0,
    expert_shard_type=0,
    shared_expert_num=1,
    shared_expert_rank_num=0,
    global_bs=0,
    comm_quant_mode=0,
    comm_alg="",
    zero_expert_num=0,
    copy_expert_num=0,
    const_expert_num=0,
):
    w, r, handle = ep_world_size, ep_rank_id, assist_info_for_combine
    bs, k, local, a = _combine_check(
        expand_x,
        expert_ids,
        handle,
        ep_send_counts,
        expert_scales,
        w,
        r,
        moe_expert_num,
        tp_send_counts,
        x_active_mask,
        expand_scales,
        shared_expert_x,
        ori_x,
        const_expert_alpha_1,
        const_expert_alpha_2,
        const_expert_v,
        comm_quant_mode,
        tp_world_size=tp_world_size,
        tp_rank_id=tp_rank_id,
        expert_shard_type=expert_shard_type,
        shared_expert_num=shared_expert_num,
        shared_expert_rank_num=shared_expert_rank_num,
        global_bs=global_bs,
        comm_alg=comm_alg,
        zero_expert_num=zero_expert_num,
        copy_expert_num=copy_expert_num,
        const_expert_num=const_expert_num,
        elastic_info=elastic_info,
        performance_info=performance_info,
    )
    h = expand_x.shape[1]
    check(
        int(handle[-1]) == HANDLE_MAGIC,
        _COMBINE,
        "assist_info_for_combine was not written by the portable npu_moe_distribute_dispatch_v2 (a torch_npu "
        "handle is opaque and cannot be mixed with the portable kernels, spec §13.16)",
    )
    check(int(handle[-2]) == h, _COMBINE, f"expand_x has H={h} but the dispatch moved rows of H={int(handle[-2])}")
    group = _ep_group(_COMBINE, group_ep, w, r)
    _, slots, sends = _handle_regions(a, bs, k, w)
    row_idx, sent_to = handle[slots], handle[sends]
    active = _active_slots(x_active_mask, expert_ids).reshape(-1)
    check(
        bool(((row_idx >= 0) == active).all()),
        _COMBINE,
        "x_active_mask differs from the one given to the dispatch that wrote assist_info_for_combine",
    )
    dest = expert_ids.reshape(-1)[active].long() // local
    check(
        torch.equal(torch.bincount(dest, minlength=w)[:w].to(torch.int32), sent_to),
        _COMBINE,
        "expert_ids is not the tensor given to the dispatch that wrote assist_info_for_combine",
    )
    ends = ep_send_counts.long()  # [e'*W + s]: inclusive block end
    cnt = torch.diff(ends, prepend=ends.new_zeros(1)).view(local, w)  # [L, W]: rows from rank s
    n_recv = int(ends[-1]) if ends.numel() else 0
    check(
        n_recv <= a and bool((cnt >= 0).all()),
        _COMBINE,
        f"ep_send_counts is not a dispatch's ep_recv_counts (non-decreasing, ending at n_recv <= A={a})",
    )
    # 1. (e', s, t) -> (s, e', t): re_routing with the roles of rank and expert swapped
    back, _, _, _ = moe_re_routing(expand_x[:n_recv], cnt)
    # 2. all_to_all_v back: each source rank gets its rows in the order it sent them
    returned = _exchange_rows(_COMBINE, _as_bytes(back), group, cnt.sum(0).tolist(), sent_to.tolist())
    returned = returned.view(expand_x.dtype)
    # 3-5. slot (t, j) <- returned row; out[t] = sum_j scale * row in fp32 (ascending j), rounded once
    out = moe_finalize_routing(returned.float(), None, None, None, expert_scales, row_idx, None, drop_pad_mode=2)
    return out.to(expand_x.dtype)


def _combine_fake(
    expand_x,
    expert_ids,
    assist_info_for_combine,
    ep_send_counts,
    expert_scales,
    group_ep,
    ep_world_size,
    ep_rank_id,
    moe_expert_num,
    *,
    tp_send_counts=None,
    x_active_mask=None,
    expand_scales=None,
    shared_expert_x=None,
    elastic_info=None,
    ori_x=None,
    const_expert_alpha_1=None,
    const_expert_alpha_2=None,
    const_expert_v=None,
    performance_info=None,
    group_tp="",
    tp_world_size=0,
    tp_rank_id=0,
    expert_shard_type=0,
    shared_expert_num=1,
    shared_expert_rank_num=0,
    global_bs=0,
    comm_quant_mode=0,
    comm_alg="",
    zero_expert_num=0,
    copy_expert_num=0,
    const_expert_num=0,
):
    bs, _, _, _ = _combine_check(
        expand_x,
        expert_ids,
        assist_info_for_combine,
        ep_send_counts,
        expert_scales,
        ep_world_size,
        ep_rank_id,
        moe_expert_num,
        tp_send_counts,
        x_active_mask,
        expand_scales,
        shared_expert_x,
        ori_x,
        const_expert_alpha_1,
        const_expert_alpha_2,
        const_expert_v,
        comm_quant_mode,
        tp_world_size=tp_world_size,
        tp_rank_id=tp_rank_id,
        expert_shard_type=expert_shard_type,
        shared_expert_num=shared_expert_num,
        shared_expert_rank_num=shared_expert_rank_num,
        global_bs=global_bs,
        comm_alg=comm_alg,
        zero_expert_num=zero_expert_num,
        copy_expert_num=copy_expert_num,
        const_expert_num=const_expert_num,
        elastic_info=elastic_info,
        performance_info=performance_info,
    )
    return expand_x.new_empty((bs, expand_x.shape[1]))


register(_COMBINE, moe_distribute_combine_v2, _combine_fake)
