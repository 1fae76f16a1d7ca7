"""`bench`'s expert-load imbalance: the most loaded EP rank's routed tokens over the mean, on a skewed routing, with
and without expert load balancing, beside force_eplb's balanced ids (the best case).

The routing is drawn (nothing runs a model): each step's `rows` tokens pick top_k distinct experts with Zipf
popularity p(e) ~ 1 / (rank of e)^skew, the ranks a seeded permutation of the experts. Without EPLB expert e sits on
EP rank e // (E / ep). With EPLB the first `window` steps are counted on the default placement, the greedy policy
places the layer (layers/eplb/policy.py), and the remaining steps are routed to slots by the replica rule
(layers/eplb/placement.py) and counted per rank: the same modules a serving rebalance runs.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from optimized.layers.eplb.placement import ExpertPlacement, to_physical
from optimized.layers.eplb.policy import greedy_placement, rank_imbalance


def skewed_routing(steps: int, rows: int, num_experts: int, top_k: int, skew: float, seed: int) -> torch.Tensor:
    """[steps, rows, top_k] expert ids, distinct per row, Zipf-skewed popularity."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_experts, generator=g)
    p = torch.empty(num_experts)
    p[order] = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64).pow(skew).float()
    ids = torch.multinomial(p.expand(steps * rows, -1), top_k, replacement=False, generator=g)
    return ids.view(steps, rows, top_k).to(torch.int32)


def _rank_tokens(slot_ids: torch.Tensor, slots: int) -> list[float]:
    return torch.bincount(slot_ids.flatten().long(), minlength=slots).double().tolist()


def measure(
    num_experts: int,
    top_k: int,
    ep: int,
    rows: int,
    redundant: tuple[int, ...],
    steps: int = 64,
    window: int = 16,
    skew: float = 1.0,
    seed: int = 0,
) -> dict:
    """{"no_eplb": x, "eplb_r{R}": x for each R of `redundant` whose slots divide over ep, "force_eplb": x}."""
    from optimized.layers.force_eplb import JOB, BalancedRouting, EplbRows

    ids = skewed_routing(steps, rows, num_experts, top_k, skew, seed)
    counted, served = ids[:window], ids[window:]
    out = {"no_eplb": rank_imbalance(_rank_tokens(served, num_experts), ep)}
    load = torch.bincount(counted.flatten().long(), minlength=num_experts).tolist()
    for r in redundant:
        if (num_experts + r) % ep:
            continue
        placement = greedy_placement(load, ExpertPlacement.default(num_experts, r, ep))
        table, counts = placement.tables()
        slots = torch.stack([to_physical(step, table, counts) for step in served])
        out[f"eplb_r{r}"] = rank_imbalance(_rank_tokens(slots, placement.num_physical), ep)
    moe_ep = SimpleNamespace(size=ep, rank=0, ranks=list(range(ep)))
    balanced = BalancedRouting(num_experts, top_k, 1, moe_ep)(rows, EplbRows(decode=True, owner=JOB), "cpu")
    out["force_eplb"] = rank_imbalance(_rank_tokens(balanced.expand(len(served), -1, -1), num_experts), ep)
    return out


def format_lines(result: dict, ep: int, rows: int) -> list[str]:
    named = "  ".join(f"{k} {v:.3f}" for k, v in result.items())
    return [
        "",
        f"expert load imbalance (max / mean of per-EP-rank routed tokens) on a skewed routing (Zipf 1.0), EP {ep}, "
        f"{rows} rows per step; EPLB placed from 16 counted steps, then 48 steps routed by it (eplb_rR: R "
        "redundant slots); force_eplb: the balanced ids, the best case:",
        f"  {named}",
    ]
