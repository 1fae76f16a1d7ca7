"""The optimized loader names what is wrong with a checkpoint or a parallel layout."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.checkpoints import checkpoint
from optimized.model_loader.build import load_model
from optimized.distributed import ParallelState
from optimized.config import ConfigError
from optimized.model_loader.loader import CheckpointError


@pytest.fixture
def broken_copy(tmp_path):
    """A writable copy of the single-file tiny checkpoint and its tensors."""
    source = checkpoint("tiny")
    for item in source.iterdir():
        shutil.copy(item, tmp_path / item.name)
    tensors = load_file(tmp_path / "model.safetensors")

    def write(changed):
        save_file(changed, tmp_path / "model.safetensors")
        return tmp_path

    return tensors, write


def test_missing_tensor_is_named(broken_copy):
    tensors, write = broken_copy
    del tensors["model.layers.1.mlp.experts.7.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.experts\.7\.up_proj\.weight'"):
        load_model(write(tensors), dtype=torch.float32)


def test_unexpected_tensor_is_named(broken_copy):
    tensors, write = broken_copy
    tensors["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(4, 4)
    with pytest.raises(CheckpointError, match=r"unexpected tensors .*model\.layers\.0\.mlp\.shared_expert\.weight"):
        load_model(write(tensors), dtype=torch.float32)


def test_misshaped_tensor_names_both_shapes(broken_copy):
    tensors, write = broken_copy
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \(16, 64\); the model expects \(32, 64\)"):
        load_model(write(tensors), dtype=torch.float32)


@pytest.mark.parametrize(
    "sizes, key",
    [
        (dict(world_size=2, attn_tp_size=2, moe_tp_size=1, moe_ep_size=2), None),  # valid
        (dict(world_size=3, attn_tp_size=3, moe_tp_size=3), "parallel_config.attn_tp_size"),  # 8 heads % 3
        (dict(world_size=3, moe_tp_size=1, moe_ep_size=3), "parallel_config.moe_ep_size"),  # 16 experts % 3
    ],
)
def test_parallel_layout_checked_against_the_model(sizes, key):
    parallel = ParallelState.build(rank=0, create_groups=False, **sizes)
    if key is None:
        load_model(checkpoint("tiny"), parallel=parallel, dtype=torch.float32)
        return
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_model(checkpoint("tiny"), parallel=parallel, dtype=torch.float32)


def test_num_hidden_layers_override_is_bounded():
    with pytest.raises(ValueError, match=r"num_hidden_layers=3 must be in \[1, 2\]"):
        load_model(checkpoint("tiny"), num_hidden_layers=3)
    model = load_model(checkpoint("tiny"), num_hidden_layers=1, dtype=torch.float32)
    assert len(model.layers) == 1


def test_random_weights_are_repeatable_and_need_no_safetensors(tmp_path):
    shutil.copy(checkpoint("tiny") / "config.json", tmp_path / "config.json")
    a = load_model(tmp_path, random_weights=True, seed=3, dtype=torch.float32)
    b = load_model(tmp_path, random_weights=True, seed=3, dtype=torch.float32)
    c = load_model(tmp_path, random_weights=True, seed=4, dtype=torch.float32)
    assert torch.equal(a.layers[1].mlp.experts.w13, b.layers[1].mlp.experts.w13)
    assert not torch.equal(a.layers[1].mlp.experts.w13, c.layers[1].mlp.experts.w13)


# ---------------------------------------------------------------------------------- kv_cache_scheme


def _fp8_scheme() -> dict:
    from optimized.model_loader.quantize import quantization_config

    return quantization_config(2, kv_cache="fp8")["kv_cache_scheme"]


@pytest.mark.parametrize(
    "key, value",
    [
        ("num_bits", 4),
        ("type", "int"),
        ("strategy", "tensor"),
        ("group_size", 128),
        ("dynamic", "false"),
        ("symmetric", False),
        ("num_bits", "8"),
    ],
)
def test_kv_cache_scheme_other_than_the_recipes_names_the_key(key, value):
    from optimized.layers.quantization.errors import QuantConfigError
    from optimized.layers.quantization.kv_cache import kv_cache_scheme

    scheme = _fp8_scheme()
    scheme[key] = value
    with pytest.raises(QuantConfigError) as e:
        kv_cache_scheme({"kv_cache_scheme": scheme})
    assert f"kv_cache_scheme.{key}={value!r} is not supported" in str(e.value)


def test_kv_cache_scheme_extra_key_is_one_error_naming_it():
    from optimized.layers.quantization.errors import QuantConfigError
    from optimized.layers.quantization.kv_cache import kv_cache_scheme

    scheme = {**_fp8_scheme(), "observer": "minmax"}
    with pytest.raises(QuantConfigError) as e:
        kv_cache_scheme({"kv_cache_scheme": scheme})
    assert "kv_cache_scheme.observer is not a key" in str(e.value) and str(e.value).count("kv_cache_scheme.") == 1


def test_kv_cache_scheme_recipe_null_and_absent():
    from optimized.layers.quantization.errors import QuantConfigError
    from optimized.layers.quantization.kv_cache import FLOAT8, kv_cache_scheme

    assert kv_cache_scheme({"kv_cache_scheme": _fp8_scheme()}) == FLOAT8
    assert kv_cache_scheme({"kv_cache_scheme": None}) is None and kv_cache_scheme({}) is None
    with pytest.raises(QuantConfigError, match=r"kv_cache_scheme='fp8' must be an object or null"):
        kv_cache_scheme({"kv_cache_scheme": "fp8"})
