"""The recipe's `qwen3_235b_mxfp4_hadamard.yaml`, scaled to the test world, runs end to end (issue 37).

Its keys as the recipe file has them (world 4, attn_tp 4, moe_tp 1 so MoE EP 4, batch 1, eager, platform 950,
enable_hadamard with hadamard_weight_path), on the fixture tiny-h256 (toy B of spec a4w4_hadamard.md §4.2: 128
attention features per rank at TP 4) stored in bf16 and converted with `convert --quant w4a4
--hadamard-weight-path DIR` (DIR: the non-symmetric orthogonal rotations). The LongBench dataset is replaced by
prompts, 256 new tokens by 6, the model path and the rotation directory by the fixtures'. Through the library,
as `generate` assembles it: InferenceConfig -> validate_for_model -> ParallelState -> load_model with
`model_config.hadamard` -> ModelRunner. The layout runs the tensor-parallel prefill (the recipe's prefill_opt is off
for W4A4) and the MC2 dispatch / combine decode.

- The config is accepted (nothing refused) and a greedy generation of 6 tokens completes on all 4 ranks alike.
- Its prefill and teacher-forced decode logits equal the fake-quant W4A4 reference with the same rotations replaying
  the routing, within `model.w4a4.bfloat16` (and `min_separation` closer than the BF16 reference).
"""

from __future__ import annotations

import copy

import pytest
import torch

from equivalence.support.compare import rel_l2, tolerance
from equivalence.support.dist import get_pool
from equivalence.support.logits_runs import _draw_forced, _reference_logits, assert_bf16_logits_match_replayed_reference
from equivalence.support.parallel_support import reference_model, same_on_all_ranks
from equivalence.support.w4a4_recipe import (
    recipe_task,
)
from equivalence.support.w4a4_reference import fake_quant_reference
from optimized.path_plan import MC2, TP
from fixtures.checkpoints import rotation_dir, w4a4_checkpoint

pytestmark = pytest.mark.distributed

NAME, ROTATION = "tiny-h256", "orthogonal"
# qwen3_235b_mxfp4_hadamard.yaml's keys (recipe fbc225d), the paths and the dataset scaled to the test world
RECIPE = {
    "model_config": {
        "model_name": "qwen3_moe",
        "model_path": "<W4A4 checkpoint>",
        "exe_mode": "eager",
        "enable_profiler": False,
        "with_ckpt": True,
        "enable_cache_compile": False,
        "force_eplb": False,
        "platform_version": "950",
        "enable_hadamard": True,
        "hadamard_weight_path": "<rotations>",
    },
    "data_config": {"dataset": "prompts", "prompts": ["x"]},
    "parallel_config": {"world_size": 4, "attn_tp_size": 4, "moe_tp_size": 1, "embed_tp_size": 1, "lmhead_tp_size": 1},
    "scheduler_config": {"max_new_tokens": 6, "batch_size": 1},
}


def recipe_config() -> dict:
    cfg = copy.deepcopy(RECIPE)
    cfg["model_config"]["model_path"] = str(w4a4_checkpoint(NAME, ROTATION))
    cfg["model_config"]["hadamard_weight_path"] = str(rotation_dir(ROTATION))
    return cfg


def test_recipe_mxfp4_hadamard_runs_and_matches_the_fake_quant_reference():
    g = torch.Generator().manual_seed(37)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (15, 7)]
    forced = _draw_forced(37, 2, 2)
    got = same_on_all_ranks(
        get_pool(4).run(recipe_task, recipe_config(), prompts, forced, timeout=240), "recipe mxfp4_hadamard"
    )
    assert len(got["tokens"][0]) == 6
    assert got["prefill_path"] == TP, got["prefill_path"]  # prefill_opt off for W4A4
    assert got["decode_path"] == MC2, "the MC2 decode was expected at moe_tp 1, EP 4"
    bf16 = reference_model(NAME, "bfloat16")
    a, r, _, report = assert_bf16_logits_match_replayed_reference(
        got,
        NAME,
        prompts,
        forced,
        "recipe qwen3_235b_mxfp4_hadamard (world 4, attn_tp 4, EP 4)",
        replayed_ref=fake_quant_reference(NAME, ROTATION),
        own_ref=bf16,
        tol="model.w4a4.bfloat16",
        near_tie="router_tie.float32",
        ties_from_router_inputs=True,
    )
    unquantized = torch.cat([torch.cat(x) for x in _reference_logits(bf16, prompts, forced, got["routes"], 1.0, [])])
    separation = rel_l2(a, unquantized) / max(rel_l2(a, r), 1e-30)
    print(f"{report}; tokens {got['tokens']}; BF16 replaying the routing {separation:.2f}x farther")
    assert separation >= tolerance("model.w4a4.bfloat16").min_separation, report
