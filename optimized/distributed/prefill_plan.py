"""The sequence-parallel prefill's volumes: what each MoE EP scheme and the SP attention move (which path and scheme
run is the plan's decision, optimized/path_plan.py).

With P = attn_tp_size = moe_ep_size ranks each holding n = ceil(S / P) of S packed prompt tokens:
- which scheme runs is `path_plan.decide_paths`'s (the recipe's rule, allgather when top_k >= moe_ep_size; an
  explicit `moe_ep_scheme` wins); the two volumes' ratio is P / top_k.
- `allgather_volume`: 2 (P - 1) n H activations per rank, plus ids and fp32 weights (P - 1) n top_k 4 bytes each;
- `alltoall_volume`: the slots routed to other ranks' experts out and back, 2 n top_k (P - 1) / P rows of H under
  uniform routing (or the routing's actual slot counts), plus the per-expert counts;
- `mx=True` (W4A8): the activations that go into a quantized matmul as MXFP8, `mx_row_bytes(H)` a row; what comes
  back out of the experts stays 16-bit.
`ep_comm_volumes` gives both schemes' bytes, which the plan's start-up lines print. docs/parallel.md tells the
prefill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from optimized.config import ParallelConfig

INDEX_BYTES = 4  # int32 expert ids
WEIGHT_BYTES = 4  # float32 routing weights
COUNT_BYTES = 8  # int64 per-expert token counts


@dataclass(frozen=True)
class EpVolume:
    """Bytes one rank sends in one MoE layer of the SP prefill, by collective."""

    scheme: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def mx_row_bytes(width: int) -> int:
    """Bytes of one MXFP8 row of `width` elements on the wire: the E4M3 bytes plus the (H/64, 2) scale bytes."""
    return width + 2 * math.ceil(width / 64)


def allgather_volume(
    tokens_per_rank: int, hidden: int, top_k: int, ep: int, act_bytes: int, mx: bool = False
) -> EpVolume:
    """mx: the tokens are gathered as MXFP8 (W4A8); the partial sums are reduce-scattered in `act_bytes`."""
    peers = ep - 1
    row = mx_row_bytes(hidden) if mx else hidden * act_bytes
    return EpVolume(
        "allgather",
        {
            "all_gather": peers * tokens_per_rank * (row + top_k * (INDEX_BYTES + WEIGHT_BYTES)),
            "reduce_scatter": peers * tokens_per_rank * hidden * act_bytes,
        },
    )


def alltoall_volume(
    tokens_per_rank: int,
    hidden: int,
    top_k: int,
    ep: int,
    num_experts: int,
    act_bytes: int,
    slots_out: float | None = None,
    slots_in: float | None = None,
    mx: bool = False,
) -> EpVolume:
    """slots_out / slots_in: expert slots this rank sends to / receives from other ranks (default: their
    expectation under uniform routing, n * top_k * (P - 1) / P). mx: the slots are dispatched as MXFP8 (W4A8),
    the expert outputs come back in `act_bytes`."""
    expected = tokens_per_rank * top_k * (ep - 1) / ep
    slots_out = expected if slots_out is None else slots_out
    slots_in = expected if slots_in is None else slots_in
    return EpVolume(
        "alltoall",
        {
            "all_to_all": round(
                (ep - 1) * (num_experts // ep) * COUNT_BYTES
                + slots_out * (mx_row_bytes(hidden) if mx else hidden * act_bytes)
                + slots_in * hidden * act_bytes
            ),
        },
    )


def attention_volume(
    tokens_per_rank: int, hidden: int, width_per_rank: int, tp: int, act_bytes: int, mx: bool = False
) -> EpVolume:
    """Bytes one rank sends around one SP attention: the all_gather of its tokens' normed hidden states and the
    all_to_all of its heads' outputs for the other ranks' tokens (`width_per_rank` = heads per rank * head_dim)."""
    # The all_to_all sends only the real scale bytes, one per 32-block (the (W/64, 2) pair layout would pad).
    gather_row = mx_row_bytes(hidden) if mx else hidden * act_bytes
    a2a_row = width_per_rank + math.ceil(width_per_rank / 32) if mx else width_per_rank * act_bytes
    return EpVolume(
        "attention",
        {"all_gather": (tp - 1) * tokens_per_rank * gather_row, "all_to_all": (tp - 1) * tokens_per_rank * a2a_row},
    )


def ep_comm_volumes(
    hf_config, parallel: ParallelConfig, num_tokens: int, act_bytes: int, mx: bool = False
) -> dict[str, EpVolume]:
    """Both schemes' bytes per rank per MoE layer for a prefill of `num_tokens` packed tokens (uniform routing)."""
    ep = parallel.moe_ep_size
    n = math.ceil(num_tokens / ep)
    h, k, e = hf_config.hidden_size, hf_config.num_experts_per_tok, hf_config.num_experts
    return {
        "allgather": allgather_volume(n, h, k, ep, act_bytes, mx),
        "alltoall": alltoall_volume(n, h, k, ep, e, act_bytes, mx=mx),
    }
