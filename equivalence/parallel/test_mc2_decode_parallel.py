"""Decode through MC2 (`moe_infer_dispatch_combine`: npu_moe_distribute_dispatch_v2 / combine_v2) over real gloo
ranks equals the reference, and each rank receives the slots the routing sends it.

- Layouts with moe_tp 1 and EP = world (2, 4, 8; the tiny model's top_k 4 is above, equal to and below the EP size)
after the
  tensor-parallel prefill and after the sequence-parallel prefill (both EP schemes' layouts): fp32 prefill and
  teacher-forced decode logits within `model.float32` of the reference, for batches of 1-3 requests (so some EP
  ranks exchange only masked padding), and every decode step of every MoE layer called the dispatch operator once
  and the combine operator once while the prefill called neither (the recipe's choice,
  the plan's decode path, `path_plan.decide_paths`): operator calls, what an NPU run makes too;
- one MC2 exchange of a Qwen3-235B-A22B-shaped MoE layer (H 4096, E 128, top_k 8) at EP 4: each rank's experts
  receive exactly the slots the drawn routing sends them (the token count per local expert), and the exchange
  returns the plain weighted sum of an identity expert bit for bit (fp32 accumulation in ascending j, one bf16
  rounding). The bytes the portable kernels moved are printed beside `decode_plan.mc2_volume` (information: they
  are the emulation's own traffic, not what an NPU's kernels move).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from equivalence.support.compare import assert_bitwise_equal, assert_close
from equivalence.support.dist import get_pool
from equivalence.support.logits_runs import _draw_forced, _logits_task, _model_logits, _reference_logits
from equivalence.support.parallel_support import rank_model, reference_model, run_property, same_on_all_ranks
from equivalence.support.strategies import describe_layout, expert_routing, layout, prompt_batches, routing_kinds, seeds
from fixtures.checkpoints import checkpoint
from fixtures.tiny import tiny_config

pytestmark = pytest.mark.distributed

CONFIG = tiny_config("tiny")
MOE_LAYERS = CONFIG.num_hidden_layers  # "tiny": every layer sparse (checked below)
DISPATCH, COMBINE = "npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2"


def _mc2_layout(world: int, prefill: str) -> dict:
    if prefill == "tp":
        return layout(world, attn_tp_size=world, moe_tp_size=1, lmhead_tp_size=world)
    return layout(world, attn_tp_size=world, moe_tp_size=1, prefill_opt=True, moe_ep_scheme=prefill)


def _mc2_logits_task(rank, world, path, lay, prompts, forced):

    from equivalence.npu.record_npu_calls import NpuOpCounter

    model = rank_model(path, lay, torch.float32)
    with NpuOpCounter() as counter:
        out = _logits_task(rank, world, path, lay, "float32", prompts, forced)
    out["decode_exchange"] = type(model.decode.step.exchange).__name__
    out["mc2_calls"] = {op: counter.ops.get(op, 0) for op in (DISPATCH, COMBINE)}
    del out["routes"]
    return out


@pytest.mark.parametrize("world, prefill", [(2, "tp"), (2, "alltoall"), (4, "tp"), (4, "allgather"), (8, "alltoall")])
def test_mc2_decode_logits_equal_reference_fp32(world, prefill):
    assert not CONFIG.mlp_only_layers and CONFIG.decoder_sparse_step == 1
    lay = _mc2_layout(world, prefill)
    path = str(checkpoint("tiny"))

    def check(prompts, steps, seed):
        forced = _draw_forced(seed, len(prompts), steps)
        got = same_on_all_ranks(
            get_pool(world).run(_mc2_logits_task, path, lay, prompts, forced, timeout=120), "logits"
        )
        what = f"{describe_layout(lay)} batch {len(prompts)}"
        assert got["decode_exchange"] == "MoeInferDispatchCombine", f"{what}: decode uses {got['decode_exchange']}"
        # one dispatch and one combine operator call per MoE layer per decode step; none in the prefill
        want_calls = {DISPATCH: steps * MOE_LAYERS, COMBINE: steps * MOE_LAYERS}
        assert got["mc2_calls"] == want_calls, f"{what}: MC2 calls {got['mc2_calls']} != {want_calls}"
        want = _reference_logits(reference_model("tiny"), prompts, forced)
        for b, ((gp, gd), (wp, wd)) in enumerate(zip(_model_logits(got, prompts, forced), want)):
            assert_close(gp, wp, "model.float32", f"{what} request {b} prefill logits")
            assert_close(gd, wd, "model.float32", f"{what} request {b} decode logits ({steps} steps)")

    run_property(check, 2, prompts=prompt_batches(CONFIG.vocab_size, 1, 3, 40), steps=st.integers(1, 3), seed=seeds)


# ------------------------------------------------------------------------------------------ bytes moved

H235, E235, K235, LAYERS235 = 4096, 128, 8, 94  # Qwen3-235B-A22B: hidden, experts, top_k, MoE layers


class _IdentityExperts:
    """Stands in for FusedMoEGMM: this rank's expert range, every expert the identity."""

    def __init__(self, ep):
        self.local_experts = E235 // ep.size
        self.first_expert = ep.rank * self.local_experts
        self.received: list[int] = []

    def __call__(self, x, tokens_per_expert):
        self.received = tokens_per_expert.tolist()  # slots per local expert, as the dispatch delivered them
        return x


