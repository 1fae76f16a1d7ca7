"""Graph mode's captured decode batches: by default 1, 2, 4, 8, then every 16 up to a DP group's batch, a decode
batch padded to the smallest that holds it; model_config.graph_batch_sizes overrides them (checked: ascending
distinct positive sizes, in a graph mode, the largest holding a group's batch), and the MC2 window is sized for the
largest."""

from __future__ import annotations


import pytest
from hypothesis import given
from hypothesis import strategies as st

from equivalence.support.plans import small_model_shapes
from optimized.config import ConfigError, InferenceConfig
from optimized.distributed import decode_plan
from optimized.errors import UsageError
from optimized.executor import plan as P
from optimized.model_loader.presets import preset_config
from optimized.forward_metadata import batch_bucket, default_buckets

QWEN3_235B = preset_config("qwen3_235b_a22b")  # the released shapes


def _cfg(batch: int, sizes=None, exe_mode: str = "ge_graph", **parallel) -> InferenceConfig:
    model = {"exe_mode": exe_mode} | ({} if sizes is None else {"graph_batch_sizes": sizes})
    return InferenceConfig.from_dict(
        {"model_config": model, "parallel_config": parallel, "scheduler_config": {"batch_size": batch}}
    )


def _plan(cfg) -> P.ExecutionPlan:
    return P.ExecutionPlan.build(
        cfg, QWEN3_235B, batch=cfg.scheduler_config.batch_size, prefill_tokens=16, kv_pool_blocks=9
    )


@given(batch=st.integers(1, 3000))
def test_a_batch_pads_to_the_smallest_default_size_that_holds_it(batch):
    sizes = default_buckets(batch)
    rule = {1, 2, 4, 8} | set(range(16, 3016, 16))
    assert set(sizes) <= rule and list(sizes) == sorted(sizes)
    bucket = batch_bucket(batch)
    assert bucket == min(b for b in rule if b >= batch) == max(sizes)
    assert batch_bucket(batch, sizes) == bucket  # the captured sizes pad it the same way
    assert sizes == tuple(sorted(b for b in rule if b <= bucket)), "every size of the rule up to the group's bucket"


def test_the_default_sizes_of_a_few_group_batches():
    assert default_buckets(1) == (1,)
    assert default_buckets(5) == (1, 2, 4, 8)
    assert default_buckets(40) == (1, 2, 4, 8, 16, 32, 48)
    assert default_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)


def test_the_plan_captures_the_default_sizes_up_to_each_groups_batch():
    # TP 2 x DP 4 (EP 8), batch 200: 50 per group, padded to 64; a step dispatches 4 x 64 rows
    plan = _plan(_cfg(200, world_size=8, attn_tp_size=2, moe_tp_size=1))
    assert plan.buckets == (1, 2, 4, 8, 16, 32, 48, 64)
    assert plan.dispatch_batch == 4 * 64
    assert plan.mc2_window_mb == decode_plan.window_for(QWEN3_235B, plan_parallel(8, 2), 4 * 64, 2)


def plan_parallel(world: int, attn_tp: int):
    return _cfg(world, world_size=world, attn_tp_size=attn_tp, moe_tp_size=1).parallel_config


def test_graph_batch_sizes_override_the_buckets_and_the_window_is_sized_for_the_largest():
    # EP 4 (one group), batch 400: the captured sizes given; the MC2 window holds the largest (warming up runs it)
    cfg = _cfg(400, [1, 24, 400, 640], world_size=4, attn_tp_size=4, moe_tp_size=1)
    plan = _plan(cfg)
    assert plan.buckets == (1, 24, 400, 640) and plan.dispatch_batch == 640
    assert plan.mc2_window_mb == decode_plan.window_for(QWEN3_235B, cfg.parallel_config, 640, 2)
    assert plan.mc2_window_mb > _plan(_cfg(400, world_size=4, attn_tp_size=4, moe_tp_size=1)).mc2_window_mb
    assert [batch_bucket(b, plan.buckets) for b in (1, 2, 24, 25, 400)] == [1, 24, 24, 400, 400]
    assert "buckets [1, 24, 400, 640]; a step dispatches up to 640 rows" in plan.describe()


def test_graph_batch_sizes_under_attention_dp_hold_each_groups_share():
    layout = dict(world_size=8, attn_tp_size=2, moe_tp_size=1)  # DP 4: batch 40 is 10 per group
    plan = _plan(_cfg(40, [2, 10], **layout))
    assert plan.buckets == (2, 10) and plan.dispatch_batch == 4 * 10
    with pytest.raises(ConfigError) as e:
        _cfg(40, [2, 9], **layout)
    assert e.value.errors == [
        (
            "model_config.graph_batch_sizes",
            "the largest (9) must be at least a DP group's share of scheduler_config.batch_size (10, over 4 groups): "
            "add a size of 10 or more",
        )
    ]


@pytest.mark.parametrize(
    "sizes, exe_mode, message",
    [
        ([4, 2], "ge_graph", "must be ascending without repeats, e.g. [2, 4]; got [4, 2]"),
        ([2, 2, 4], "acl_graph", "must be ascending without repeats, e.g. [2, 4]; got [2, 2, 4]"),
        ([0, 4], "ge_graph", "must be a non-empty list of positive integers, got [0, 4] (list)"),
        ([], "ge_graph", "must be a non-empty list of positive integers, got [] (list)"),
        ([1, 2.5, 4], "ge_graph", "must be a non-empty list of positive integers, got [1, 2.5, 4] (list)"),
        (8, "ge_graph", "must be a non-empty list of positive integers, got 8 (int)"),
        ([4], "eager", "are graph mode's captured decode batches; exe_mode eager captures none"),
        (
            [1, 2],
            "ge_graph",
            "the largest (2) must be at least scheduler_config.batch_size (4): add a size of 4 or more",
        ),  # noqa: E501
    ],
)
def test_bad_graph_batch_sizes_are_refused_naming_the_key(sizes, exe_mode, message):
    with pytest.raises(ConfigError) as e:
        _cfg(4, sizes, exe_mode)
    assert e.value.errors == [("model_config.graph_batch_sizes", message)]


def test_a_plan_for_more_requests_than_the_largest_size_is_refused_naming_the_key():
    """generate plans for its prompts: more than the largest captured size cannot decode."""
    cfg = _cfg(4, [1, 4])
    with pytest.raises(UsageError, match=r"model_config.graph_batch_sizes: the largest \(4\) cannot hold a decode "):
        P.ExecutionPlan.build(cfg, QWEN3_235B, batch=5, prefill_tokens=16, kv_pool_blocks=9)


def test_force_eplb_is_checked_against_the_largest_captured_size():
    """With moe_tp_size > 1 the forced routing needs B * top_k <= num_experts for the padded decode batch: batch 3
    pads to 4 by default (8 > 6 refused); captured sizes [1, 3] pad it to 3 (6 <= 6)."""
    model = small_model_shapes(num_experts=6)

    def cfg(sizes):
        mc = {"exe_mode": "ge_graph", "force_eplb": True} | ({} if sizes is None else {"graph_batch_sizes": sizes})
        return InferenceConfig.from_dict(
            {
                "model_config": mc,
                "parallel_config": {"world_size": 2, "moe_tp_size": 2, "attn_dp": False},
                "scheduler_config": {"batch_size": 3},
            }
        )

    with pytest.raises(ConfigError, match="B = 4"):
        cfg(None).validate_for_model(model)
    cfg([1, 3]).validate_for_model(model)
