"""One MoE layer's expert placement: which logical expert every physical expert slot holds.

With `num_redundant_experts` R, a layer of E logical experts has E + R physical slots, split evenly over the MoE EP
group (EP rank r holds slots [r * S, (r + 1) * S), S = (E + R) / moe_ep_size); every logical expert has at least one
slot, hot ones several. Routing picks logical experts (top-k); `to_physical` then picks one replica per choice,
before the token exchange, so the exchanges move physical ids and the combine keeps the logical choice's weight.

The replica rule: the replicas of logical expert e are its slots in ascending order; the choice of e by row t of the
rows routed together on this rank (t counted from 0) goes to replica `t mod (number of replicas of e)`. Any rule that
only picks among copies of the same weights gives the same expert output; this one is deterministic, spreads a hot
expert's rows evenly over its replicas, and reads only the device tables (no host read, a fixed shape for graphs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optimized.errors import UsageError


class PlacementError(UsageError, ValueError):
    """A placement that cannot hold the layer's experts (the key or the slot named)."""


@dataclass(frozen=True)
class ExpertPlacement:
    """physical_to_logical[s]: the logical expert physical slot s holds; num_logical: E; ep_size: moe_ep_size."""

    physical_to_logical: tuple[int, ...]
    num_logical: int
    ep_size: int

    def __post_init__(self):
        p2l, e = tuple(int(x) for x in self.physical_to_logical), self.num_logical
        object.__setattr__(self, "physical_to_logical", p2l)
        if len(p2l) < e or len(p2l) % self.ep_size:
            raise PlacementError(
                f"parallel_config.num_redundant_experts: num_experts + num_redundant_experts = {len(p2l)} physical "
                f"experts must be at least num_experts ({e}) and divisible by moe_ep_size ({self.ep_size})"
            )
        bad = [s for s, x in enumerate(p2l) if not 0 <= x < e]
        if bad:
            raise PlacementError(f"expert placement: slot {bad[0]} names logical expert {p2l[bad[0]]}, not in [0, {e})")
        missing = sorted(set(range(e)) - set(p2l))
        if missing:
            raise PlacementError(f"expert placement: logical experts {missing} have no physical slot")

    @classmethod
    def default(cls, num_experts: int, num_redundant: int, ep_size: int) -> "ExpertPlacement":
        """Slot s holds expert s mod E: every expert in order, then one more copy of experts 0 .. R-1."""
        return cls(tuple(s % num_experts for s in range(num_experts + num_redundant)), num_experts, ep_size)

    @property
    def num_physical(self) -> int:
        return len(self.physical_to_logical)

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    def replicas(self, expert: int) -> list[int]:
        """The physical slots of logical `expert`, ascending (the replica rule's order)."""
        return [s for s, x in enumerate(self.physical_to_logical) if x == expert]

    def rank_slots(self, rank: int) -> range:
        s = self.slots_per_rank
        return range(rank * s, (rank + 1) * s)

    def tables(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(replica table [E, R + 1] int64: row e the slots of e, padded with its first; counts [E] int64). The
        width R + 1 is the most replicas any expert can have, so every placement of this layer fits one shape."""
        width = self.num_redundant + 1
        table = torch.empty(self.num_logical, width, dtype=torch.int64)
        counts = torch.empty(self.num_logical, dtype=torch.int64)
        for e in range(self.num_logical):
            slots = self.replicas(e)
            table[e] = torch.tensor(slots + [slots[0]] * (width - len(slots)))
            counts[e] = len(slots)
        return table.to(device), counts.to(device)


def to_physical(topk_idx: torch.Tensor, table: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Logical expert ids [T, K] -> physical slot ids [T, K] int32 by the replica rule (module docstring)."""
    ids = topk_idx.long()
    row = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
    return table[ids, row % counts[ids]].to(torch.int32)


def eplb_placement(hf_config, groups) -> ExpertPlacement | None:
    """A MoE layer's initial placement under parallel_config.enable_eplb (None when off)."""
    p = groups.parallel
    if not p.enable_eplb:
        return None
    return ExpertPlacement.default(hf_config.num_experts, p.num_redundant_experts, groups.moe_ep.size)
