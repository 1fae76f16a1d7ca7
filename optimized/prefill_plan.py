"""The sequence-parallel prefill's plan: which MoE EP scheme runs, and what each scheme moves.

With `prefill_opt` on, the P = attn_tp_size = moe_ep_size ranks each hold n = ceil(S / P) of the S packed
prompt tokens (the last rank's tail padded). The MoE then needs each token's hidden state at the ranks
holding its top_k experts, in one of two ways (the recipe's rule in `choose_ep_scheme`):

- allgather: every rank gathers all hidden states, expert ids and weights, computes its experts' share
  of every token and reduce-scatters the partial sums: 2 x (P - 1) * n * H activations per rank
  (plus the ids and fp32 weights, (P - 1) * n * top_k * 4 bytes each);
- alltoall (double routing): every rank sends each of its n * top_k expert slots to the rank holding the
  expert and gets the result back: per rank, the slots routed to other ranks' experts out and the slots
  other ranks route to its experts in, 2 x n * top_k * (P - 1) / P rows of H under uniform routing, plus
  the per-expert counts ((P - 1) * E / P int64).

The ratio is P / top_k, hence the recipe's rule: allgather when top_k >= moe_ep_size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ParallelConfig

INDEX_BYTES = 4      # int32 expert ids
WEIGHT_BYTES = 4     # float32 routing weights
COUNT_BYTES = 8      # int64 per-expert token counts


def choose_ep_scheme(parallel: ParallelConfig, top_k: int) -> str:
    """'allgather' or 'alltoall': parallel_config.moe_ep_scheme, or for `auto` the recipe's volume rule."""
    if parallel.moe_ep_scheme != "auto":
        return parallel.moe_ep_scheme
    return "allgather" if top_k >= parallel.moe_ep_size else "alltoall"


@dataclass(frozen=True)
class EpVolume:
    """Bytes one rank sends in one MoE layer of the SP prefill, by collective."""

    scheme: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def allgather_volume(tokens_per_rank: int, hidden: int, top_k: int, ep: int, act_bytes: int) -> EpVolume:
    peers = ep - 1
    return EpVolume("allgather", {
        "all_gather": peers * tokens_per_rank * (hidden * act_bytes + top_k * (INDEX_BYTES + WEIGHT_BYTES)),
        "reduce_scatter": peers * tokens_per_rank * hidden * act_bytes,
    })


def alltoall_volume(tokens_per_rank: int, hidden: int, top_k: int, ep: int, num_experts: int, act_bytes: int,
                    slots_out: float | None = None, slots_in: float | None = None) -> EpVolume:
    """slots_out / slots_in: expert slots this rank sends to / receives from other ranks (default: their
    expectation under uniform routing, n * top_k * (P - 1) / P)."""
    expected = tokens_per_rank * top_k * (ep - 1) / ep
    slots_out = expected if slots_out is None else slots_out
    slots_in = expected if slots_in is None else slots_in
    return EpVolume("alltoall", {
        "all_to_all": round((ep - 1) * (num_experts // ep) * COUNT_BYTES + (slots_out + slots_in) * hidden * act_bytes),
    })


def ep_comm_volumes(hf_config, parallel: ParallelConfig, num_tokens: int, act_bytes: int) -> dict[str, EpVolume]:
    """Both schemes' bytes per rank per MoE layer for a prefill of `num_tokens` packed tokens (uniform routing)."""
    ep = parallel.moe_ep_size
    n = math.ceil(num_tokens / ep)
    h, k, e = hf_config.hidden_size, hf_config.num_experts_per_tok, hf_config.num_experts
    return {"allgather": allgather_volume(n, h, k, ep, act_bytes),
            "alltoall": alltoall_volume(n, h, k, ep, e, act_bytes)}


def describe(hf_config, parallel: ParallelConfig, num_tokens: int, act_bytes: int) -> str:
    """One line for the start of a run: the prefill path, the MoE EP scheme and both schemes' volumes."""
    if not parallel.sp_prefill:
        return (f"prefill path: tensor parallel (every rank runs all tokens; MoE EP by expert range + all_reduce); "
                f"prefill_opt {parallel.prefill_opt}")
    k, ep = hf_config.num_experts_per_tok, parallel.moe_ep_size
    scheme = choose_ep_scheme(parallel, k)
    why = (f"auto: top_k {k} {'>=' if k >= ep else '<'} moe_ep_size {ep}" if parallel.moe_ep_scheme == "auto"
           else "moe_ep_scheme")
    vol = ep_comm_volumes(hf_config, parallel, num_tokens, act_bytes)
    return (f"prefill path: sequence parallel over {parallel.attn_tp_size} ranks (Attention SP+TP), MoE EP scheme "
            f"{scheme} ({why}); per MoE layer and rank for {num_tokens} tokens: allgather "
            f"{vol['allgather'].total} B, alltoall ~{vol['alltoall'].total} B (uniform routing)")
