"""The MXFP8 wire of the SP prefill is the plan's decision, made once: a scheme whose table row says MXFP8 (W4A8)
under the SP prefill, nothing else; a layout that would split an MX block of the attention output across ranks is
refused with the keys named."""

from __future__ import annotations

import pytest

from equivalence.support.strategies import layout, sp_layout
from fixtures.tiny import tiny_config
from optimized.config import ParallelConfig
from optimized.distributed.prefill_plan import allgather_volume, attention_volume, mx_row_bytes
from optimized.layers.quantization.schemes import MXFP8_WIRE, SCHEMES, W4A8, W8A8
from optimized.path_plan import SP, TP, WIRE_16_BIT, PathPlanError, decide_paths


def test_chosen_for_w4a8_under_sp_prefill_only():
    tiny = tiny_config("tiny")
    assert [name for name, row in SCHEMES.items() if row.sp_wire == MXFP8_WIRE] == [W4A8]
    for sizes in (sp_layout(2, "allgather"), sp_layout(4, "alltoall")):
        assert decide_paths(tiny, ParallelConfig(**sizes), W4A8).wire == MXFP8_WIRE
        for scheme in (None, W8A8):
            paths = decide_paths(tiny, ParallelConfig(**sizes), scheme)
            assert (paths.prefill, paths.wire) == (SP, WIRE_16_BIT), scheme
    tp = decide_paths(tiny, ParallelConfig(**layout(2, attn_tp_size=2)), W4A8)
    assert (tp.prefill, tp.wire) == (TP, None)


def test_attention_width_not_whole_mx_blocks_is_refused():
    tiny = tiny_config("tiny")  # 8 heads x head_dim 16: 16 per rank at P = 8
    with pytest.raises(PathPlanError, match=r"num_attention_heads / attn_tp_size \* head_dim .* = 16.*multiple of 32"):
        decide_paths(tiny, ParallelConfig(**sp_layout(8, "alltoall")), W4A8)
    assert decide_paths(tiny, ParallelConfig(**sp_layout(8, "alltoall")), W8A8).wire == WIRE_16_BIT


def test_mx_wire_bytes_are_one_byte_per_element_plus_one_per_block():
    assert mx_row_bytes(2048) == 2048 + 64  # Qwen3-30B-A3B hidden: (1 + 1/32) of H
    assert mx_row_bytes(96) == 96 + 4  # 3 blocks, scale pairs padded to 2
    bf16, mx = attention_volume(10, 2048, 4096 // 4, 4, 2), attention_volume(10, 2048, 4096 // 4, 4, 2, mx=True)
    assert mx.parts["all_gather"] * 64 == bf16.parts["all_gather"] * 33
    assert mx.parts["all_to_all"] * 64 == bf16.parts["all_to_all"] * 33
    ag_bf16, ag_mx = allgather_volume(10, 2048, 8, 4, 2), allgather_volume(10, 2048, 8, 4, 2, mx=True)
    assert ag_bf16.parts["reduce_scatter"] == ag_mx.parts["reduce_scatter"]  # results come back in bf16
    assert ag_bf16.parts["all_gather"] - ag_mx.parts["all_gather"] == 3 * 10 * (2 * 2048 - 2048 - 64)
