"""The W4A4 model with the learned Hadamard rotation, over real gloo ranks, computes what the fake-quant reference
computes, and attention TP 1, 2 and 4 agree (spec a4w4_hadamard.md §1.4, §4.4.4).

Checkpoints: tiny-h128 (attention TP 1 and 2: 128 attention features per rank at TP 2) and tiny-h256 (TP 1, 2 and 4:
128 per rank at TP 4) stored in bf16, converted with `--quant w4a4 --hadamard-weight-path DIR`, DIR the
non-symmetric orthogonal or the non-orthogonal invertible rotation directory. MoE expert parallel over the world.

- Prefill and teacher-forced decode logits vs the fake-quant W4A4 reference with the same rotations replaying the
  optimized routing (a token may flip only where its router input difference can overturn its margin), within
  `model.w4a4.bfloat16`, and `min_separation` times closer to it than to the BF16 reference replaying the same
  routing.
- Batch 1 at attention TP 2: every decode step's attention linears see one row (duplicated for the FP4 matmul).
- Sharding invariance: the logits at attention TP 2 and 4 vs TP 1 on the same prompts, within the same entry
  (each rank rotates its own 128-aligned slice of heads before the row-parallel o_proj).
"""

from __future__ import annotations

import pytest
import torch

from equivalence.support.compare import assert_close, describe, rel_l2, tolerance
from equivalence.support.dist import get_pool
from equivalence.support.logits_runs import (
    _draw_forced,
    _reference_logits,
    assert_bf16_logits_match_replayed_reference,
    teacher_forced_run,
)
from equivalence.support.parallel_support import on_host, paged_cache, reference_model, runner_of, same_on_all_ranks
from equivalence.support.parallel_support import test_device as worker_device
from equivalence.support.strategies import describe_layout, layout
from equivalence.support.w4a4_reference import (
    fake_quant_reference,
)
from fixtures.checkpoints import rotation_dir, w4a4_checkpoint

pytestmark = pytest.mark.distributed

VOCAB = 512


@torch.no_grad()
def rotated_logits_task(rank, world, path, lay, rotation_path, prompts, forced):
    """`teacher_forced_run` of the W4A4 checkpoint `path` with the rotation directory `rotation_path`."""
    from optimized.distributed import ParallelState
    from optimized.model_loader.build import load_model

    model = load_model(
        path,
        parallel=ParallelState.build(**lay),
        dtype=torch.bfloat16,
        device=worker_device(),
        hadamard_weight_path=rotation_path,
    )
    cache, table = paged_cache(model, [len(p) + len(forced) for p in prompts])
    return on_host(teacher_forced_run(model, runner_of(model), prompts, forced, cache, table))


def run(name: str, rotation: str, world: int, attn_tp: int, prompts, forced) -> dict:
    lay = layout(world, attn_tp_size=attn_tp)
    got = get_pool(world).run(
        rotated_logits_task,
        str(w4a4_checkpoint(name, rotation)),
        lay,
        str(rotation_dir(rotation)),
        prompts,
        forced,
        timeout=180,
    )
    return same_on_all_ranks(got, f"w4a4 {name} {describe_layout(lay)}")


CASES = [
    ("tiny-h128", "orthogonal", 1, 1),
    ("tiny-h128", "invertible", 2, 2),
    ("tiny-h256", "invertible", 4, 4),
    ("tiny-h256", "orthogonal", 2, 2),
]


def _prompts(seed: int, sizes=(17, 5)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in sizes]


@pytest.mark.parametrize("name,rotation,world,attn_tp", CASES)
def test_rotated_w4a4_logits_match_fake_quant_reference(name, rotation, world, attn_tp):
    prompts, forced = _prompts(world), _draw_forced(world, 2, 2)
    got = run(name, rotation, world, attn_tp, prompts, forced)
    bf16 = reference_model(name, "bfloat16")
    a, r, _, report = assert_bf16_logits_match_replayed_reference(
        got,
        name,
        prompts,
        forced,
        f"{name} {rotation} W4A4 attn_tp {attn_tp} world {world}",
        replayed_ref=fake_quant_reference(name, rotation),
        own_ref=bf16,
        tol="model.w4a4.bfloat16",
        near_tie="router_tie.float32",
        ties_from_router_inputs=True,
    )
    unquantized = torch.cat([torch.cat(x) for x in _reference_logits(bf16, prompts, forced, got["routes"], 1.0, [])])
    separation = rel_l2(a, unquantized) / max(rel_l2(a, r), 1e-30)
    report += f"; BF16 replaying the routing rel_l2 {rel_l2(a, unquantized):.3e}: {separation:.2f}x farther"
    print(report)
    assert separation >= tolerance("model.w4a4.bfloat16").min_separation, report


def test_a_batch_1_w4a4_decode_at_attention_tp_2_matches_the_fake_quant_reference():
    """The recipe's 950 W4A4 files decode batch 1 at attention TP 4: each rank's merged_qkv_proj and o_proj see one
    row, which the FP4 matmul does not take; under the route caps this runs only because the linear duplicates it."""
    name, rotation, world = "tiny-h128", "invertible", 2
    prompts, forced = _prompts(7, (9,)), _draw_forced(7, 1, 2)
    got = run(name, rotation, world, world, prompts, forced)
    _, _, _, report = assert_bf16_logits_match_replayed_reference(
        got,
        name,
        prompts,
        forced,
        f"{name} {rotation} W4A4 batch 1 attn_tp {world}",
        replayed_ref=fake_quant_reference(name, rotation),
        own_ref=reference_model(name, "bfloat16"),
        tol="model.w4a4.bfloat16",
        near_tie="router_tie.float32",
        ties_from_router_inputs=True,
    )
    print(report)


@pytest.mark.parametrize("name,tps", [("tiny-h128", (2,)), ("tiny-h256", (2, 4))])
def test_rotated_w4a4_attention_tp_is_sharding_invariant(name, tps):
    prompts, forced = _prompts(11, (13, 6)), _draw_forced(11, 2, 2)
    base = run(name, "invertible", max(tps), 1, prompts, forced)  # attention TP 1 (replicated), same EP
    for tp in tps:
        got = run(name, "invertible", max(tps), tp, prompts, forced)
        for key in ["prefill", "decode0", "decode1"]:
            what = f"{name} attention TP {tp} vs 1, {key}: {describe(got[key], base[key])}"
            print(what)
            assert_close(got[key], base[key], "model.w4a4.bfloat16", what)
