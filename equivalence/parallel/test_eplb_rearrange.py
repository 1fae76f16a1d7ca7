"""Rearranging experts while serving (optimized/layers/eplb/rearrange.py) is indistinguishable from loading them
where they now sit, scales included, over real gloo ranks (world 2 and 4, moe_ep = world: slots move across ranks
through the all_to_all, each only to the ranks that copy it, which the bytes each rank sends pin):

- without redundant slots, a layer loaded in order and rearranged to a drawn permutation holds, tensor for tensor
  and bit for bit, what a layer loaded from the checkpoint with its experts permuted that way holds (MXFP8 / MXFP4
  weights in their runtime layouts, NZ-cast where the model casts them, the same NZ layout recorded, and their E8M0
  scale pairs; W4A4's experts, FP4 packed along N and contiguous, are the ND case: their expert tensors are the
  weights and scale pairs only, the Hadamard rotation acting on the attention linears only);
- with redundant slots, a layer rearranged from the default placement to a drawn one holds what a layer built with
  the drawn placement loaded;
- the layer runs once before it is rearranged, so a kernel's cached copy of the old weights (the oneDNN packed
  copies of bf16 expert weights on the CPU) must follow the move for the outputs to agree;
- a planted rearrangement that moves the weights and not their scales is caught: its tensors differ, and so does
  the layer's output.
"""

from __future__ import annotations

import pytest
import torch

from equivalence.support.compare import assert_bitwise_equal
from equivalence.support.dist import get_pool
from equivalence.support.eplb_runs import (
    CHECKPOINTS,
    CONFIG,
    DTYPES,
    E,
    eplb_block,
    permuted_experts_source,
    placements,
)
from equivalence.support.parallel_support import rank_model, run_property
from equivalence.support.strategies import hidden_states, layout, seeds

pytestmark = pytest.mark.distributed

WORLD = 2
LAYOUTS = {w: layout(w, attn_tp_size=w, moe_tp_size=1) for w in (2, 4)}
ND_EXPERTS = ("float32", "w4a4")  # expert tensors kept ND: nothing NZ-cast to keep
W4A4_EXPERT_TENSORS = {"w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"}


def _tensors(block) -> dict[str, tuple[torch.Tensor, object]]:
    """Every tensor the experts hold stacked over their local slots (parameters, buffers, and tensors kept on the
    module or its quant method, so per-expert state a rearrangement does not move is compared too): its values and
    the NZ layout recorded on its storage (None: ND)."""
    from optimized.ops.formats import nz_layout

    experts = block.experts
    held = dict(experts.named_parameters(recurse=False)) | dict(experts.named_buffers(recurse=False))
    for owner, where in ((experts, ""), (experts.quant_method, "quant_method.")):
        held |= {where + k: v for k, v in vars(owner).items() if isinstance(v, torch.Tensor)}
    per_slot = {k: v for k, v in held.items() if v.dim() and v.shape[0] == experts.local_experts}
    return {k: (v.detach().clone(), nz_layout(v)) for k, v in per_slot.items()}


def _rearrange_task(rank, world, quant, p2l, x, planted: bool):
    from optimized.distributed import collectives as comm
    from optimized.layers.eplb import rearrange
    from optimized.layers.eplb.placement import ExpertPlacement
    from optimized.layers.quantization.lifecycle import process_weights_after_loading

    path = str(CHECKPOINTS[quant]("tiny"))
    base = rank_model(path, LAYOUTS[world], DTYPES[quant])
    redundant = len(p2l) - E
    moved = eplb_block(path, base, 0, ExpertPlacement.default(E, redundant, world).physical_to_logical)
    target = ExpertPlacement(p2l, E, world)
    keep = rearrange.expert_tensors
    if planted:  # the bug a rearrangement once had: the weights move, their scales stay
        rearrange.expert_tensors = lambda experts: {k: v for k, v in keep(experts).items() if "scale" not in k}
    with torch.no_grad():  # a forward first: whatever a kernel keeps of the old weights must follow the move
        moved(x)
    slot_bytes = sum(t[0].numel() * t.element_size() for t in keep(moved.experts).values())
    try:
        with comm.count_bytes() as sent:
            moved.apply_placement(target)
    finally:
        rearrange.expert_tensors = keep
    if redundant:  # loaded where the placement puts each expert
        loaded = eplb_block(path, base, 0, p2l)
    else:  # a checkpoint saved with its experts permuted, loaded in order
        from optimized.layers.moe import Qwen3MoeSparseMoeBlock

        prefix = "model.layers.0.mlp"
        with torch.device(base.embed_tokens.weight.device):
            loaded = Qwen3MoeSparseMoeBlock(
                base.config, base.groups.moe_tp, base.groups.moe_ep, base.dtype, False, base.quant_config, prefix
            )
        with torch.no_grad():
            loaded.load(permuted_experts_source(path, p2l), prefix)
        process_weights_after_loading(loaded, weight_nz=base.weight_nz)
    with torch.no_grad():
        out_moved = moved(x)
        # the permuted checkpoint's expert e is logical expert p2l[e]: route it there
        out_loaded = loaded(x) if redundant else _routed_as(loaded, x, p2l)
    return _tensors(moved), _tensors(loaded), out_moved, out_loaded, (sent.bytes, slot_bytes)


