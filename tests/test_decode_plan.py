"""The decode's MoE plan: the recipe's MC2 rule, the HCCL buffer formula and the start-up line."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from optimized.config import ParallelConfig
from optimized.distributed import decode_plan
from optimized.errors import UsageError

QWEN3_235B = SimpleNamespace(hidden_size=4096, num_experts=128, num_experts_per_tok=8)


@pytest.mark.parametrize("sizes, mc2", [
    (dict(world_size=4, attn_tp_size=4, moe_tp_size=1, moe_ep_size=4), True),
    (dict(world_size=4, attn_tp_size=4, moe_tp_size=2, moe_ep_size=2), False),
    (dict(world_size=4, attn_tp_size=4, moe_tp_size=4, moe_ep_size=1), False),
    (dict(world_size=1), False),
])
def test_mc2_decode_exactly_when_moe_tp_1_and_ep_above_1(sizes, mc2):
    assert decode_plan.uses_mc2_decode(ParallelConfig(**sizes)) is mc2


def test_hccl_buffer_formula_for_a_qwen3_235b_layout():
    # EP 32, batch 32: n = 1 token per rank, L = 4, A = 1 * 32 * min(4, 8) = 128 rows of 4096 bf16 + 8 int32;
    # combine: 1 * 8 rows of 4096 bf16; both double-buffered: 2 * (128 * 8224 + 8 * 8192) B = 2.13 MiB -> 3 + 2
    assert decode_plan.mc2_buffer_mb(32, 8, 4096, 32, 128) == 5
    # EP 16, batch 256: n = 16, L = 8, A = 16 * 16 * 8 = 2048 rows; 2 * (2048 * 8224 + 128 * 8192) B = 34.1 MiB
    assert decode_plan.mc2_buffer_mb(256, 8, 4096, 16, 128) == 35 + 2


def test_describe_names_the_decode_path_and_buffer():
    ep = ParallelConfig(world_size=4, attn_tp_size=4, moe_tp_size=1, moe_ep_size=4)
    line = decode_plan.describe(QWEN3_235B, ep, 8, 2)      # n = 2, A = 64 rows: 2 * (64 * 8224 + 16 * 8192) B -> 2 + 2
    assert "moe_infer_dispatch_combine" in line and "HCCL buffer >= 4 MB" in line, line
    tp = ParallelConfig(world_size=4, attn_tp_size=4, moe_tp_size=4, moe_ep_size=1)
    assert "moe_infer_tp" in decode_plan.describe(QWEN3_235B, tp, 8, 2)


# ------------------------------------------------------------------------------------ HCCL_BUFFSIZE

def test_hccl_buffsize_is_not_set_off_hccl_or_without_mc2():
    for backend in ("gloo", "nccl"):
        assert decode_plan.hccl_buffsize_setting(backend, 500, {}) is None
        # a too-small export matters to HCCL only: gloo / nccl never read it
        assert decode_plan.hccl_buffsize_setting(backend, 500, {"HCCL_BUFFSIZE": "1"}) is None
    assert decode_plan.hccl_buffsize_setting("hccl", None, {}) is None                  # no MC2 decode


def test_hccl_buffsize_unset_is_exported_only_above_hccls_default():
    assert decode_plan.hccl_buffsize_setting("hccl", 201, {}) == "201"
    assert decode_plan.hccl_buffsize_setting("hccl", 5000, {}) == "5000"
    # HCCL's own 200 MB window holds a smaller need; exporting the need would shrink every communicator's window
    assert decode_plan.hccl_buffsize_setting("hccl", 200, {}) is None
    assert decode_plan.hccl_buffsize_setting("hccl", 5, {}) is None


def test_hccl_buffsize_exported_by_the_user_is_kept_when_large_enough():
    assert decode_plan.hccl_buffsize_setting("hccl", 300, {"HCCL_BUFFSIZE": "300"}) is None
    assert decode_plan.hccl_buffsize_setting("hccl", 300, {"HCCL_BUFFSIZE": "1024"}) is None
    assert decode_plan.hccl_buffsize_setting("hccl", 5, {"HCCL_BUFFSIZE": "10"}) is None     # below 200, above the need


@pytest.mark.parametrize("raw, needed", [("299", 300), ("4", 5), ("0", 5), ("-3", 5), ("big", 5), ("", 5)])
def test_hccl_buffsize_exported_below_the_need_is_an_error_naming_it(raw, needed):
    with pytest.raises(UsageError) as err:
        decode_plan.hccl_buffsize_setting("hccl", needed, {"HCCL_BUFFSIZE": raw})
    msg = str(err.value)
    assert f"HCCL_BUFFSIZE={raw}" in msg or f"HCCL_BUFFSIZE={raw!r}" in msg, msg
    assert str(needed) in msg, msg


def test_apply_hccl_buffsize_exports_the_largest_mc2_need_of_the_layouts():
    mc2 = ParallelConfig(world_size=8, attn_tp_size=8, moe_tp_size=1, moe_ep_size=8)
    tp = ParallelConfig(world_size=8, attn_tp_size=8, moe_tp_size=8, moe_ep_size=1)
    # batch 2048 at EP 8: n = 256, A = 256 * 8 * min(16, 8) = 16384 rows of 4096 bf16 + 8 int32, combine 256 * 8
    # rows: 2 * (16384 * 8224 + 2048 * 8192) B = 288.8 MiB -> 289 + 2
    need = decode_plan.mc2_buffer_mb(2048, 8, 4096, 8, 128)
    assert need == 291 > decode_plan.HCCL_DEFAULT_MB
    env: dict[str, str] = {}
    assert decode_plan.apply_hccl_buffsize(QWEN3_235B, [tp, mc2], 2048, 2, backend="hccl", environ=env) == "291"
    assert env == {"HCCL_BUFFSIZE": "291"}
    env = {}
    assert decode_plan.apply_hccl_buffsize(QWEN3_235B, tp, 2048, 2, backend="hccl", environ=env) is None and env == {}
    assert decode_plan.apply_hccl_buffsize(QWEN3_235B, mc2, 2048, 2, backend="gloo", environ=env) is None and env == {}
    env = {"HCCL_BUFFSIZE": "1024"}
    assert decode_plan.apply_hccl_buffsize(QWEN3_235B, mc2, 2048, 2, backend="hccl", environ=env) is None
    assert env == {"HCCL_BUFFSIZE": "1024"}
    with pytest.raises(UsageError, match="HCCL_BUFFSIZE=290 .* below the 291 MB"):
        decode_plan.apply_hccl_buffsize(QWEN3_235B, mc2, 2048, 2, backend="hccl", environ={"HCCL_BUFFSIZE": "290"})


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
    assert layer.parts == {decode_plan.DISPATCH: 15 * 9 * 8 + 30 * (8192 + 8), decode_plan.COMBINE: 30 * 8192,
                           "all_gather": 15 * 4 * 8192}
    step = decode_plan.step_volume(config, ep, 64, 2)
    assert step.parts == {op: 94 * b for op, b in layer.parts.items()}


def test_apply_hccl_buffsize_asks_the_platform_for_the_backend(monkeypatch):
    mc2 = ParallelConfig(world_size=8, attn_tp_size=8, moe_tp_size=1, moe_ep_size=8)
    env: dict[str, str] = {}
    assert decode_plan.apply_hccl_buffsize(QWEN3_235B, mc2, 2048, 2, environ=env) is None and env == {}  # CPU: gloo
    monkeypatch.setattr(decode_plan.platform, "dist_backend", lambda: "hccl")
    assert decode_plan.apply_hccl_buffsize(QWEN3_235B, mc2, 2048, 2, environ=env) == "291"
    assert env == {"HCCL_BUFFSIZE": "291"}


# ------------------------------------------------------------------------------------ attention data parallel

DP8 = ParallelConfig(world_size=8, attn_tp_size=2, moe_tp_size=1, moe_ep_size=8, embed_tp_size=1, lmhead_tp_size=1,
                     attn_dp=True)


def test_attention_dp_decode_volume_is_mc2_on_own_rows_without_the_gather():
    # TP 2 x DP 4, batch 12: 3 requests per DP group, n = 2 rows per rank; EP 8, L = 16; uniform 2 * 8 * 7 / 8 = 14
    # slots of 4096 bf16 (+ 8 B) out and in; counts 7 * (16 + 1) * 8 B
    assert decode_plan.dp_rows(12, DP8) == 2
    assert decode_plan.decode_volume(DP8, 12, 4096, 8, 128, 2).parts == {
        decode_plan.DISPATCH: 952 + 14 * 8200, decode_plan.COMBINE: 14 * 8192}
    # the routing's slot counts: 5 slots out, 3 in
    assert decode_plan.decode_volume(DP8, 12, 4096, 8, 128, 2, 5, 3).parts == {
        decode_plan.DISPATCH: 952 + 5 * 8200, decode_plan.COMBINE: 3 * 8192}
    # without DP the same ranks gather: batch 12 over EP 8, n = 2 rows to 7 peers
    mc2 = ParallelConfig(world_size=8, attn_tp_size=8, moe_tp_size=1, moe_ep_size=8)
    assert decode_plan.decode_volume(mc2, 12, 4096, 8, 128, 2).parts["all_gather"] == 7 * 2 * 8192


def test_attention_dp_step_volume_adds_attention_moe_and_the_logits_gather():
    config = SimpleNamespace(hidden_size=4096, num_experts=128, num_experts_per_tok=8, num_hidden_layers=3,
                             vocab_size=151_936, mlp_only_layers=[1])
    assert decode_plan.attention_dp_volume(DP8, 12, 4096, 2) == {"all_gather": 16_384, "reduce_scatter": 16_384}
    parts = decode_plan.dp_step_volume(config, DP8, 12, 2)
    assert parts == {"attention": {"all_gather": 3 * 16_384, "reduce_scatter": 3 * 16_384},       # every layer
                     "moe": {decode_plan.DISPATCH: 2 * 115_752, decode_plan.COMBINE: 2 * 114_688},  # 2 MoE layers
                     "logits": {"all_gather": 7 * 2 * 151_936 * 2}}
    assert decode_plan.by_collective(parts) == {"all_gather": 3 * 16_384 + 4_254_208, "reduce_scatter": 49_152,
                                                decode_plan.DISPATCH: 231_504, decode_plan.COMBINE: 229_376}
    tp1 = ParallelConfig(world_size=2, attn_tp_size=1, moe_tp_size=1, moe_ep_size=2, embed_tp_size=1,
                         lmhead_tp_size=1, attn_dp=True)
    assert decode_plan.attention_dp_volume(tp1, 4, 4096, 2) == {}                 # attention TP 1: nothing sent
    with pytest.raises(ValueError, match="lmhead_tp_size 2"):
        decode_plan.dp_step_volume(config, ParallelConfig(world_size=8, attn_tp_size=2, moe_tp_size=1, moe_ep_size=8,
                                                          lmhead_tp_size=2, attn_dp=True), 12, 2)


def test_attention_dp_hccl_buffer_is_sized_for_each_ranks_own_rows():
    # batch 10 over DP 4 x TP 2: m = 3, n = 2 rows per rank, as if the batch were 2 * 8 = 16 (ceil(10 / 8) = 2 too)
    assert decode_plan.needed_buffer_mb(QWEN3_235B, [DP8], 10, 2) == decode_plan.mc2_buffer_mb(16, 8, 4096, 8, 128)
    # batch 4 over DP 4: one row on each group's first rank, none on its second; still n = 1 per rank
    assert decode_plan.needed_buffer_mb(QWEN3_235B, [DP8], 4, 2) == decode_plan.mc2_buffer_mb(8, 8, 4096, 8, 128)
