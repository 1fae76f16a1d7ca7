"""The decode's MoE plan: the recipe's MC2 rule, the HCCL buffer formula and the start-up line."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from optimized.config import ParallelConfig
from optimized.distributed import decode_plan

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
