"""Moving expert weights to a new placement: every tensor of the layer's experts, scales included, whatever its
runtime layout (NZ-cast, MX scale pairs, transposed views), slot by slot.

Every expert tensor of a `FusedMoEGMM` is stacked over its local slots (leading dimension = slots per rank), so a
slot's bytes are `t[slot]` in any layout: a move copies whole slots, in place (the parameters keep their storage, so
an NZ layout recorded on it stays, a captured graph keeps its addresses, and the CPU kernels' packed copies see the
new version). The slots a rank needs from another rank (known to every rank: the placements are) travel in one
all_to_all per tensor over the MoE EP group, as raw bytes with uneven splits: each slot goes only to the ranks that
need it, run on every rank in the same order; when no rank needs a remote slot, nothing is communicated.
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


def remote_needs(moves_of: list[list[tuple[int, int]]], per: int) -> list[list[int]]:
    """For each EP rank, the old global slots it copies from other ranks (ascending, each once)."""
    return [sorted({src for _, src in moves if src // per != r}) for r, moves in enumerate(moves_of)]


def _remote_slots(t: torch.Tensor, group, per: int, rank: int, needs: list[list[int]]) -> dict[int, torch.Tensor]:
    """The slots this rank needs from the others (`needs[rank]`) of `t` [S, ...], by old global slot: every rank sends
    each rank the slots of its own that rank needs, as bytes, in ascending order."""
    send = [[s - rank * per for s in needs[r] if s // per == rank] for r in range(len(needs))]
    take = [[s for s in needs[rank] if s // per == q] for q in range(len(needs))]
    rows = [i for slots in send for i in slots]
    raw = t.detach()[rows].contiguous().reshape(len(rows), t[0].numel()).view(torch.uint8)
    got = comm.all_to_all_single(raw, group, [len(x) for x in take], [len(x) for x in send])
    slots = [s for x in take for s in x]
    return dict(zip(slots, got.view(t.dtype).view(len(slots), *t.shape[1:])))


@torch.no_grad()
def rearrange_experts(experts, new: ExpertPlacement) -> int:
    """Put the experts of `experts` (a FusedMoEGMM) where `new` places them, in lockstep over its MoE EP group;
    returns how many slots of this rank changed."""
    old, ep = experts.placement, experts.moe_ep
    if new.num_physical != old.num_physical or new.num_logical != old.num_logical or new.ep_size != old.ep_size:
        raise ValueError(f"a rearrangement keeps the slots: {old.num_physical} -> {new.num_physical}")
    per = old.slots_per_rank
    moves_of = [sources(old, new, r) for r in range(ep.size)]
    needs = remote_needs(moves_of, per)
    moves, first = moves_of[ep.rank], ep.rank * per
    for t in expert_tensors(experts).values():
        remote = _remote_slots(t, ep.group, per, ep.rank, needs) if any(needs) else {}
        # local sources first copied aside: a source slot may itself be overwritten by another move
        local = {src: t.detach()[src - first].clone() for _, src in moves if src // per == ep.rank}
        for slot, src in moves:
            # through detach(), not .data: the write bumps the parameter's version, which the CPU GEMMs' packed
            # copies of it are checked against
            t.detach()[slot].copy_(local[src] if src in local else remote[src])
    experts.placement = new
    return len(moves)
