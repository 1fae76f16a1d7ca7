"""The decode's MoE plan: when decode uses MC2 dispatch / combine, what it moves, and the HCCL buffer it needs.

The recipe's rule (`uses_mc2_decode`): decode runs `moe_infer_dispatch_combine` (npu_moe_distribute_dispatch_v2 /
combine_v2) whenever the experts are not tensor-split (moe_tp_size == 1) and spread over more than one rank
(moe_ep_size > 1); otherwise the MoE block's own `moe_infer_tp` (expert range + all_reduce).

Decode holds every token on every rank of the attention TP group, so the MC2 exchange hands each EP rank its
n = ceil(B / P) of the B tokens (the tail masked with `x_active_mask`), dispatches, combines and all-gathers the
results. Per rank and MoE layer (exactly what the portable kernels send, `mc2_volume`):

- dispatch: the counts of its L local experts plus its BS, (P - 1) * (L + 1) * 8 bytes, and every slot routed to
  another rank's expert as one row of H activations plus its (token, k slot), H * act_bytes + 8 bytes;
- combine: every row it received from another rank goes back, H * act_bytes bytes;
- all_gather: its n combined rows to the P - 1 others, (P - 1) * n * H * act_bytes.

Under uniform routing a rank sends and receives n * top_k * (P - 1) / P slots. A decode step sends that per MoE
layer (`decode_volume`, `step_volume`).

Under attention data parallel (`attn_dp`, D groups of attention TP T, MoE EP P = world) DP group d decodes its
m = ceil(B / D) requests and each of its ranks holds n = ceil(m / T) of them (`dp_rows`; the tail padding, masked
with `x_active_mask`, never sent). MC2 runs on those own rows with the dispatch and combine above and no all_gather.
Per layer, attention all-gathers the group's T * n rows before merged_qkv_proj and reduce-scatters o_proj's
partial sums back: (T - 1) * n * H * act_bytes bytes each (`attention_dp_volume`); after lm_head (TP 1) the
logits of every rank's rows are gathered once over the job, each rank's shard padded to the largest, n rows:
(W - 1) * n * V * act_bytes (`logits_dp_volume`). `dp_step_volume` adds them up for one decode step. The tensor-parallel decode (`moe_infer_tp`, experts split over MoE TP T
and EP E) instead all-reduces every rank's [B, H] partial sums over MoE TP, then over MoE EP:
2 * (T - 1) * B * H * act_bytes / T + 2 * (E - 1) * B * H * act_bytes / E bytes (`tp_volume`).

HCCL buffer (`mc2_buffer_mb`): on the NPU every MC2 peer writes into a window of HCCL_BUFFSIZE MB on the receiving
rank, and the window must hold the worst case (every token of every rank routed to one rank's experts): the
dispatch's A = n * P * min(L, top_k) rows of H activations plus their token information (top_k int32 per row),
the combine's n * top_k rows coming back, each phase double-buffered, plus a fixed reserve for the
notify / IPC area.

Setting it (`hccl_buffsize_setting`, `apply_hccl_buffsize`): HCCL reads HCCL_BUFFSIZE when it creates a
communicator, so it is exported before the process group exists, and only for the hccl backend with an MC2 decode.
A value the user exported is never lowered: at least the need, it is kept; below it, the run stops with an error
naming the variable, its value and the need. Unset, it is exported only when the need exceeds HCCL's own default
window (200 MB), which otherwise holds the exchange (the variable sizes every communicator of the process, so a
smaller value would shrink the other groups' windows too).
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping

from optimized import platform
from optimized.config import ParallelConfig, is_sparse_layer
from optimized.errors import UsageError
from optimized.distributed.prefill_plan import EpVolume

DISPATCH = "npu_moe_distribute_dispatch_v2"
COMBINE = "npu_moe_distribute_combine_v2"
COUNT_BYTES = 8          # counts and BS travel as int64
META_BYTES = 8           # each dispatched row carries (source token, k slot) as int32
TOKEN_INFO_BYTES = 4     # per top-k slot, in the HCCL window's worst case
RESERVE_MB = 2           # notify / IPC area of the HCCL window
MB = 1 << 20
HCCL_BUFFSIZE = "HCCL_BUFFSIZE"
HCCL_DEFAULT_MB = 200    # HCCL's window per communicator when HCCL_BUFFSIZE is unset


def uses_mc2_decode(parallel: ParallelConfig) -> bool:
    return parallel.moe_tp_size == 1 and parallel.moe_ep_size > 1


def tokens_per_rank(batch: int, ep: int) -> int:
    """n: the decode tokens each EP rank dispatches (the last ranks' tails masked)."""
    return -(-batch // ep)


def dp_rows(batch: int, parallel: ParallelConfig) -> int:
    """n under attention DP: the rows each rank holds of its DP group's m = ceil(B / D) decode tokens, ceil(m / T)."""
    return tokens_per_rank(tokens_per_rank(batch, parallel.attn_dp_size), parallel.attn_tp_size)


def mc2_volume(tokens: int, hidden: int, top_k: int, ep: int, num_experts: int, act_bytes: int,
               slots_out: float | None = None, slots_in: float | None = None, gather: bool = True) -> EpVolume:
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


def decode_volume(parallel: ParallelConfig, batch: int, hidden: int, top_k: int, num_experts: int, act_bytes: int,
                  slots_out: float | None = None, slots_in: float | None = None) -> EpVolume:
    """Bytes one rank sends in one MoE layer of a decode step of `batch` requests, by collective, for the decode
    path this layout runs (`mc2_volume` or `tp_volume`; the slot counts only matter for MC2). Under attention DP:
    MC2 on each rank's `dp_rows`, nothing gathered."""
    if uses_mc2_decode(parallel) and parallel.attn_dp_size > 1:
        return mc2_volume(dp_rows(batch, parallel), hidden, top_k, parallel.moe_ep_size, num_experts, act_bytes,
                          slots_out, slots_in, gather=False)
    if uses_mc2_decode(parallel):
        ep = parallel.moe_ep_size
        return mc2_volume(tokens_per_rank(batch, ep), hidden, top_k, ep, num_experts, act_bytes, slots_out, slots_in)
    return tp_volume(batch, hidden, parallel.moe_tp_size, parallel.moe_ep_size, act_bytes)


def moe_layer_count(hf_config, num_layers: int | None = None) -> int:
    n = hf_config.num_hidden_layers if num_layers is None else num_layers
    return sum(is_sparse_layer(hf_config, i) for i in range(n))


def step_volume(hf_config, parallel: ParallelConfig, batch: int, act_bytes: int,
                num_layers: int | None = None) -> EpVolume:
    """The MoE bytes one rank sends in one decode step (every MoE layer, uniform routing)."""
    one = decode_volume(parallel, batch, hf_config.hidden_size, hf_config.num_experts_per_tok,
                        hf_config.num_experts, act_bytes)
    layers = moe_layer_count(hf_config, num_layers)
    return EpVolume(one.scheme, {op: layers * b for op, b in one.parts.items()})


def attention_dp_volume(parallel: ParallelConfig, batch: int, hidden: int, act_bytes: int) -> dict[str, int]:
    """Bytes one rank sends in one decoder layer's attention of an attention-DP decode step: the all_gather of the
    group's rows before merged_qkv_proj and the reduce_scatter after o_proj, (T - 1) * n * H * act_bytes each
    (nothing with attention TP 1)."""
    t = parallel.attn_tp_size
    each = (t - 1) * dp_rows(batch, parallel) * hidden * act_bytes
    return {"all_gather": each, "reduce_scatter": each} if t > 1 else {}


def logits_dp_volume(parallel: ParallelConfig, batch: int, vocab: int, act_bytes: int) -> dict[str, int]:
    """Bytes one rank sends gathering the logits once over the job after an attention-DP decode step's lm_head
    (lm_head TP 1): its shard padded to the largest, n rows of V."""
    return {"all_gather": (parallel.world_size - 1) * dp_rows(batch, parallel) * vocab * act_bytes}


def dp_step_volume(hf_config, parallel: ParallelConfig, batch: int, act_bytes: int, num_layers: int | None = None,
                   moe: dict[str, int] | None = None) -> dict[str, dict[str, int]]:
    """One attention-DP decode step's bytes per rank, by part ("attention", "moe", "logits") and collective:
    every layer's attention, every MoE layer's MC2 (`moe`: their sum with the routing's slot counts; default
    uniform routing) and the logits gather. Needs lmhead_tp_size and embed_tp_size 1 (their collectives are not
    in it)."""
    if parallel.attn_dp_size < 2 or parallel.lmhead_tp_size != 1 or parallel.embed_tp_size != 1:
        raise ValueError(f"dp_step_volume is the attention-DP decode with embed_tp_size and lmhead_tp_size 1; got "
                         f"attn_dp_size {parallel.attn_dp_size}, embed_tp_size {parallel.embed_tp_size}, "
                         f"lmhead_tp_size {parallel.lmhead_tp_size}")
    layers = hf_config.num_hidden_layers if num_layers is None else num_layers
    attention = {op: layers * b for op, b in attention_dp_volume(parallel, batch, hf_config.hidden_size,
                                                                  act_bytes).items()}
    moe = step_volume(hf_config, parallel, batch, act_bytes, num_layers).parts if moe is None else dict(moe)
    return {"attention": attention, "moe": moe,
            "logits": logits_dp_volume(parallel, batch, hf_config.vocab_size, act_bytes)}


def by_collective(parts: dict[str, dict[str, int]]) -> dict[str, int]:
    """`dp_step_volume`'s parts summed per collective (as `comm.count_bytes` keys them)."""
    out: dict[str, int] = {}
    for part in parts.values():
        for op, b in part.items():
            out[op] = out.get(op, 0) + b
    return out


def mc2_buffer_mb(batch: int, top_k: int, hidden: int, ep: int, num_experts: int, act_bytes: int = 2) -> int:
    """HCCL_BUFFSIZE (MB) the MC2 decode needs for a decode batch of `batch` requests (see the module notes)."""
    n = tokens_per_rank(batch, ep)
    rows = n * ep * min(num_experts // ep, top_k)
    dispatch = rows * (hidden * act_bytes + top_k * TOKEN_INFO_BYTES)
    combine = n * top_k * hidden * act_bytes
    return math.ceil(2 * (dispatch + combine) / MB) + RESERVE_MB


def describe(hf_config, parallel: ParallelConfig, batch: int, act_bytes: int) -> str:
    """One line for the start of a run: the decode's MoE path and, for MC2, its HCCL buffer and volume."""
    if not uses_mc2_decode(parallel):
        return (f"decode MoE path: moe_infer_tp (moe_tp_size {parallel.moe_tp_size}, moe_ep_size "
                f"{parallel.moe_ep_size}: expert range + all_reduce)")
    h, k, e, ep = hf_config.hidden_size, hf_config.num_experts_per_tok, hf_config.num_experts, parallel.moe_ep_size
    if parallel.attn_dp_size > 1:   # each rank dispatches its own share of its DP group's batch, nothing gathered
        n = dp_rows(batch, parallel)
        return (f"decode MoE path: moe_infer_dispatch_combine (MC2 over moe_ep {ep}) under attention DP "
                f"({parallel.attn_dp_size} DP groups x attention TP {parallel.attn_tp_size}, batch {batch}: "
                f"{n} tokens per rank, its own); HCCL buffer >= {mc2_buffer_mb(n * ep, k, h, ep, e, act_bytes)} MB "
                f"(HCCL_BUFFSIZE); logits gathered once after lm_head")
    vol = mc2_volume(tokens_per_rank(batch, ep), h, k, ep, e, act_bytes)
    return (f"decode MoE path: moe_infer_dispatch_combine (MC2 over moe_ep {ep}, batch {batch}: "
            f"{tokens_per_rank(batch, ep)} tokens per rank); HCCL buffer >= {mc2_buffer_mb(batch, k, h, ep, e, act_bytes)}"
            f" MB (HCCL_BUFFSIZE); per MoE layer and rank ~{vol.total} B (uniform routing)")


def hccl_buffsize_setting(backend: str, needed_mb: int | None, environ: Mapping[str, str]) -> str | None:
    """The HCCL_BUFFSIZE value to export before the process group exists, or None to leave the environment alone.

    backend: the torch.distributed backend (`platform.dist_backend()`); needed_mb: the MC2 decode's need
    (`mc2_buffer_mb`), None without an MC2 decode. Raises UsageError when the user exported a value below the need
    (or one that is not a positive integer)."""
    if backend != "hccl" or needed_mb is None:
        return None
    raw = environ.get(HCCL_BUFFSIZE)
    if raw is not None:
        try:
            value = int(raw.strip())
        except ValueError:
            value = 0
        if value < 1:
            raise UsageError(f"{HCCL_BUFFSIZE}={raw!r} must be a positive integer (MB); the MC2 decode needs at "
                             f"least {needed_mb}")
        if value < needed_mb:
            raise UsageError(f"{HCCL_BUFFSIZE}={raw} (MB) is below the {needed_mb} MB the MC2 decode's dispatch / "
                             f"combine window needs; export {HCCL_BUFFSIZE}={needed_mb} or more, or unset it")
        return None
    return str(needed_mb) if needed_mb > HCCL_DEFAULT_MB else None


def needed_buffer_mb(hf_config, parallels, batch: int, act_bytes: int) -> int | None:
    """The largest HCCL buffer (MB) the MC2 decodes of these layouts need; None when none runs MC2."""
    # Under attention DP every rank dispatches its n = dp_rows, as if the batch were n * P.
    needs = [mc2_buffer_mb(dp_rows(batch, p) * p.moe_ep_size if p.attn_dp_size > 1 else batch,
                           hf_config.num_experts_per_tok, hf_config.hidden_size, p.moe_ep_size,
                           hf_config.num_experts, act_bytes) for p in parallels if uses_mc2_decode(p)]
    return max(needs) if needs else None


def apply_hccl_buffsize(hf_config, parallel: ParallelConfig | list[ParallelConfig], batch: int, act_bytes: int, *,
                        backend: str | None = None, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Export HCCL_BUFFSIZE for the MC2 decode of `parallel` (one layout or several run by the same processes),
    before `init_distributed()`; see `hccl_buffsize_setting`. Returns the value exported, or None."""
    environ = os.environ if environ is None else environ
    parallels = [parallel] if isinstance(parallel, ParallelConfig) else list(parallel)
    value = hccl_buffsize_setting(backend or platform.dist_backend(),
                                  needed_buffer_mb(hf_config, parallels, batch, act_bytes), environ)
    if value is not None:
        environ[HCCL_BUFFSIZE] = value
    return value
