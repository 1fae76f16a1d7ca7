"""The decode's MoE plan: the recipe's MC2 rule as the plan decides it, the MC2 group's HCCL window and limits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimized.config import ParallelConfig
from optimized.distributed import decode_plan
from optimized.errors import UsageError
from optimized.path_plan import MC2, TP, decide_paths

QWEN3_235B = SimpleNamespace(hidden_size=4096, num_experts=128, num_experts_per_tok=8)


@pytest.mark.parametrize(
    "sizes, mc2",
    [
        (dict(world_size=4, attn_tp_size=4, moe_tp_size=1, moe_ep_size=4), True),
        (dict(world_size=4, attn_tp_size=4, moe_tp_size=2, moe_ep_size=2), False),
        (dict(world_size=4, attn_tp_size=4, moe_tp_size=4, moe_ep_size=1), False),
        (dict(world_size=1), False),
    ],
)
def test_mc2_decode_exactly_when_moe_tp_1_and_ep_above_1(sizes, mc2):
    parallel = ParallelConfig(**sizes)
    assert parallel.mc2_decode is mc2
    assert decide_paths(QWEN3_235B, parallel).decode == (MC2 if mc2 else TP)


def test_mc2_window_follows_the_recipes_rule_for_qwen3_235b():
    # EP 16, n = 256 tokens per rank (batch 4096), L = 8 local experts, H = 4096 bf16 = 8192 B per token.
    # Dispatch: a token's 8192 B move in ceil(8192 / 480) = 18 pieces, each in a 512 B aligned slot: 9216 B;
    #   L * n * EP slots of it = 8 * 256 * 16 * 9216 = 301,989,888 B.
    # Combine: top_k * n rows of align512(8192) = 8 * 256 * 8192 = 16,777,216 B.
    # Double-buffered: 2 * 318,767,104 B = 608 MiB exactly, + the 11 MB reserve = 619.
    assert decode_plan.mc2_window_mb(256, 8, 4096, 16, 128) == 619
    # H = 4000: 8000 B per token -> 17 pieces = 8704 B slots; combine rows align512(8000) = 8192 B:
    # 2 * (8 * 256 * 16 * 8704 + 8 * 256 * 8192) = 2 * (285,212,672 + 16,777,216) B = 576 MiB -> 576 + 11
    assert decode_plan.mc2_window_mb(256, 8, 4000, 16, 128) == 587
    # a small need never goes below HCCL's own 200 MB window
    assert decode_plan.mc2_window_mb(1, 8, 4096, 16, 128) == decode_plan.HCCL_DEFAULT_MB == 200


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 512),
    top_k=st.integers(1, 8),
    hidden=st.integers(1, 8192),
    ep=st.sampled_from([2, 4, 8, 16, 32]),
    per_rank=st.integers(1, 16),
    act=st.sampled_from([2, 4]),
)
def test_mc2_window_holds_the_worst_case_dispatch_and_combine(tokens, top_k, hidden, ep, per_rank, act):
    """Every local expert receiving every rank's tokens, each token's data in aligned slots, and the combine's rows,
    double-buffered, fit the window (the worst case HCCL must hold)."""
    row = hidden * act
    slot = -(-row // 480) * 512
    assert slot >= row and slot % 512 == 0
    worst = 2 * (per_rank * tokens * ep * slot + top_k * tokens * -(-row // 512) * 512)
    assert decode_plan.mc2_window_mb(tokens, top_k, hidden, ep, per_rank * ep, act) * (1 << 20) >= worst


def test_window_for_uses_the_most_tokens_a_rank_dispatches():
    mc2 = ParallelConfig(world_size=16, attn_tp_size=16, moe_tp_size=1, moe_ep_size=16)
    # batch 4090 over EP 16: 256 tokens on the first ranks (the recipe's 4090 // 16 = 255 would under-size it)
    assert decode_plan.window_for(QWEN3_235B, mc2, 4090, 2) == decode_plan.mc2_window_mb(256, 8, 4096, 16, 128)
    tp = ParallelConfig(world_size=16, attn_tp_size=16, moe_tp_size=16, moe_ep_size=1)
    assert decode_plan.window_for(QWEN3_235B, tp, 4090, 2) is None  # no MC2 decode


def test_a_batch_beyond_the_mc2_window_is_refused_naming_both():
    mc2 = ParallelConfig(world_size=16, attn_tp_size=16, moe_tp_size=1, moe_ep_size=16)
    decode_plan.check_mc2_window(QWEN3_235B, mc2, 4096, 2, 619)
    with pytest.raises(UsageError, match=r"batch of 4096 needs an MC2 window of 619 MB.*built with 200 MB"):
        decode_plan.check_mc2_window(QWEN3_235B, mc2, 4096, 2, 200)


def test_the_mc2_group_gets_its_window_only_on_hccl():
    assert decode_plan.mc2_group_options("gloo", 619) is None
    assert decode_plan.mc2_group_options("nccl", 619) is None


def test_parallel_state_builds_the_mc2_group_with_its_window_only_for_an_mc2_decode():
    from optimized.distributed import ParallelState

    mc2 = ParallelConfig(world_size=4, attn_tp_size=4, moe_tp_size=1, moe_ep_size=4)
    state = ParallelState.build(mc2, 2, create_groups=False, mc2_window_mb=619)
    assert state.moe_ep_mc2.ranks == state.moe_ep.ranks and state.moe_ep_mc2.window_mb == 619
    assert ParallelState.build(mc2, 2, create_groups=False).moe_ep_mc2.window_mb == decode_plan.HCCL_DEFAULT_MB
    tp = ParallelConfig(world_size=4, attn_tp_size=4, moe_tp_size=4, moe_ep_size=1)
    assert ParallelState.build(tp, 2, create_groups=False, mc2_window_mb=619).moe_ep_mc2 is None


# ----------------------------------------------------------------------------------- decode volume


def test_tp_decode_volume_is_the_two_all_reduces():
    # B 8 tokens of H 4096 bf16 = 64 KiB; moe_tp 4: 2 * 3/4 of it; moe_ep 2: 2 * 1/2 of it
    assert decode_plan.tp_volume(8, 4096, 4, 1, 2).parts == {"all_reduce": 2 * 3 * 65536 // 4}
    assert decode_plan.tp_volume(8, 4096, 4, 2, 2).parts == {"all_reduce": 2 * 3 * 65536 // 4 + 65536}
    tp = ParallelConfig(world_size=4, attn_tp_size=4, moe_tp_size=4, moe_ep_size=1)
    assert decode_plan.decode_volume(tp, 8, 4096, 8, 128, 2) == decode_plan.tp_volume(8, 4096, 4, 1, 2)


def test_mc2_decode_step_volume_for_a_qwen3_235b_layout():
    # EP 16, batch 64: n = 4 tokens per rank, L = 8; uniform routing: 4 * 8 * 15/16 = 30 slots out and in
    config = SimpleNamespace(**vars(QWEN3_235B), num_hidden_layers=94, mlp_only_layers=[], decoder_sparse_step=1)
    ep = ParallelConfig(world_size=16, attn_tp_size=16, moe_tp_size=1, moe_ep_size=16)
    layer = decode_plan.decode_volume(ep, 64, 4096, 8, 128, 2)
    assert layer.parts == {
        decode_plan.DISPATCH: 15 * 9 * 8 + 30 * (8192 + 8),
        decode_plan.COMBINE: 30 * 8192,
        "all_gather": 15 * 4 * 8192,
    }
    step = decode_plan.step_volume(config, ep, 64, 2)
    assert step.parts == {op: 94 * b for op, b in layer.parts.items()}


# ------------------------------------------------------------------------------------ attention data parallel

DP8 = ParallelConfig(
    world_size=8, attn_tp_size=2, moe_tp_size=1, moe_ep_size=8, embed_tp_size=1, lmhead_tp_size=1, attn_dp=True
)


def test_attention_dp_decode_volume_is_mc2_on_own_rows_without_the_gather():
    # TP 2 x DP 4, batch 12: 3 requests per DP group, n = 2 rows per rank; EP 8, L = 16; uniform 2 * 8 * 7 / 8 = 14
    # slots of 4096 bf16 (+ 8 B) out and in; counts 7 * (16 + 1) * 8 B
    assert decode_plan.dp_rows(12, DP8) == 2
    assert decode_plan.decode_volume(DP8, 12, 4096, 8, 128, 2).parts == {
        decode_plan.DISPATCH: 952 + 14 * 8200,
        decode_plan.COMBINE: 14 * 8192,
    }
    # the routing's slot counts: 5 slots out, 3 in
    assert decode_plan.decode_volume(DP8, 12, 4096, 8, 128, 2, 5, 3).parts == {
        decode_plan.DISPATCH: 952 + 5 * 8200,
        decode_plan.COMBINE: 3 * 8192,
    }
    # without DP the same ranks gather: batch 12 over EP 8, n = 2 rows to 7 peers
    mc2 = ParallelConfig(world_size=8, attn_tp_size=8, moe_tp_size=1, moe_ep_size=8)
    assert decode_plan.decode_volume(mc2, 12, 4096, 8, 128, 2).parts["all_gather"] == 7 * 2 * 8192


def test_attention_dp_step_volume_adds_attention_moe_and_the_lm_head_gather():
    config = SimpleNamespace(
        hidden_size=4096,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=3,
        vocab_size=151_936,
        mlp_only_layers=[1],
    )
    assert decode_plan.attention_dp_volume(DP8, 12, 4096, 2) == {"all_gather": 16_384, "reduce_scatter": 16_384}
    parts = decode_plan.dp_step_volume(config, DP8, 12, 2)
    assert parts == {
        "attention": {"all_gather": 3 * 16_384, "reduce_scatter": 3 * 16_384},  # every layer
        "moe": {decode_plan.DISPATCH: 2 * 115_752, decode_plan.COMBINE: 2 * 114_688},  # 2 MoE layers
        "lm_head": {"all_gather": 16_384},
    }  # hidden rows over attention TP: no logits cross ranks
    assert decode_plan.by_collective(parts) == {
        "all_gather": 4 * 16_384,
        "reduce_scatter": 49_152,
        decode_plan.DISPATCH: 231_504,
        decode_plan.COMBINE: 229_376,
    }
    tp1 = ParallelConfig(
        world_size=2, attn_tp_size=1, moe_tp_size=1, moe_ep_size=2, embed_tp_size=1, lmhead_tp_size=1, attn_dp=True
    )
    assert decode_plan.attention_dp_volume(tp1, 4, 4096, 2) == {}  # attention TP 1: nothing sent
    assert decode_plan.lm_head_dp_volume(tp1, 4, 4096, 2) == {}
    with pytest.raises(ValueError, match="lmhead_tp_size 2"):
        decode_plan.dp_step_volume(
            config,
            ParallelConfig(world_size=8, attn_tp_size=2, moe_tp_size=1, moe_ep_size=8, lmhead_tp_size=2, attn_dp=True),
            12,
            2,
        )


def test_attention_dp_mc2_window_is_sized_for_each_ranks_own_rows():
    # batch 10 over DP 4 x TP 2: m = 3, n = 2 rows per rank (ceil(3 / 2))
    assert decode_plan.window_for(QWEN3_235B, DP8, 10, 2) == decode_plan.mc2_window_mb(2, 8, 4096, 8, 128)
    # batch 4 over DP 4: one row on each group's first rank, none on its second; still n = 1 per rank
    assert decode_plan.window_for(QWEN3_235B, DP8, 4, 2) == decode_plan.mc2_window_mb(1, 8, 4096, 8, 128)


# ------------------------------------------------------------------------------------------ MC2 kernel limits

EP128 = ParallelConfig(world_size=128, attn_tp_size=1, moe_tp_size=1, moe_ep_size=128)  # the recipe's 128ep


def test_the_recipes_128ep_decode_is_within_the_mc2_limits_up_to_256_tokens_per_rank():
    # attention DP 128 x TP 1: batch B gives ceil(B / 128) rows per rank; fullmesh_v2 takes at most 256
    assert decode_plan.mc2_limit_violations(QWEN3_235B, EP128, 128 * 256) == []
    assert decode_plan.mc2_limit_violations(QWEN3_235B, EP128, 128 * 256 + 1) == [
        "257 tokens per rank (batch 32769) > 256 (fullmesh_v2)"
    ]
    assert (
        decode_plan.mc2_limit_violations(
            QWEN3_235B, ParallelConfig(world_size=4, attn_tp_size=4, moe_tp_size=4, moe_ep_size=1), 10**6
        )
        == []
    )  # no MC2


def test_mc2_limits_name_every_broken_one():
    wide = SimpleNamespace(hidden_size=64, num_experts=4096, num_experts_per_tok=16)
    layout = ParallelConfig(world_size=1024, attn_tp_size=1024, moe_tp_size=1, moe_ep_size=1024)
    assert decode_plan.mc2_limit_violations(wide, layout, 1024) == [
        "moe_ep_size 1024 > 768",
        "num_experts 4096 > 1024",
        "num_experts_per_tok 16 > 12 (fullmesh_v2)",
        "hidden_size 64 outside [1024, 8192]",
        "L * W = num_experts 4096 > 2048",
    ]


def test_mc2_limits_raise_at_start_up_where_enforced_and_are_named_elsewhere():
    tiny = SimpleNamespace(hidden_size=64, num_experts=8, num_experts_per_tok=2)
    ep2 = ParallelConfig(world_size=2, attn_tp_size=2, moe_tp_size=1, moe_ep_size=2)
    assert decode_plan.check_mc2_limits(tiny, ep2, 4, enforce=False) == ["hidden_size 64 outside [1024, 8192]"]
    with pytest.raises(
        decode_plan.Mc2LimitError,
        match=r"breaks the NPU kernels' limits: hidden_size 64 outside "
        r"\[1024, 8192\]; lower scheduler_config.batch_size",
    ):
        decode_plan.check_mc2_limits(tiny, ep2, 4, enforce=True)


def test_the_runner_checks_the_mc2_limits_before_any_step_on_an_npu_host_or_in_strict_mode(monkeypatch):
    """`ModelRunner.check_mc2` (generate and the serving engine call it first): enforced where the kernel would
    refuse the batch (an NPU host, or QWEN3_MOE_STRICT_NPU_LIMITS=1), not on the portable kernels."""
    from optimized import platform
    from optimized.executor.model_runner import ModelRunner
    from optimized.ops.validation import STRICT_ENV

    parallel = ParallelConfig(world_size=2, attn_tp_size=2, moe_tp_size=1, moe_ep_size=2)
    groups = SimpleNamespace(parallel=parallel, moe_ep_mc2=SimpleNamespace(window_mb=None))
    model = SimpleNamespace(config=QWEN3_235B, groups=groups, dtype=__import__("torch").bfloat16)
    runner = SimpleNamespace(model=model, dp_size=1, decode_forward=model)  # eager: the batch unpadded
    monkeypatch.setenv(STRICT_ENV, "0")
    ModelRunner.check_mc2(runner, 512)  # 256 tokens per rank: within
    monkeypatch.setattr(platform, "backend_name", lambda: "npu")
    with pytest.raises(decode_plan.Mc2LimitError, match="257 tokens per rank"):
        ModelRunner.check_mc2(runner, 514)
    monkeypatch.setattr(platform, "backend_name", lambda: "cpu")
    ModelRunner.check_mc2(runner, 514)
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(decode_plan.Mc2LimitError, match="257 tokens per rank"):
        ModelRunner.check_mc2(runner, 514)
