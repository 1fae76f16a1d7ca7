"""A checkpoint's config.json, read through transformers and checked before anything is built.

transformers fills absent keys with the 30B model's defaults and reads any model_type into a
Qwen3MoeConfig without complaint, so a llama config or a config missing `num_attention_heads` would
load and compute garbage. `load_hf_config` refuses those with a ModelConfigError naming the key and the
fix: another model_type, a missing or non-positive size / head / expert count, and the features the
optimized model does not implement (`model.UNSUPPORTED`). A `quantization_config` must be exactly what the
recipe's converter writes (QuantConfigError naming the key otherwise).
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen3MoeConfig

from optimized.model_loader.checkpoint_files import read_json
from optimized.errors import UsageError

REQUIRED_POSITIVE = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "max_position_embeddings",
)


class ModelConfigError(UsageError, ValueError):
    """config.json describes a model this project cannot run (the message names the key)."""


def _positive(raw: dict, key: str, file: Path) -> None:
    if key not in raw:
        raise ModelConfigError(
            f"{file}: required key {key!r} is missing (transformers would silently use a "
            f"default); add it from the released model's config.json"
        )
    value = raw[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"{file}: {key}={value!r} must be a positive integer")


def check_config_dict(raw: dict, file: Path) -> None:
    """The checks that need config.json as written (before transformers fills in defaults)."""
    if raw.get("model_type") != "qwen3_moe":
        raise ModelConfigError(
            f"{file} has model_type={raw.get('model_type')!r}; this project runs 'qwen3_moe' "
            f"(Qwen3-MoE) checkpoints only"
        )
    for key in REQUIRED_POSITIVE:
        _positive(raw, key, file)
    only = raw.get("mlp_only_layers") or []
    step = raw.get("decoder_sparse_step", 1) or 1
    if any(i not in only and (i + 1) % step == 0 for i in range(raw["num_hidden_layers"])):  # some MoE layer
        _positive(raw, "num_experts", file)
        _positive(raw, "num_experts_per_tok", file)
        if raw["num_experts_per_tok"] > raw["num_experts"]:
            raise ModelConfigError(
                f"{file}: num_experts_per_tok={raw['num_experts_per_tok']} exceeds num_experts={raw['num_experts']}"
            )
    if raw["num_attention_heads"] % raw["num_key_value_heads"]:
        raise ModelConfigError(
            f"{file}: num_attention_heads={raw['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads={raw['num_key_value_heads']}"
        )


def check_supported(config, file) -> None:
    from optimized.model import unsupported_feature

    found = unsupported_feature(config)
    if found:
        raise ModelConfigError(
            f"{file}: {found[0]}={found[1]!r} is not supported by the optimized model (the "
            f"released Qwen3-MoE checkpoints do not use it); use a checkpoint without it"
        )


def load_hf_config(path) -> Qwen3MoeConfig:
    """config.json of the checkpoint directory `path`, checked (ModelConfigError names what is wrong)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelConfigError(f"model path {str(path)!r} does not exist or is not a directory")
    file = path / "config.json"
    if not file.is_file():
        raise ModelConfigError(
            f"model path {str(path)!r} has no config.json; point it at a Hugging Face checkpoint directory"
        )
    raw = read_json(file, ModelConfigError, "fix it, or re-download the checkpoint's config.json")
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{file} must hold a JSON object")
    for name, stored in Qwen3MoeConfig.attribute_map.items():  # transformers v5 writes num_local_experts
        if stored in raw and name not in raw:
            raw[name] = raw[stored]
    check_config_dict(raw, file)
    config = Qwen3MoeConfig.from_pretrained(path)
    check_supported(config, file)
    if raw.get("quantization_config"):
        from optimized.layers.quantization.converter_config import check_recipe_quantization_config
        from optimized.layers.quantization.schemes import quant_scheme

        quant_scheme(config)  # the scheme's own errors first (bits, block size, method)
        check_recipe_quantization_config(raw["quantization_config"], raw["num_hidden_layers"])
    return config
