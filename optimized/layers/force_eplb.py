"""`model_config.force_eplb` (older files: `perfect_eplb`): the recipe's forced balanced routing, its benchmark mode.

The gate still computes its softmax top-k and keeps the top-k weights; only the expert ids are replaced, in every MoE
layer, by a deterministic balanced list built from the global rank g and the rows reaching this rank's MoE (slot j
row-major, K = top_k, E = num_experts, ep = moe_ep_size, L = E / ep):
- prefill: ids[j] = (j + g) % E;
- decode, moe_tp_size > 1: ids[j] = (j % ep) * L + j // ep (slot j on EP rank j % ep); needs B * K <= E;
- decode, moe_tp_size == 1: step = L if rows * K < E and ep > 1 else 1;
  ids[j] = ((j + g // step * step) * step + (g + (j % K) // ep) % step) % E (the `(j % K) // ep` term keeps a row from
  naming one expert twice when top_k > ep; zero otherwise, the recipe's ids exactly).
Which g (`EplbRows`): OWN rows use this rank's g (SP prefill, attention DP); JOB rows, held by every rank and summed
by the exchange, use g = 0 everywhere; EP_SPLIT rows (MC2 decode) get the ids of the EP rank that dispatches them.
Built from torch.arange on the input's device and host ints only, so a graph bakes in nothing but its shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optimized.config import check_force_eplb

JOB, OWN, EP_SPLIT = "job", "own", "ep_split"


@dataclass(frozen=True)
class EplbRows:
    """What a phase's MoE input holds on this rank: decode or prefill and whose rows (force_eplb's balanced ids), and
    how many of its first rows are tokens (EPLB's load counts them alone; None: every row), the rest padding."""

    decode: bool
    owner: str = JOB
    real: int | None = None


class BalancedRouting:
    """The balanced expert ids [rows, K] int32 of one rank (`__call__`); sizes and ranks only, no tensor."""

    def __init__(self, num_experts: int, top_k: int, moe_tp_size: int, moe_ep):
        why = check_force_eplb(num_experts, top_k, moe_tp_size)
        if why:
            raise ValueError(f"model_config.force_eplb: {why}")
        self.num_experts, self.top_k, self.moe_tp_size = num_experts, top_k, moe_tp_size
        self.ep = moe_ep.size
        self.global_rank = moe_ep.ranks[moe_ep.rank]
        # moe_ep groups are strided by moe_tp_size: EP rank e of this group is global rank first_ep_rank + e * moe_tp.
        self.first_ep_rank = moe_ep.ranks[0]

    def __call__(self, rows: int, where: EplbRows, device) -> torch.Tensor:
        E, K = self.num_experts, self.top_k
        j = torch.arange(rows * K, device=device).view(rows, K)  # slot index, row-major
        if not where.decode:
            g = 0 if where.owner == JOB else self.global_rank
            return ((j + g) % E).to(torch.int32)
        if self.moe_tp_size > 1:
            why = check_force_eplb(E, K, self.moe_tp_size, rows)
            if why:
                raise ValueError(f"model_config.force_eplb: {why}")
            return ((j % self.ep) * (E // self.ep) + j // self.ep).to(torch.int32)
        if where.owner == EP_SPLIT:
            n = -(-rows // self.ep)  # rows each EP rank dispatches
            t = torch.arange(rows, device=device).view(rows, 1)
            g = self.first_ep_rank + (t // n) * self.moe_tp_size  # the row's dispatching rank
            return self._decode_ep(((t % n) * K) + torch.arange(K, device=device), g, n).to(torch.int32)
        return self._decode_ep(j, 0 if where.owner == JOB else self.global_rank, rows).to(torch.int32)

    def _decode_ep(self, j, g, rows: int):
        """The moe_tp_size == 1 decode rule for `rows` rows of one rank with global rank g (int or per-row tensor)."""
        E, K, ep = self.num_experts, self.top_k, self.ep
        step = E // ep if rows * K < E and ep > 1 else 1
        return ((j + g // step * step) * step + (g + (j % K) // ep) % step) % E