def _slots_sent(p2l, world: int) -> list[int]:
    """Per EP rank, how many (slot, receiving rank) pairs it must send: a rank copies a new slot's expert from the
    first old slot holding it unless one of its own old slots held it, and only from another rank."""
    from optimized.layers.eplb.placement import ExpertPlacement

    old, new = ExpertPlacement.default(E, len(p2l) - E, world), ExpertPlacement(p2l, E, world)
    per, wanted = old.slots_per_rank, []
    for r in range(world):
        for slot in new.rank_slots(r):
            e = new.physical_to_logical[slot]
            mine = any(old.physical_to_logical[s] == e for s in old.rank_slots(r))
            if old.physical_to_logical[slot] != e and not mine:
                wanted.append((r, old.replicas(e)[0]))
    return [len({(r, src) for r, src in wanted if src // per == q}) for q in range(world)]


def _routed_as(block, x, perm):
    """`block` (loaded from the permuted checkpoint) on x with each logical choice e sent to its slot perm^-1(e)."""
    inverse = torch.empty(len(perm), dtype=torch.int32)
    inverse[torch.tensor(perm)] = torch.arange(len(perm), dtype=torch.int32)
    weights, ids = block.route(x)
    return block.moe_infer_tp(block.experts, x, inverse[ids.long()], weights)


def _run(quant, p2l, seed, planted, world=WORLD):
    x = hidden_states("random", seed, 5, CONFIG.hidden_size, DTYPES[quant])
    return get_pool(world).run(_rearrange_task, quant, p2l, x, planted, timeout=120)


# World 4: a slot one rank needs must reach it from the rank holding it, and no other (the uneven all_to_all).
@pytest.mark.parametrize(
    "quant, world", [(q, 2) for q in ("float32", "bfloat16", "w8a8", "w4a8", "w4a4")] + [("float32", 4), ("w4a8", 4)]
)
def test_rearranged_experts_equal_a_checkpoint_loaded_with_them_in_place(quant, world):
    def check(p2l, seed):
        sends = _slots_sent(p2l, world)
        for rank, (moved, loaded, out_moved, out_loaded, (sent, slot)) in enumerate(
            _run(quant, p2l, seed, False, world)
        ):
            what = f"{quant} world {world} rank {rank} placement {p2l}"
            # each slot another rank copies goes to that rank alone, once: nothing else leaves this rank
            assert set(sent) <= {"all_to_all"} and sent.get("all_to_all", 0) == sends[rank] * slot, f"{what}: {sent}"
            assert moved.keys() == loaded.keys()
            assert any(layout is not None for _, layout in moved.values()) or quant in ND_EXPERTS, what
            if quant == "w4a4":  # no other per-expert state (rotation, tuning) is left for the move to miss
                assert set(moved) == W4A4_EXPERT_TENSORS, f"{what}: {sorted(moved)}"
            for name in moved:
                assert_bitwise_equal(moved[name][0], loaded[name][0], f"{what}: {name}")
                assert moved[name][1] == loaded[name][1], f"{what}: {name} layout {moved[name][1]} != {loaded[name][1]}"
            assert_bitwise_equal(out_moved, out_loaded, f"{what}: layer output")

    run_property(check, 3 if world == 2 else 2, p2l=placements(world), seed=seeds)


@pytest.mark.parametrize("quant", ["w8a8", "w4a8", "w4a4"])
def test_a_rearrangement_that_leaves_the_scales_behind_is_caught(quant):
    p2l = tuple(reversed(range(E)))  # every expert changes rank
    for rank, (moved, loaded, out_moved, out_loaded, _) in enumerate(_run(quant, p2l, 0, planted=True)):
        moved, loaded = ({n: t for n, (t, _) in d.items()} for d in (moved, loaded))
        scales = [name for name in moved if "scale" in name]
        assert scales, f"{quant}: the experts have no scale tensor to leave behind"
        assert all(
            torch.equal(moved[n].view(torch.uint8), loaded[n].view(torch.uint8)) for n in moved if n not in scales
        )
        assert not any(torch.equal(moved[n], loaded[n]) for n in scales), f"{quant} rank {rank}: scales equal"
        assert not torch.equal(out_moved, out_loaded), f"{quant} rank {rank}: the planted rearrangement went unseen"
