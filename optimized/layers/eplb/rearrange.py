"""Moving expert weights to a new placement: every tensor of the layer's experts, scales included, whatever its
runtime layout (NZ-cast, MX scale pairs, transposed views), slot by slot.

Every expert tensor of a `FusedMoEGMM` is stacked over its local slots (leading dimension = slots per rank), so a
slot's bytes are `t[slot]` in any layout: a move copies whole slots, in place (the parameters keep their storage, so
an NZ layout recorded on it stays, a captured graph keeps its addresses, and the CPU kernels' packed copies see the
new version). A slot a rank needs from another rank comes through one all_gather per tensor over the MoE EP group
(each rank's slots as raw bytes), run on every rank in the same order; when no rank needs a remote slot, nothing is
communicated. Moving only the changed slots point to point would move less at scale; the all_gather is the simple,
lockstep form.
"""

from __future__ import annotations

import torch

from optimized.distributed import collectives as comm
from optimized.layers.eplb.placement import ExpertPlacement


def expert_tensors(experts) -> dict[str, torch.Tensor]:
    """The experts' tensors, every one stacked over the local slots (refused by name otherwise)."""
    out = dict(experts.named_parameters(recurse=False))
    for name, t in out.items():
        if t.dim() == 0 or t.shape[0] != experts.local_experts:
            raise ValueError(
                f"parallel_config.enable_eplb: expert tensor {name} {tuple(t.shape)} is not stacked over the "
                f"{experts.local_experts} local expert slots; this expert format cannot be rearranged"
            )
    return out


def sources(old: ExpertPlacement, new: ExpertPlacement, rank: int) -> list[tuple[int, int]]:
    """(local slot, old global slot to copy it from) for each slot of `rank` whose expert changes: a slot of this
    rank that held the expert if any (no transfer), else the expert's first old slot."""
    moves = []
    for slot in new.rank_slots(rank):
        e = new.physical_to_logical[slot]
        if old.physical_to_logical[slot] == e:
            continue
        here = [s for s in old.rank_slots(rank) if old.physical_to_logical[s] == e]
        moves.append((slot - rank * new.slots_per_rank, (here or old.replicas(e))[0]))
    return moves


def _all_slots(t: torch.Tensor, group, ranks: int) -> torch.Tensor:
    """Every EP rank's slots of `t` [S, ...] -> [ranks * S, ...] (moved as bytes: any dtype travels)."""
    raw = t.detach().contiguous().reshape(t.shape[0], -1).view(torch.uint8)
    gathered = comm.all_gather(raw, group)
    return gathered.view(t.dtype).view(ranks * t.shape[0], *t.shape[1:])


@torch.no_grad()
def rearrange_experts(experts, new: ExpertPlacement) -> int:
    """Put the experts of `experts` (a FusedMoEGMM) where `new` places them, in lockstep over its MoE EP group;
    returns how many slots of this rank changed."""
    old, ep = experts.placement, experts.moe_ep
    if new.num_physical != old.num_physical or new.num_logical != old.num_logical or new.ep_size != old.ep_size:
        raise ValueError(f"a rearrangement keeps the slots: {old.num_physical} -> {new.num_physical}")
    per_rank = [sources(old, new, r) for r in range(ep.size)]
    remote = any(
        not old.rank_slots(r).start <= src < old.rank_slots(r).stop for r, m in enumerate(per_rank) for _, src in m
    )
    moves, first = per_rank[ep.rank], ep.rank * old.slots_per_rank
    for t in expert_tensors(experts).values():
        if remote:
            src_of = _all_slots(t, ep.group, ep.size)
            offset = 0
        else:  # every source slot is local: a snapshot, since a source may itself be overwritten
            src_of, offset = t.detach().clone(), first
        for local, src in moves:
            t.data[local].copy_(src_of[src - offset])
    experts.placement = new
    return len(moves)
