"""The execution plan: its decisions as fields (the phase paths, the MC2 window sized from the largest batch a decode
step dispatches: the padded graph bucket, each DP group's share; the graph buckets, the KV pool, the MC2 limits), and
the start-up block that prints them, one line per decision."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimized.config import InferenceConfig
from optimized.distributed import decode_plan
from optimized.executor import plan as P
from optimized.model_loader.presets import preset_config
from optimized.forward_metadata import batch_bucket
from optimized.path_plan import ALLGATHER, ALLTOALL, DP, MC2, SP, TP, WIRE_16_BIT

QWEN3_235B = preset_config("qwen3_235b_a22b")  # the released shapes


def _cfg(exe_mode: str, batch: int, **parallel) -> InferenceConfig:
    return InferenceConfig.from_dict(
        {"model_config": {"exe_mode": exe_mode}, "parallel_config": parallel, "scheduler_config": {"batch_size": batch}}
    )


def _plan(cfg, batch=None):
    return P.ExecutionPlan.build(
        cfg, QWEN3_235B, batch=batch or cfg.scheduler_config.batch_size, prefill_tokens=16, kv_pool_blocks=9
    )


def test_graph_mode_sizes_the_mc2_window_for_the_padded_bucket_qwen3_235b_ep4_batch_600():
    # EP 4, batch 600: eager dispatches 150 tokens per rank: a window of 368 MB. A graph decode pads the batch to
    # its bucket 608 (padding rows are real rows to MC2): 152 tokens per rank, L = 32 local experts, H = 4096:
    # dispatch 32 * 152 * 4 * 9216 B, combine 8 * 152 * 8192 B, twice, + 11 MB = 372 MB (the recipe's formula).
    layout = dict(world_size=4, attn_tp_size=4, moe_tp_size=1)
    eager, graph = _plan(_cfg("eager", 600, **layout)), _plan(_cfg("ge_graph", 600, **layout))
    assert (eager.dispatch_batch, eager.mc2_window_mb) == (600, 368)
    assert (graph.dispatch_batch, graph.mc2_window_mb) == (608, 372)
    assert graph.buckets == (1, 2, 4, 8, *range(16, 609, 16))
    assert "buckets [1, 2, 4, 8, 16, 32, ..., 608] (42 sizes)" in graph.describe()
    assert (graph.paths.prefill, graph.paths.ep_scheme, graph.paths.decode) == (SP, ALLGATHER, MC2)


def test_graph_mode_under_attention_dp_pads_each_groups_share():
    # TP 2 x DP 4 (EP 8), batch 40: each group runs 10 requests, padded to the bucket 16: 8 rows per rank
    # (eager: ceil(10 / 2) = 5 rows per rank).
    layout = dict(world_size=8, attn_tp_size=2, moe_tp_size=1)
    eager, graph = _plan(_cfg("eager", 40, **layout)), _plan(_cfg("ge_graph", 40, **layout))
    assert graph.dispatch_batch == 4 * 16 and graph.buckets == (1, 2, 4, 8, 16)
    assert eager.mc2_window_mb == decode_plan.mc2_window_mb(5, 8, 4096, 8, 128, 2)
    assert graph.mc2_window_mb == decode_plan.mc2_window_mb(8, 8, 4096, 8, 128, 2)
    assert (graph.paths.prefill, graph.paths.ep_scheme, graph.paths.wire, graph.paths.decode) == (
        DP,
        ALLTOALL,
        WIRE_16_BIT,
        DP,
    )


def test_serve_above_80_rows_per_rank_gets_a_window_that_holds_them():
    # HCCL's default 200 MB holds about 80 rows per rank of Qwen3-235B at EP 4; batch 400 (100 per rank) needs more
    # and the plan builds the group with it, so the start-up check passes.
    plan = _plan(_cfg("eager", 400, world_size=4, attn_tp_size=4, moe_tp_size=1))
    assert plan.mc2_window_mb > decode_plan.HCCL_DEFAULT_MB
    decode_plan.check_mc2_window(
        QWEN3_235B,
        _cfg("eager", 400, world_size=4, attn_tp_size=4, moe_tp_size=1).parallel_config,
        400,
        2,
        plan.mc2_window_mb,
    )


@settings(max_examples=40, deadline=None)
@given(groups=st.integers(1, 150), dp=st.sampled_from([1, 2, 4]), graph=st.booleans())
def test_the_window_holds_every_batch_a_step_can_dispatch(groups, dp, graph):
    """Any running batch up to the planned one, padded as the graph decoder pads it, fits the planned window."""
    batch = groups * dp  # the config's rule: batch_size a multiple of the DP degree
    layout = dict(world_size=4, attn_tp_size=4 // dp, moe_tp_size=1)
    cfg = _cfg("ge_graph" if graph else "eager", batch, **layout)
    plan = _plan(cfg)
    for running in {1, batch // 2 or 1, batch}:
        per_group = -(-running // dp)
        step = dp * (batch_bucket(per_group) if graph else per_group)  # what a step really dispatches
        decode_plan.check_mc2_window(QWEN3_235B, cfg.parallel_config, step, 2, plan.mc2_window_mb)


def test_no_mc2_no_window_and_the_block_prints_each_decision():
    plan = _plan(_cfg("eager", 4, world_size=2, attn_tp_size=2, moe_tp_size=2))
    assert plan.mc2_window_mb is None and plan.buckets == () and not plan.mc2
    assert (plan.paths.prefill, plan.paths.ep_scheme, plan.paths.wire, plan.paths.decode) == (TP, None, None, TP)
    assert plan.quant is None and plan.scheme.name is None
    lines = plan.describe().splitlines()
    assert len(lines) == 5 and lines[1:3] == [plan.prefill_line, plan.decode_line], lines


def test_the_plan_holds_the_decode_path_its_window_and_the_mc2_limits_it_breaks():
    ep = _plan(_cfg("eager", 8, world_size=4, attn_tp_size=4, moe_tp_size=1))
    assert ep.paths.decode == MC2 and ep.mc2_window_mb == decode_plan.HCCL_DEFAULT_MB and ep.mc2_limits == ()
    tp = _plan(_cfg("eager", 8, world_size=4, attn_tp_size=4, moe_tp_size=4))
    assert tp.paths.decode == TP and tp.mc2_window_mb is None
    tiny = SimpleNamespace(hidden_size=64, num_experts=8, num_experts_per_tok=2)
    small = P.ExecutionPlan.build(
        _cfg("eager", 4, world_size=2, attn_tp_size=2, moe_tp_size=1), tiny, batch=4, prefill_tokens=8, kv_pool_blocks=3
    )
    assert small.mc2_limits == ("hidden_size 64 outside [1024, 8192]",)  # the portable kernels only


@pytest.mark.parametrize(
    "lengths, block, dp, want",
    [
        ([16, 17], 16, 1, 1 + 1 + 2),
        ([16, 17, 5], 16, 2, 1 + 1 + 1),  # group 0: requests 0 and 2; group 1: request 1
        ([40], 16, 2, 1 + 3),
        ([48, 16, 16, 16], 16, 2, 1 + 3),  # by load: group 0: request 0; group 1: 1, 2, 3 (never 4 + 1 blocks)
    ],
)
def test_pool_blocks_per_dp_group(lengths, block, dp, want):
    assert P.pool_blocks(lengths, block, dp) == want


def test_a_layouts_plan_decides_as_a_config_runs_plan():
    """`for_layout` (the bench's, the harness's, the report's plan) is `build` without a config: the same decisions;
    without a planned pool or first prefill its block says so instead of printing numbers it does not have."""
    cfg = _cfg("ge_graph", 40, world_size=4, attn_tp_size=4, moe_tp_size=1)
    built = _plan(cfg)
    layout = P.ExecutionPlan.for_layout(
        QWEN3_235B, cfg.parallel_config, quant=None, batch=40, act_bytes=2, exe_mode="ge_graph"
    )
    decisions = ("quant", "paths", "buckets", "dispatch_batch", "mc2_window_mb", "mc2_limits", "decode_line")
    assert [getattr(layout, f) for f in decisions] == [getattr(built, f) for f in decisions]
    assert layout.paths.prefill == SP and "for 16 tokens" in built.prefill_line
    assert "tokens:" not in layout.prefill_line and layout.kv_pool_blocks is None
    assert layout.describe().splitlines()[-1] == "KV pool: none planned (each generate call sizes its own)"