def _mc2_bytes_task(rank, world, x, ids, weights):
    from optimized import distributed as comm
    from optimized.layers.exchange import MoeInferDispatchCombine

    state = comm.ParallelState.build(world_size=world, attn_tp_size=world, moe_tp_size=1, moe_ep_size=world)
    exchange = MoeInferDispatchCombine(E235, K235, state.moe_tp, state.moe_ep)
    experts = _IdentityExperts(state.moe_ep)
    with comm.count_bytes() as counter:
        out = exchange(experts, x, ids, weights)
    return out, dict(counter.bytes), experts.received


def _slots(ids: torch.Tensor, rank: int, ep: int, n: int) -> tuple[int, int]:
    """(slots rank `rank` sends to other ranks, slots it receives from them) when rank s dispatches tokens
    [s*n, (s+1)*n) of the batch."""
    local = E235 // ep
    owner = ids.long() // local  # [B, K]
    source = (torch.arange(ids.shape[0]) // n).unsqueeze(1).expand_as(owner)
    out = int(((source == rank) & (owner != rank)).sum())
    inc = int(((owner == rank) & (source != rank)).sum())
    return out, inc


def test_mc2_decode_qwen3_235b_shape_each_rank_receives_its_slots_and_combines_exactly():
    from optimized.distributed.decode_plan import mc2_volume, tokens_per_rank

    world = 4

    def check(kind, batch, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, H235, generator=g).to(torch.bfloat16)
        ids, weights = expert_routing(kind, seed, batch, E235, K235, world)
        results = get_pool(world).run(_mc2_bytes_task, x, ids, weights, timeout=120)
        n = tokens_per_rank(batch, world)
        acc = torch.zeros(batch, H235)
        for j in range(K235):
            acc = acc + weights[:, j : j + 1] * x.float()
        formula = []
        local = E235 // world
        for rank, (out, sent, received) in enumerate(results):
            slots_out, slots_in = _slots(ids, rank, world, n)
            formula.append(sum(mc2_volume(n, H235, K235, world, E235, 2, slots_out, slots_in).parts.values()))
            what = f"{kind} batch {batch} rank {rank} (slots out {slots_out}, in {slots_in})"
            want = torch.bincount(ids.long().flatten(), minlength=E235)[rank * local : (rank + 1) * local].tolist()
            assert received == want, f"{what}: slots per local expert {received}, the routing sends {want}"
            assert_bitwise_equal(out, acc.to(torch.bfloat16), f"{what}: combined output")
        uniform = mc2_volume(n, H235, K235, world, E235, 2)
        measured = sum(results[0][1].values())
        print(
            f"\nMC2 decode, Qwen3-235B-A22B shape, EP {world}, batch {batch} ({kind}), rank 0 per MoE layer: "
            f"measured {results[0][1]} = {measured} B; formula with these slots {formula[0]} B; uniform-routing "
            f"formula {uniform.parts} ~ {uniform.total} B; per decode step ({LAYERS235} MoE layers) measured "
            f"{measured * LAYERS235} B, uniform formula {uniform.total * LAYERS235} B"
        )

    run_property(check, 3, kind=routing_kinds, batch=st.sampled_from([4, 6, 8]), seed=seeds)
