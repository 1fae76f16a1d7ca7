"""The MXFP8-wire SP prefill is chosen once, at build time: W4A8 checkpoint and SP prefill layout, nothing else;
a layout that would split an MX block of the attention output across ranks is refused with the keys named."""

from __future__ import annotations

import pytest

from equivalence.support.strategies import layout, sp_layout
from fixtures.checkpoints import checkpoint, w4a8_checkpoint
from optimized.config import ParallelConfig
from optimized.model_loader.hf_config import load_hf_config
from optimized.phases import uses_mx_prefill
from optimized.distributed.prefill_plan import allgather_volume, attention_volume, mx_row_bytes


def test_chosen_for_w4a8_under_sp_prefill_only():
    w4a8, bf16 = load_hf_config(w4a8_checkpoint("tiny")), load_hf_config(checkpoint("tiny"))
    assert uses_mx_prefill(w4a8, ParallelConfig(**sp_layout(2, "allgather")))
    assert uses_mx_prefill(w4a8, ParallelConfig(**sp_layout(4, "alltoall")))
    assert not uses_mx_prefill(bf16, ParallelConfig(**sp_layout(2, "allgather")))
    assert not uses_mx_prefill(w4a8, ParallelConfig(**layout(2, attn_tp_size=2)))


def test_attention_width_not_whole_mx_blocks_is_refused():
    w4a8 = load_hf_config(w4a8_checkpoint("tiny"))  # 8 heads x head_dim 16: 16 per rank at P = 8
    with pytest.raises(ValueError, match=r"num_attention_heads / attn_tp_size \* head_dim .* = 16.*multiple of 32"):
        uses_mx_prefill(w4a8, ParallelConfig(**sp_layout(8, "alltoall")))


def test_mx_wire_bytes_are_one_byte_per_element_plus_one_per_block():
    assert mx_row_bytes(2048) == 2048 + 64  # Qwen3-30B-A3B hidden: (1 + 1/32) of H
    assert mx_row_bytes(96) == 96 + 4  # 3 blocks, scale pairs padded to 2
    bf16, mx = attention_volume(10, 2048, 4096 // 4, 4, 2), attention_volume(10, 2048, 4096 // 4, 4, 2, mx=True)
    assert mx.parts["all_gather"] * 64 == bf16.parts["all_gather"] * 33
    assert mx.parts["all_to_all"] * 64 == bf16.parts["all_to_all"] * 33
    ag_bf16, ag_mx = allgather_volume(10, 2048, 8, 4, 2), allgather_volume(10, 2048, 8, 4, 2, mx=True)
    assert ag_bf16.parts["reduce_scatter"] == ag_mx.parts["reduce_scatter"]  # results come back in bf16
    assert ag_bf16.parts["all_gather"] - ag_mx.parts["all_gather"] == 3 * 10 * (2 * 2048 - 2048 - 64)
