"""The rebalance policy: from each logical expert's routed-token count, a new placement of one MoE layer.

The greedy rule (DeepSeek's and vLLM's): give the R redundant slots one at a time to the expert whose load per
replica is highest, then pack the replicas, heaviest first, each onto the EP rank with the least load so far that has
a free slot (and, where one can, no copy of that expert yet). A replica's load is its expert's load over its replica
count (the replica rule spreads an expert's rows evenly). Within a rank an expert keeps the slot it had, so a
placement that changes little moves few weights, and a placement whose most loaded rank is not lighter than the
current one's (by that estimate) is not taken: nothing moves. Ties break by the smaller expert id and rank: every
rank computes the same placement from the same counts.
"""

from __future__ import annotations

from optimized.layers.eplb.placement import ExpertPlacement


def replica_counts(load: list[float], num_redundant: int) -> list[int]:
    counts = [1] * len(load)
    for _ in range(num_redundant):
        e = max(range(len(load)), key=lambda x: (load[x] / counts[x], -x))
        counts[e] += 1
    return counts


def greedy_placement(load: list[float], old: ExpertPlacement) -> ExpertPlacement:
    """The new placement of the layer `old` places, for per-logical-expert `load` (E numbers)."""
    ep, per_rank = old.ep_size, old.slots_per_rank
    counts = replica_counts([float(x) for x in load], old.num_redundant)
    replicas = sorted(
        ((load[e] / counts[e], e) for e in range(len(load)) for _ in range(counts[e])), key=lambda r: (-r[0], r[1])
    )
    held: list[list[int]] = [[] for _ in range(ep)]
    weight = [0.0] * ep
    for w, e in replicas:
        free = [r for r in range(ep) if len(held[r]) < per_rank]
        fresh = [r for r in free if e not in held[r]] or free
        r = min(fresh, key=lambda x: (weight[x], x))
        held[r].append(e)
        weight[r] += w
    p2l: list[int] = []
    for r in range(ep):
        slots = [old.physical_to_logical[s] for s in old.rank_slots(r)]
        mine, local = list(held[r]), [None] * per_rank
        for i, e in enumerate(slots):  # an expert already here keeps its slot
            if e in mine:
                local[i] = e
                mine.remove(e)
        rest = iter(sorted(mine))
        p2l += [e if e is not None else next(rest) for e in local]
    new = ExpertPlacement(tuple(p2l), old.num_logical, ep)
    # No better than the placement in use by the same estimate: keep it (nothing moves).
    return new if _max_rank_load(new, load) < _max_rank_load(old, load) else old


def _max_rank_load(placement: ExpertPlacement, load: list[float]) -> float:
    """The most loaded EP rank's expected rows: each slot gets its expert's load over the expert's replica count."""
    counts = [len(placement.replicas(e)) for e in range(placement.num_logical)]
    p2l = placement.physical_to_logical
    return max(sum(load[p2l[s]] / counts[p2l[s]] for s in placement.rank_slots(r)) for r in range(placement.ep_size))


def rank_imbalance(slot_load: list[float], ep_size: int) -> float:
    """Max over mean of the rows each EP rank's slots received (1.0: perfectly even; 0 rows: 1.0)."""
    per = len(slot_load) // ep_size
    ranks = [sum(slot_load[r * per : (r + 1) * per]) for r in range(ep_size)]
    mean = sum(ranks) / ep_size
    return max(ranks) / mean if mean else 1.0
