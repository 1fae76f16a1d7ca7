"""The decode's MoE plan: what an MC2 dispatch / combine decode moves, and the HCCL window its group needs (whether
decode runs MC2 is the execution plan's decision: optimized/path_plan.py).

- Bytes per rank and MoE layer, exactly what the portable kernels send: `mc2_volume` / `decode_volume` (dispatch,
  combine, all_gather), `tp_volume` (the tensor-parallel all-reduces), `step_volume` for a decode step; under
  attention DP `dp_rows`, `attention_dp_volume`, `lm_head_dp_volume` and `dp_step_volume`.
- The window: `mc2_window_mb` (the recipe's fullmesh_v2 rule: 512-byte aligned token slots, both phases
  double-buffered, an 11 MB reserve, at least HCCL's 200 MB), `window_for(hf_config, parallel, batch, act_bytes)`
  from the most tokens one rank dispatches, `mc2_group_options` for the MC2 group alone; `check_mc2_window` raises
  Mc2WindowError when a batch needs more than the group was built with, `check_mc2_limits` Mc2LimitError past the
  NPU kernels' size limits.

The formulas and the window's derivation: docs/parallel.md.
"""

from __future__ import annotations

import math

from optimized.config import ParallelConfig, is_sparse_layer
from optimized.errors import UsageError
from optimized.ops import mc2
from optimized.distributed.prefill_plan import EpVolume

DISPATCH = "npu_moe_distribute_dispatch_v2"
COMBINE = "npu_moe_distribute_combine_v2"
COUNT_BYTES = 8  # counts and BS travel as int64
META_BYTES = 8  # each dispatched row carries (source token, k slot) as int32
WINDOW_ALIGN = 512  # every token slot of the MC2 window starts 512-byte aligned
FULL_MESH_PIECE = 480  # fullmesh_v2 moves a token's data in 480-byte pieces, one per aligned slot
WINDOW_RESERVE_MB = 11  # the window's own areas beyond the token slots (the recipe's reserve)
MB = 1 << 20
HCCL_DEFAULT_MB = 200  # HCCL's window per communicator unless a group sets its own


