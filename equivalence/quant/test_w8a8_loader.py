"""A converted W8A8 checkpoint (the recipe's `w8a8c16`: MXFP8 experts and attention) loads as its bytes, sharded.

- Expert parallel at world 1 / 2 / 4, attention TP 2: every rank's MXFP8 experts (`MxFp8MoEGMMMethod`) hold the
  checkpoint's float8_e4m3fn gate / up rows (w13_weight), down rows (w2_weight) and scale bytes of its expert
  range bitwise, the scale padded to an even block count with a zero byte; attention is `MxFp8LinearMethod`.
- config.json's quantization_config as the recipe's converter writes it for w8a8c16, as text (group_0 alone,
  the per-token FP8 kv_cache_scheme qwen3_moe gets), loads, runs the FP8 KV cache and generates what the
  project's own `convert --quant w8a8 --kv-cache fp8` conversion generates.
- A W4A8 (MXFP4 expert) tensor under a W8A8 config, and a group_1 the converter never writes, are errors naming
  the tensor / the key.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from equivalence.support.compare import assert_bitwise_equal
from equivalence.support.recipe_quant_config import RECIPE_LINEAR_GROUP, RECIPE_QUANTIZATION_TEMPLATE
from equivalence.support.strategies import layout
from fixtures.checkpoints import w4a8_checkpoint, w8a8_checkpoint
from fixtures.tiny import tiny_config
from optimized.distributed import ParallelState
from optimized.layers.quantization.errors import QuantConfigError
from optimized.layers.quantization.lifecycle import checkpoint_layout_parameters
from optimized.layers.quantization.mxfp8 import MxFp8LinearMethod
from optimized.layers.quantization.w8a8 import MxFp8MoEGMMMethod
from optimized.model_loader.build import load_model
from optimized.model_loader.loader import CheckpointError

CONFIG = tiny_config("tiny")

# The recipe's w8a8c16 config.json quantization_config: the w4a8c16 one without group_1.
RECIPE_W8A8_QUANTIZATION_CONFIG = RECIPE_QUANTIZATION_TEMPLATE % f'"group_0": {RECIPE_LINEAR_GROUP}'


@pytest.mark.parametrize(
    "lay", [layout(1), layout(2, attn_tp_size=2), layout(4)], ids=lambda l: f"ep{l['moe_ep_size']}"
)
def test_w8a8_experts_load_the_checkpoint_bytes_of_their_expert_range(lay):
    path = w8a8_checkpoint("tiny")
    tensors = load_file(path / "model.safetensors")
    world = lay["moe_ep_size"]
    local = CONFIG.num_experts // world
    for rank in range(world):
        state = ParallelState.build(rank=rank, create_groups=False, **lay)
        model = load_model(path, parallel=state, dtype=torch.bfloat16)
        for i, layer in enumerate(model.layers):
            experts = layer.mlp.experts
            loaded = SimpleNamespace(**checkpoint_layout_parameters(experts))  # as loaded, not the runtime layouts
            assert isinstance(experts.quant_method, MxFp8MoEGMMMethod)
            assert isinstance(layer.self_attn.merged_qkv_proj.quant_method, MxFp8LinearMethod)
            assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.float8_e4m3fn
            for j in range(local):
                name = f"model.layers.{i}.mlp.experts.{rank * local + j}"
                gate, up, down = (tensors[f"{name}.{p}_proj.weight"] for p in ("gate", "up", "down"))
                scales = [tensors[f"{name}.{p}_proj.weight_scale"] for p in ("gate", "up", "down")]
                what = f"rank {rank} layer {i} expert {rank * local + j}"
                assert_bitwise_equal(loaded.w13_weight[j], torch.cat([gate, up]), f"{what} w13")
                assert_bitwise_equal(loaded.w2_weight[j], down, f"{what} w2")
                nb13, nb2 = scales[0].shape[1], scales[2].shape[1]
                assert_bitwise_equal(loaded.w13_weight_scale[j, :, :nb13], torch.cat(scales[:2]), f"{what} w13 scale")
                assert_bitwise_equal(loaded.w2_weight_scale[j, :, :nb2], scales[2], f"{what} w2 scale")
                assert not loaded.w13_weight_scale[j, :, nb13:].any() and not loaded.w2_weight_scale[j, :, nb2:].any()


@pytest.fixture
def w8a8_copy(tmp_path):
    for item in w8a8_checkpoint("tiny", kv_cache="fp8").iterdir():
        shutil.copy(item, tmp_path / item.name)
    return tmp_path


def test_recipe_w8a8_config_loads_and_generates_with_the_fp8_kv_cache(w8a8_copy):
    from optimized.executor.model_runner import ModelRunner

    ours = ModelRunner(load_model(w8a8_copy, dtype=torch.bfloat16), 16)
    config = json.loads((w8a8_copy / "config.json").read_text())
    assert json.dumps(config["quantization_config"]) == json.dumps(json.loads(RECIPE_W8A8_QUANTIZATION_CONFIG))
    config["quantization_config"] = json.loads(RECIPE_W8A8_QUANTIZATION_CONFIG)
    (w8a8_copy / "config.json").write_text(json.dumps(config, indent=2))
    runner = ModelRunner(load_model(w8a8_copy, dtype=torch.bfloat16), 16)
    assert runner.kv_cache_dtype == ours.kv_cache_dtype == torch.float8_e4m3fn
    prompts = [[5, 6, 7, 8, 9], list(range(20, 37))]
    assert runner.generate(prompts, 4).tokens == ours.generate(prompts, 4).tokens


def test_w4a8_expert_tensor_under_a_w8a8_config_is_named(w8a8_copy):
    for item in w4a8_checkpoint("tiny").glob("*.safetensors"):
        shutil.copy(item, w8a8_copy / item.name)
    # packed FP4 [N, K/2] where MXFP8 stores [N, K]: the shape check names it first
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight' has shape "
        r"\(32, 32\); the model expects \(32, 64\)",
    ):
        load_model(w8a8_copy, dtype=torch.bfloat16)


def test_w8a8_config_with_an_8_bit_moe_group_is_an_error_naming_the_key(w8a8_copy):
    config = json.loads((w8a8_copy / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    groups["group_1"] = dict(groups["group_0"], targets=["MoEGMM"])
    (w8a8_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        QuantConfigError,
        match=r"config_groups \(\(weight, activation\) bits per target.*\{'Linear': \(8, 8\), 'MoEGMM': \(8, 8\)\}",
    ):
        load_model(w8a8_copy, dtype=torch.bfloat16)
