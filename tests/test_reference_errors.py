"""The reference fails loudly, naming the tensor / key / value, instead of computing a wrong answer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.checkpoints import checkpoint
from fixtures.tiny import tiny_config
from reference.checkpoint import CheckpointError, load_model
from reference.model import KVCache, Qwen3MoeForCausalLM, UnsupportedConfigError


@pytest.fixture(scope="module")
def tiny_model():
    return load_model(checkpoint("tiny"))


def broken_copy(tmp_path, edit):
    """A copy of the single-file tiny checkpoint whose tensors went through `edit(dict) -> dict`."""
    src = checkpoint("tiny")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    save_file(edit(dict(tensors)), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_named(tmp_path):
    name = "model.layers.1.self_attn.q_norm.weight"
    path = broken_copy(tmp_path, lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=rf"missing tensor\(s\): {name}"):
        load_model(path)


def test_unexpected_tensor_is_named(tmp_path):
    name = "model.layers.0.mlp.experts.16.gate_proj.weight"
    path = broken_copy(tmp_path, lambda t: {**t, name: torch.zeros(32, 64)})
    with pytest.raises(CheckpointError, match=rf"unexpected tensor\(s\): {name}"):
        load_model(path)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    name = "model.layers.0.mlp.experts.3.down_proj.weight"  # [H=64, I=32], stored transposed
    path = broken_copy(tmp_path, lambda t: {**t, name: t[name].t().contiguous()})
    with pytest.raises(CheckpointError, match=rf"{name} has shape \(32, 64\).*expects \(64, 32\)"):
        load_model(path)


def test_integer_tensor_is_rejected(tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight"
    path = broken_copy(tmp_path, lambda t: {**t, name: t[name].to(torch.int8)})
    with pytest.raises(CheckpointError, match=rf"{name} has dtype torch.int8"):
        load_model(path)


def test_sharded_index_listing_an_absent_tensor(tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(checkpoint("tiny", sharded=True), dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.mlp.gate.weight"] = next(iter(index["weight_map"].values()))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"lists tensor\(s\) its shards lack: model.layers.9.mlp.gate.weight"):
        load_model(dst)


def test_directory_without_weights(tmp_path):
    shutil.copy(checkpoint("tiny") / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_model(tmp_path)


def test_other_model_type_is_rejected(tmp_path):
    config = json.loads((checkpoint("tiny") / "config.json").read_text())
    config["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model_type='llama'"):
        load_model(tmp_path)


@pytest.mark.parametrize("bad", [512, -1, 100000])
def test_token_id_outside_vocab(tiny_model, bad):
    ids = torch.tensor([[1, 2, bad, 3]])
    with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary \[0, 512\)"):
        tiny_model(ids)


def test_sequence_longer_than_max_positions(tiny_model):
    with pytest.raises(ValueError, match=r"total sequence length 257 .* max_position_embeddings=256"):
        tiny_model(torch.zeros(1, 257, dtype=torch.long))


def test_cache_plus_input_longer_than_max_positions(tiny_model):
    cache = tiny_model.new_cache()
    with torch.no_grad():
        tiny_model(torch.zeros(1, 250, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"total sequence length 260 \(cached 250 \+ new 10\).*=256"):
        tiny_model(torch.zeros(1, 10, dtype=torch.long), cache)


def test_cache_batch_mismatch(tiny_model):
    cache = tiny_model.new_cache()
    with torch.no_grad():
        tiny_model(torch.zeros(2, 3, dtype=torch.long), cache)
        with pytest.raises(ValueError, match="KV cache holds batch 2 but the input has batch 1"):
            tiny_model(torch.zeros(1, 1, dtype=torch.long), cache)


def test_cache_of_another_model(tiny_model):
    with pytest.raises(ValueError, match="KV cache has 3 layers; the model has 2"):
        tiny_model(torch.zeros(1, 1, dtype=torch.long), KVCache(3))


@pytest.mark.parametrize(
    "ids", [torch.zeros(1, 0, dtype=torch.long), torch.zeros(4, dtype=torch.long), torch.zeros(1, 4)]
)
def test_malformed_input_ids(tiny_model, ids):
    with pytest.raises(ValueError, match="input_ids"):
        tiny_model(ids)


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"use_sliding_window": True}, r"use_sliding_window=True"),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e6,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            r"rope_parameters\['rope_type'\]='yarn'",
        ),
        ({"attention_bias": True}, r"attention_bias=True"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ({"num_experts": 0}, r"num_experts=0 .* layers \[0, 1\] are sparse"),
        ({"num_experts_per_tok": 17}, r"num_experts_per_tok=17 .* num_experts=16"),
        ({"num_key_value_heads": 3}, r"num_key_value_heads=3 .* num_attention_heads=8"),
    ],
)
def test_unsupported_config_is_named(changes, key):
    config = tiny_config("tiny")
    for k, v in changes.items():
        setattr(config, k, v)
    with pytest.raises(UnsupportedConfigError, match=key):
        Qwen3MoeForCausalLM(config)


def test_num_experts_zero_is_fine_when_every_layer_is_dense():
    config = tiny_config("tiny")
    config.num_experts, config.mlp_only_layers = 0, [0, 1]
    Qwen3MoeForCausalLM(config)


def test_unknown_router_dtype():
    with pytest.raises(ValueError, match=r"router_dtype='fp16'"):
        Qwen3MoeForCausalLM(tiny_config("tiny"), router_dtype="fp16")
