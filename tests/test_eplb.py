"""Expert load balancing's pieces on the host: the placement and its replica rule, the greedy policy, the config keys
(each refusal naming its key), the controller's window and /metrics lines, and bench's imbalance figures."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from equivalence.support.plans import small_model_shapes
from optimized.benchmarks.eplb_imbalance import measure
from optimized.config import ConfigError, InferenceConfig
from optimized.layers.eplb.placement import ExpertPlacement, PlacementError, to_physical
from optimized.layers.eplb.policy import greedy_placement, rank_imbalance, replica_counts


@st.composite
def _placements(draw):
    e, ep = draw(st.integers(1, 12)), draw(st.integers(1, 4))
    r = draw(st.sampled_from([r for r in range(0, 9) if (e + r) % ep == 0] or [ep - e % ep]))
    p2l = draw(st.permutations(list(range(e)) + draw(st.lists(st.integers(0, e - 1), min_size=r, max_size=r))))
    return ExpertPlacement(tuple(p2l), e, ep)


@settings(max_examples=50)
@given(placement=_placements(), rows=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_the_replica_rule_picks_replica_row_mod_count_of_the_chosen_expert(placement, rows, seed):
    g = torch.Generator().manual_seed(seed)
    k = min(3, placement.num_logical)
    ids = torch.stack([torch.randperm(placement.num_logical, generator=g)[:k] for _ in range(rows)]).to(torch.int32)
    slots = to_physical(ids, *placement.tables())
    for t in range(rows):
        for j in range(k):
            reps = placement.replicas(int(ids[t, j]))
            assert int(slots[t, j]) == reps[t % len(reps)]
            assert placement.physical_to_logical[int(slots[t, j])] == int(ids[t, j])


@settings(max_examples=50)
@given(placement=_placements(), load=st.lists(st.integers(0, 1000), min_size=12, max_size=12))
def test_the_greedy_policy_places_every_expert_in_the_same_slots(placement, load):
    load = load[: placement.num_logical]
    new = greedy_placement(load, placement)
    assert (new.num_physical, new.num_logical, new.ep_size) == (
        placement.num_physical,
        placement.num_logical,
        placement.ep_size,
    )
    if new != placement:  # a new placement has the policy's replica counts (else the old one was kept)
        counts = replica_counts([float(x) for x in load], placement.num_redundant)
        assert [len(new.replicas(e)) for e in range(new.num_logical)] == counts
    assert greedy_placement(load, placement) == new  # deterministic: every rank computes the same


def test_the_policy_replicates_the_heaviest_and_keeps_an_unchanged_placement():
    old = ExpertPlacement.default(4, 2, 3)  # slots 0 1 | 2 3 | 0 1
    new = greedy_placement([100, 1, 1, 1], old)
    assert len(new.replicas(0)) == 3
    ranks = {s // new.slots_per_rank for s in new.replicas(0)}
    assert ranks == {0, 1, 2}  # the hot expert's replicas spread over the ranks
    # over 2 ranks a third replica cannot help (two would share a rank): the placement in use is kept
    two = ExpertPlacement.default(4, 2, 2)
    assert greedy_placement([100, 1, 1, 1], two) == two
    assert greedy_placement([1, 1, 1, 1], ExpertPlacement((0, 1, 2, 3), 4, 2)) == ExpertPlacement((0, 1, 2, 3), 4, 2)


@pytest.mark.parametrize(
    "p2l, e, ep, fragment",
    [
        ((0, 1, 2), 3, 2, "num_redundant_experts"),
        ((0, 1, 1, 2), 4, 2, "logical experts [3] have no physical slot"),
        ((0, 1, 5, 2), 4, 2, "slot 2 names logical expert 5"),
    ],
)
def test_a_bad_placement_is_refused_by_name(p2l, e, ep, fragment):
    with pytest.raises(PlacementError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        ExpertPlacement(p2l, e, ep)


def _model(**over):
    return small_model_shapes(**over)


def _error(d: dict, model=None) -> str:
    with pytest.raises(ConfigError) as e:
        cfg = InferenceConfig.from_dict(d)
        cfg.validate_for_model(model or _model())
    return str(e.value)


@pytest.mark.parametrize(
    "mc, par, key, fragment",
    [
        ({}, {"num_redundant_experts": 2}, "parallel_config.num_redundant_experts", "set enable_eplb: true"),
        ({}, {"enable_eplb": "yes"}, "parallel_config.enable_eplb", "must be a boolean"),
        ({}, {"enable_eplb": True, "eplb_window_size": 0}, "parallel_config.eplb_window_size", "positive integer"),
        ({}, {"enable_eplb": True, "eplb_step_interval": -1}, "parallel_config.eplb_step_interval", "positive"),
        ({}, {"enable_eplb": True, "num_redundant_experts": -1}, "parallel_config.num_redundant_experts", "non-neg"),
        (
            {},
            {"world_size": 4, "attn_tp_size": 4, "enable_eplb": True, "num_redundant_experts": 2},
            "parallel_config.num_redundant_experts",
            "= 10 physical experts must be divisible by moe_ep_size (4)",
        ),
        ({"force_eplb": True}, {"enable_eplb": True}, "parallel_config.enable_eplb", "force_eplb"),
        ({"exe_mode": "ge_graph"}, {"enable_eplb": True}, "parallel_config.enable_eplb", "exe_mode eager only"),
    ],
)
def test_the_eplb_keys_are_refused_by_name(mc, par, key, fragment):
    msg = _error({"model_config": mc, "parallel_config": par})
    lines = [line for line in msg.splitlines() if line.strip().startswith(key + ":")]
    assert lines and any(fragment in line for line in lines), msg


def test_valid_eplb_keys_pass_and_redundant_slots_may_lift_the_experts_divisibility():
    cfg = InferenceConfig.from_dict(
        {"parallel_config": {"world_size": 4, "attn_tp_size": 4, "enable_eplb": True, "num_redundant_experts": 2}}
    )
    cfg.validate_for_model(_model(num_experts=6))  # 6 experts over 4 ranks: only with 2 redundant slots


def test_bench_imbalance_eplb_beats_no_eplb_on_a_skewed_routing_and_force_eplb_is_the_best_case():
    r = measure(64, 4, 8, 32, (0, 8))
    assert r["force_eplb"] == pytest.approx(1.0)
    assert r["eplb_r8"] < r["no_eplb"]
    assert r["force_eplb"] <= min(r["eplb_r0"], r["eplb_r8"])
    assert rank_imbalance([1.0, 1.0, 1.0, 3.0], 2) == pytest.approx(4 / 3)


def test_the_controller_windows_the_counts_and_shows_them_in_metrics():
    from fixtures.checkpoints import checkpoint
    from optimized.distributed import ParallelState
    from optimized.executor.engine import Engine
    from optimized.executor.model_runner import ModelRunner
    from optimized.executor.scheduler import Request
    from optimized.model_loader.build import load_model

    state = ParallelState.build(
        world_size=1, enable_eplb=True, num_redundant_experts=2, eplb_window_size=2, eplb_step_interval=3
    )
    model = load_model(checkpoint("tiny"), parallel=state, dtype=torch.float32, device="cpu")
    engine = Engine(ModelRunner(model, 16), batch_size=2, num_blocks=16)
    eplb = engine.eplb
    engine.add(Request("a", [5, 9, 200, 17], 5))
    for _ in range(2):
        engine.step()
    assert eplb.rebalances == 0
    assert int(eplb.window.sum()) == 4 * 2 * model.config.num_experts_per_tok  # step 1's prefill: 4 rows, 2 layers
    engine.step()  # the third call rebalances before its step
    assert eplb.rebalances == 1 and len(eplb.expert_imbalance) == len(model.layers)
    from optimized.serving.driver import Driver

    text = Driver(engine).metrics.render()  # the driver hands the engine's controller to /metrics
    assert "qwen3_moe_eplb_rebalances_total 1" in text
    assert 'qwen3_moe_expert_load_imbalance{layer="1"}' in text


def test_the_mc2_window_and_limits_count_the_redundant_slots():
    from optimized.config import ParallelConfig
    from optimized.distributed import decode_plan

    model = _model(num_experts=16, num_experts_per_tok=4, hidden_size=4096)
    plain = ParallelConfig(world_size=8, attn_tp_size=8, moe_tp_size=1)
    eplb = ParallelConfig(world_size=8, attn_tp_size=8, moe_tp_size=1, enable_eplb=True, num_redundant_experts=8)
    assert eplb.expert_slots(16) == 24 and plain.expert_slots(16) == 16
    # 2 -> 3 slots per rank: the dispatch part of the window grows by half (above HCCL's default 200 MB)
    assert decode_plan.window_for(model, eplb, 4096, 2) > decode_plan.window_for(model, plain, 4096, 2) == 200
    big = _model(num_experts=1020, num_experts_per_tok=4, hidden_size=4096)
    over = ParallelConfig(world_size=8, attn_tp_size=8, moe_tp_size=1, enable_eplb=True, num_redundant_experts=8)
    assert not decode_plan.mc2_limit_violations(big, ParallelConfig(world_size=8, attn_tp_size=8, moe_tp_size=1), 8)
    assert any("num_experts 1028" in why for why in decode_plan.mc2_limit_violations(big, over, 8))
