"""`model_config.force_eplb` (older files: `perfect_eplb`): the recipe's forced balanced routing, its benchmark mode.

The gate still computes its softmax top-k and keeps the top-k weights (renormalized when norm_topk_prob); only the
expert ids are replaced, in every MoE layer, by a deterministic balanced list built from the global rank `g` and the
rows reaching this rank's MoE (`j` the slot index over those rows, row-major, K = top_k, E = num_experts,
ep = moe_ep_size, L = E / ep):

- prefill: ids[j] = (j + g) % E, viewed [rows, K]   (the recipe's rule; rows: this rank's own rows);
- decode, moe_tp_size > 1: ids[j] = (j % ep) * L + j // ep: slot j on EP rank j % ep, experts from the bottom of each
  rank's range. With ep == 1 this is the recipe's `arange(B * K)`; the recipe's ep > 1 list (B*K ids per EP rank
  concatenated, ep*K ids per row) is no top-k routing, so its slots are dealt round-robin over the EP ranks instead.
  Needs B * K <= E (checked at start-up and per step);
- decode, moe_tp_size == 1: step = L if rows * K < E and ep > 1 else 1;
  ids[j] = ((j + g // step * step) * step + (g + (j % K) // ep) % step) % E. The recipe's rule, but for the
  `(j % K) // ep` term: with top_k > ep the recipe's rule gives one row the same expert twice, so a row's slots past
  the first ep move on to the EP rank's next expert (zero when top_k <= ep: the recipe's ids exactly). With one EP
  rank, step 1 (the recipe's step = E would send every slot to expert g % E).

Which rows and which `g` (`EplbRows.owner`), since this model's row layout is not the recipe's:
- OWN: the rows are this rank's own tokens (SP prefill, attention DP): the recipe's rule with this rank's g;
- JOB: every rank holds the same rows and the exchange sums every rank's share (`moe_infer_tp`), so every rank must
  route a row alike: g = 0 for all (the recipe's per-rank g would sum different experts' partial outputs);
- EP_SPLIT: every rank holds the same B rows and EP rank e dispatches rows [e*n, (e+1)*n), n = ceil(B / ep) (MC2
  decode without attention DP): row t gets the ids EP rank t // n's global rank builds for its n rows, the same
  tensor on every rank.
Everything is built from torch.arange on the input's device and host ints (shapes, ranks): nothing per step a graph
would bake in besides the shape it is captured for.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from optimized.config import check_force_eplb

JOB, OWN, EP_SPLIT = "job", "own", "ep_split"


@dataclass(frozen=True)
class EplbRows:
    """What a phase's MoE input holds on this rank, for the balanced ids: decode or prefill, and whose rows."""
    decode: bool
    owner: str = JOB


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
        j = torch.arange(rows * K, device=device).view(rows, K)                     # slot index, row-major
        if not where.decode:
            g = 0 if where.owner == JOB else self.global_rank
            return ((j + g) % E).to(torch.int32)
        if self.moe_tp_size > 1:
            why = check_force_eplb(E, K, self.moe_tp_size, rows)
            if why:
                raise ValueError(f"model_config.force_eplb: {why}")
            return ((j % self.ep) * (E // self.ep) + j // self.ep).to(torch.int32)
        if where.owner == EP_SPLIT:
            n = -(-rows // self.ep)                                                 # rows each EP rank dispatches
            t = torch.arange(rows, device=device).view(rows, 1)
            g = self.first_ep_rank + (t // n) * self.moe_tp_size                     # the row's dispatching rank
            return self._decode_ep(((t % n) * K) + torch.arange(K, device=device), g, n).to(torch.int32)
        return self._decode_ep(j, 0 if where.owner == JOB else self.global_rank, rows).to(torch.int32)

    def _decode_ep(self, j, g, rows: int):
        """The moe_tp_size == 1 decode rule for `rows` rows of one rank with global rank g (int or per-row tensor)."""
        E, K, ep = self.num_experts, self.top_k, self.ep
        step = E // ep if rows * K < E and ep > 1 else 1
        return ((j + g // step * step) * step + (g + (j % K) // ep) % step) % E