def tokens_per_rank(batch: int, ep: int) -> int:
    """n: the decode tokens each EP rank dispatches (the last ranks' tails masked)."""
    return -(-batch // ep)


def dp_rows(batch: int, parallel: ParallelConfig) -> int:
    """n under attention DP: the rows each rank holds of its DP group's m = ceil(B / D) decode tokens, ceil(m / T)."""
    return tokens_per_rank(tokens_per_rank(batch, parallel.attn_dp_size), parallel.attn_tp_size)


def mc2_volume(
    tokens: int,
    hidden: int,
    top_k: int,
    ep: int,
    num_experts: int,
    act_bytes: int,
    slots_out: float | None = None,
    slots_in: float | None = None,
    gather: bool = True,
) -> EpVolume:
    """Bytes one rank sends in one MoE layer of an MC2 decode step of `tokens` (= n) tokens per rank.

    slots_out / slots_in: slots this rank sends to / receives from other ranks (default: their expectation under
    uniform routing, n * top_k * (P - 1) / P). gather: the results are all-gathered (False under attention DP,
    where each rank keeps its own rows)."""
    expected = tokens * top_k * (ep - 1) / ep
    slots_out = expected if slots_out is None else slots_out
    slots_in = expected if slots_in is None else slots_in
    row = hidden * act_bytes
    parts = {
        DISPATCH: round((ep - 1) * (num_experts // ep + 1) * COUNT_BYTES + slots_out * (row + META_BYTES)),
        COMBINE: round(slots_in * row),
    }
    if gather:
        parts["all_gather"] = (ep - 1) * tokens * row
    return EpVolume("mc2" if gather else "mc2-dp", parts)


def tp_volume(tokens: int, hidden: int, moe_tp: int, moe_ep: int, act_bytes: int) -> EpVolume:
    """Bytes one rank sends in one MoE layer of a tensor-parallel decode step (`moe_infer_tp`) of `tokens` (= B)
    tokens: the [B, H] partial sums all-reduced over MoE TP, then over MoE EP (each counted as reduce-scatter +
    all-gather, 2 * (P - 1) * size // P, as `comm.count_bytes` does)."""
    size = tokens * hidden * act_bytes
    return EpVolume("tp", {"all_reduce": sum(2 * (p - 1) * size // p for p in (moe_tp, moe_ep))})


def decode_volume(
    parallel: ParallelConfig,
    batch: int,
    hidden: int,
    top_k: int,
    num_experts: int,
    act_bytes: int,
    slots_out: float | None = None,
    slots_in: float | None = None,
) -> EpVolume:
    """Bytes one rank sends in one MoE layer of a decode step of `batch` requests, by collective, for the decode
    path this layout runs (`mc2_volume` or `tp_volume`; the slot counts only matter for MC2). Under attention DP:
    MC2 on each rank's `dp_rows`, nothing gathered."""
    if parallel.mc2_decode and parallel.attn_dp_size > 1:
        return mc2_volume(
            dp_rows(batch, parallel),
            hidden,
            top_k,
            parallel.moe_ep_size,
            num_experts,
            act_bytes,
            slots_out,
            slots_in,
            gather=False,
        )
    if parallel.mc2_decode:
        ep = parallel.moe_ep_size
        return mc2_volume(tokens_per_rank(batch, ep), hidden, top_k, ep, num_experts, act_bytes, slots_out, slots_in)
    return tp_volume(batch, hidden, parallel.moe_tp_size, parallel.moe_ep_size, act_bytes)


def moe_layer_count(hf_config, num_layers: int | None = None) -> int:
    n = hf_config.num_hidden_layers if num_layers is None else num_layers
    return sum(is_sparse_layer(hf_config, i) for i in range(n))


def step_volume(
    hf_config, parallel: ParallelConfig, batch: int, act_bytes: int, num_layers: int | None = None
) -> EpVolume:
    """The MoE bytes one rank sends in one decode step (every MoE layer, uniform routing)."""
    one = decode_volume(
        parallel, batch, hf_config.hidden_size, hf_config.num_experts_per_tok, hf_config.num_experts, act_bytes
    )
    layers = moe_layer_count(hf_config, num_layers)
    return EpVolume(one.scheme, {op: layers * b for op, b in one.parts.items()})


def attention_dp_volume(parallel: ParallelConfig, batch: int, hidden: int, act_bytes: int) -> dict[str, int]:
    """Bytes one rank sends in one decoder layer's attention of an attention-DP decode step: the all_gather of the
    group's rows before merged_qkv_proj and the reduce_scatter after o_proj, (T - 1) * n * H * act_bytes each
    (nothing with attention TP 1)."""
    t = parallel.attn_tp_size
    each = (t - 1) * dp_rows(batch, parallel) * hidden * act_bytes
    return {"all_gather": each, "reduce_scatter": each} if t > 1 else {}


def lm_head_dp_volume(parallel: ParallelConfig, batch: int, hidden: int, act_bytes: int) -> dict[str, int]:
    """Bytes one rank sends gathering its DP group's final hidden states over the attention TP group for lm_head
    (TP 1) after an attention-DP decode step: its n rows to T - 1 peers (nothing at T = 1)."""
    t = parallel.attn_tp_size
    return {"all_gather": (t - 1) * dp_rows(batch, parallel) * hidden * act_bytes} if t > 1 else {}


def dp_step_volume(
    hf_config,
    parallel: ParallelConfig,
    batch: int,
    act_bytes: int,
    num_layers: int | None = None,
    moe: dict[str, int] | None = None,
) -> dict[str, dict[str, int]]:
    """One attention-DP decode step's bytes per rank, by part ("attention", "moe", "lm_head") and collective:
    every layer's attention, every MoE layer's MC2 (`moe`: their sum with the routing's slot counts; default
    uniform routing) and lm_head's hidden-state gather. Needs lmhead_tp_size and embed_tp_size 1 (their collectives are
    not
    in it)."""
    if parallel.attn_dp_size < 2 or parallel.lmhead_tp_size != 1 or parallel.embed_tp_size != 1:
        raise ValueError(
            f"dp_step_volume is the attention-DP decode with embed_tp_size and lmhead_tp_size 1; got "
            f"attn_dp_size {parallel.attn_dp_size}, embed_tp_size {parallel.embed_tp_size}, "
            f"lmhead_tp_size {parallel.lmhead_tp_size}"
        )
    layers = hf_config.num_hidden_layers if num_layers is None else num_layers
    attention = {
        op: layers * b for op, b in attention_dp_volume(parallel, batch, hf_config.hidden_size, act_bytes).items()
    }
    moe = step_volume(hf_config, parallel, batch, act_bytes, num_layers).parts if moe is None else dict(moe)
    return {
        "attention": attention,
        "moe": moe,
        "lm_head": lm_head_dp_volume(parallel, batch, hf_config.hidden_size, act_bytes),
    }


def by_collective(parts: dict[str, dict[str, int]]) -> dict[str, int]:
    """`dp_step_volume`'s parts summed per collective (as `comm.count_bytes` keys them)."""
    out: dict[str, int] = {}
    for part in parts.values():
        for op, b in part.items():
            out[op] = out.get(op, 0) + b
    return out


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def mc2_window_mb(tokens: int, top_k: int, hidden: int, ep: int, num_experts: int, act_bytes: int = 2) -> int:
    """The MC2 group's HCCL window (MB) when each rank dispatches at most `tokens` tokens (see the module notes)."""
    row = hidden * act_bytes
    dispatch = (num_experts // ep) * tokens * ep * (-(-row // FULL_MESH_PIECE) * WINDOW_ALIGN)
    combine = top_k * tokens * _align(row, WINDOW_ALIGN)
    return max(math.ceil(2 * (dispatch + combine) / MB) + WINDOW_RESERVE_MB, HCCL_DEFAULT_MB)


def max_tokens_per_rank(parallel: ParallelConfig, batch: int) -> int:
    """n: the most tokens one rank dispatches in an MC2 decode step of `batch` requests."""
    return dp_rows(batch, parallel) if parallel.attn_dp_size > 1 else tokens_per_rank(batch, parallel.moe_ep_size)


def window_for(hf_config, parallel: ParallelConfig, batch: int, act_bytes: int) -> int | None:
    """The HCCL window (MB) the MC2 group of `parallel` needs for decode batches up to `batch`; None without MC2."""
    if not parallel.mc2_decode:
        return None
    return mc2_window_mb(
        max_tokens_per_rank(parallel, batch),
        hf_config.num_experts_per_tok,
        hf_config.hidden_size,
        parallel.moe_ep_size,
        parallel.expert_slots(hf_config.num_experts),  # each rank's slots receive (EPLB: redundant ones too)
        act_bytes,
    )


def mc2_group_options(backend: str, window_mb: int):
    """The process-group options that give the MC2 group its window: hccl's `hccl_buffer_size` (on 950 also exported
    as HCCL_BUFFSIZE: `platform.PlatformSettings`); None elsewhere (gloo and nccl have no such window)."""
    from optimized import platform

    return platform.applied_settings().group_options(backend, window_mb)


class Mc2WindowError(UsageError, ValueError):
    """A decode batch that needs more MC2 window than its group was built with."""


def check_mc2_window(hf_config, parallel: ParallelConfig, batch: int, act_bytes: int, window_mb: int | None) -> None:
    """Start-up check: the MC2 group's window (`ParallelState.moe_ep_mc2.window_mb`) holds a decode of `batch`."""
    need = window_for(hf_config, parallel, batch, act_bytes)
    if need is not None and window_mb is not None and need > window_mb:
        raise Mc2WindowError(
            f"a decode batch of {batch} needs an MC2 window of {need} MB, but the MC2 EP group was "
            f"built with {window_mb} MB; build the groups for this batch: ParallelState.build(..., "
            f"mc2_window_mb=decode_plan.window_for(hf_config, parallel, {batch}, {act_bytes}))"
        )


MC2_COMM_ALG = "fullmesh_v2"  # the dispatch's algorithm (layers/exchange.py): its limits apply
MC2_HIDDEN = mc2.HIDDEN_RANGE


class Mc2LimitError(UsageError, ValueError):
    """The layout's MC2 decode breaks a size limit of the NPU's dispatch / combine kernels."""


def mc2_limit_violations(hf_config, parallel: ParallelConfig, batch: int) -> list[str]:
    """The MC2 kernel limits a decode of `batch` requests in this layout breaks ([] without MC2 or within them)."""
    if not parallel.mc2_decode:
        return []
    w, k, h = parallel.moe_ep_size, hf_config.num_experts_per_tok, hf_config.hidden_size
    e = parallel.expert_slots(hf_config.num_experts)  # moe_expert_num: the physical slots (EPLB: redundant too)
    bs = max_tokens_per_rank(parallel, batch)
    k_max, bs_max, (lo, hi) = mc2.max_top_k(MC2_COMM_ALG), mc2.max_bs(MC2_COMM_ALG), MC2_HIDDEN
    limits = [
        (w <= mc2.MAX_EP_WORLD_SIZE, f"moe_ep_size {w} > {mc2.MAX_EP_WORLD_SIZE}"),
        (e <= mc2.MAX_EXPERTS, f"num_experts {e} > {mc2.MAX_EXPERTS}"),
        (k <= k_max, f"num_experts_per_tok {k} > {k_max} ({MC2_COMM_ALG})"),
        (bs <= bs_max, f"{bs} tokens per rank (batch {batch}) > {bs_max} ({MC2_COMM_ALG})"),
        (lo <= h <= hi, f"hidden_size {h} outside [{lo}, {hi}]"),
        (e <= mc2.MAX_SLOTS, f"L * W = num_experts {e} > {mc2.MAX_SLOTS}"),
    ]
    return [why for ok, why in limits if not ok]


def check_mc2_limits(hf_config, parallel: ParallelConfig, batch: int, enforce: bool) -> list[str]:
    """Start-up check of the MC2 kernel limits: raises naming every broken limit when `enforce` (an NPU host, or
    strict mode); otherwise returns them (the portable kernels take any size: the tiny fixtures' hidden 64)."""
    broken = mc2_limit_violations(hf_config, parallel, batch)
    if broken and enforce:
        raise Mc2LimitError(
            f"the MC2 decode (moe_tp_size 1, moe_ep_size {parallel.moe_ep_size}) breaks the NPU "
            f"kernels' limits: {'; '.join(broken)}; lower scheduler_config.batch_size, or decode "
            f"without MC2 (moe_tp_size > 1)"
        )
    return broken
