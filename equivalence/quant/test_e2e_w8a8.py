"""The W8A8 optimized model (MXFP8 experts and attention), sharded over real gloo ranks, computes what the
fake-quantized W8A8 reference computes.

Checkpoint: the tiny fixtures converted by `python -m optimized convert --quant w8a8` (the recipe's `w8a8c16`,
cached). Oracle: `reference.fake_quant.load_fake_quant_model(..., scheme="w8a8")`, the plain reference with MX
quantize-dequantize at the same points as W4A8 but MXFP8 E4M3 expert weights, written independently of the
portable MX operators. The experts run the recipe's `MxFp8MoEGMMMethod` (spec mx_quant.md §6.6 MXFP8 row:
grouped matmul with the weight scale in `scale`, npu_swiglu, then npu_dynamic_mx_quant).

- MoE block on 1 / 2 / 4 EP ranks vs the fake-quant reference replaying its expert ids within
  `layer.w8a8.bfloat16`, and `min_separation` times closer to it than to the BF16 reference and to the W4A8
  fake-quant reference (so the experts are MXFP8, not 16-bit and not MXFP4).
- Whole model, bf16, TP at world 1 / 2 (tiny, tiny-dense) and the sequence-parallel prefill at world 2 (the
  16-bit wire: the recipe's MXFP8 wire is W4A8 only): prefill and decode logits vs the fake-quant reference
  replaying the optimized routing within `model.w8a8.bfloat16`, and `min_separation` times closer to it than to
  the BF16 reference replaying the same routing.
"""

from __future__ import annotations

import functools

import pytest
import torch

from equivalence.support.compare import assert_close, describe, rel_l2, tolerance
from equivalence.support.dist import get_pool
from equivalence.support.logits_runs import (
    _draw_forced,
    _logits_task,
    _moe_bf16_task,
    _reference_logits,
    assert_bf16_logits_match_replayed_reference,
)
from equivalence.support.parallel_support import reference_model, routing_check, same_on_all_ranks
from equivalence.support.strategies import describe_layout, hidden_states, layout, sp_layout
from equivalence.support.w8a8_reference import (
    fake_quant_reference,
)
from fixtures.checkpoints import w8a8_checkpoint
from fixtures.tiny import tiny_config

pytestmark = pytest.mark.distributed

CONFIG = tiny_config("tiny")
H = CONFIG.hidden_size
CASES = {
    "tp1": (1, layout(1), "tiny"),
    "tp2": (2, layout(2, attn_tp_size=2, embed_tp_size=2, lmhead_tp_size=2), "tiny-dense"),
    "sp2-alltoall": (2, sp_layout(2, "alltoall", embed_tp_size=2, lmhead_tp_size=2), "tiny"),
}


@functools.lru_cache(maxsize=None)
def bf16_reference(name: str):
    return reference_model(name, "bfloat16")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_w8a8_moe_block_equals_fake_quant_reference(world):
    lay = layout(world)  # expert parallel over all ranks
    path = str(w8a8_checkpoint("tiny"))
    near_tie = tolerance("router_tie.bfloat16").rtol
    tol = tolerance("layer.w8a8.bfloat16")
    for kind, seed, layer_idx in {1: [("random", 1, 0), ("large", 3, 1)], 2: [("random", 4, 1)], 4: [("large", 6, 0)]}[
        world
    ]:
        x = hidden_states(kind, seed, 37, H, torch.bfloat16)
        got = same_on_all_ranks(get_pool(world).run(_moe_bf16_task, path, lay, layer_idx, x, timeout=120), "w8a8 moe")
        block = fake_quant_reference("tiny").model.layers[layer_idx].mlp
        with torch.no_grad():
            stats = routing_check(block.route(x)[2], block.top_k, got["ids"], near_tie)
            ids = got["ids"].long()
            want = block(x, expert_ids=ids)
            unquantized = bf16_reference("tiny").model.layers[layer_idx].mlp(x, expert_ids=ids)
            w4a8 = fake_quant_reference("tiny", "w4a8").model.layers[layer_idx].mlp(x, expert_ids=ids)
        near = rel_l2(got["out"], want)
        what = (
            f"{describe_layout(lay)} {kind} layer {layer_idx}: {stats}; vs fake-quant W8A8 "
            f"{describe(got['out'], want)}; rel_l2 vs BF16 {rel_l2(got['out'], unquantized):.3e}, vs fake-quant "
            f"W4A8 {rel_l2(got['out'], w4a8):.3e}"
        )
        print(what)
        assert stats.clear_flips == 0, what
        assert_close(got["out"], want, "layer.w8a8.bfloat16", what)
        assert near * tol.min_separation < rel_l2(got["out"], unquantized), what
        assert near * tol.min_separation < rel_l2(got["out"], w4a8), what


@pytest.mark.parametrize("case", list(CASES))
def test_w8a8_logits_match_fake_quant_reference(case):
    world, lay, name = CASES[case]
    path = str(w8a8_checkpoint(name))
    g = torch.Generator().manual_seed(world + 40)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in (17, 6)]
    forced = _draw_forced(world + 41, len(prompts), 2)
    got = same_on_all_ranks(
        get_pool(world).run(_logits_task, path, lay, "bfloat16", prompts, forced, timeout=180), "w8a8 logits"
    )
    assert got["ep_scheme"] == ("alltoall" if case.startswith("sp") else None)
    a, r, _, report = assert_bf16_logits_match_replayed_reference(
        got,
        name,
        prompts,
        forced,
        f"{describe_layout(lay)} {name} W8A8",
        replayed_ref=fake_quant_reference(name),
        own_ref=bf16_reference(name),
        tol="model.w8a8.bfloat16",
        near_tie="router_tie.float32",
        ties_from_router_inputs=True,
    )
    unquantized = torch.cat(
        [torch.cat(x) for x in _reference_logits(bf16_reference(name), prompts, forced, got["routes"], 1.0, [])]
    )
    separation = rel_l2(a, unquantized) / max(rel_l2(a, r), 1e-30)
    report += (
        f"; vs BF16 replaying the routing rel_l2 {rel_l2(a, unquantized):.3e}: {separation:.2f}x farther "
        f"than the fake-quant reference"
    )
    print(report)
    assert separation >= tolerance("model.w8a8.bfloat16").min_separation, report
