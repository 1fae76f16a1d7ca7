"""The optimized loader reads transformers v5's fused expert tensors (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]) into the same shards as the per-expert names, one slice per rank."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from equivalence.support.compare import assert_bitwise_equal
from fixtures.checkpoints import checkpoint
from fixtures.tiny import tiny_config
from optimized.model_loader.build import load_model
from optimized.distributed import ParallelState


@pytest.fixture(scope="module")
def fused_checkpoint(tmp_path_factory):
    src, config = checkpoint("tiny"), tiny_config("tiny")
    dst = tmp_path_factory.mktemp("fused")
    for item in src.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, dst / item.name)
    tensors = load_file(src / "model.safetensors")
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = range(config.num_experts)
        gate = [tensors.pop(f"{prefix}.{e}.gate_proj.weight") for e in experts]
        up = [tensors.pop(f"{prefix}.{e}.up_proj.weight") for e in experts]
        down = [tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in experts]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])  # [E, 2I, H]
        tensors[f"{prefix}.down_proj"] = torch.stack(down)  # [E, H, I]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "sizes, rank",
    [
        (dict(world_size=1), 0),
        (dict(world_size=2, moe_tp_size=1, moe_ep_size=2), 1),  # expert parallel: experts 8..15
        (dict(world_size=2, moe_tp_size=2, moe_ep_size=1, attn_dp=False), 1),  # MoE tensor parallel: second half of I
    ],
)
def test_fused_experts_load_the_same_shards_reading_only_them(fused_checkpoint, sizes, rank):
    parallel = ParallelState.build(rank=rank, create_groups=False, **sizes)
    per_expert = load_model(checkpoint("tiny"), parallel=parallel, dtype=torch.float32)
    fused = load_model(fused_checkpoint, parallel=parallel, dtype=torch.float32)
    want = dict(per_expert.named_parameters())
    for name, param in fused.named_parameters():
        assert_bitwise_equal(param, want[name], f"{sizes} rank {rank}: {name}")
    # the same bytes: each rank reads its experts' slices of the fused tensors, never the whole tensor
    assert fused.weight_source.bytes_read == per_expert.weight_source.bytes_read
