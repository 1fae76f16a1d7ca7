"""The released Qwen3-MoE models' config.json facts, shipped with the product (package data, `presets/*.json`):
the shapes `bench`, the latency budgets and `preset:NAME` model paths use. Weights are never part of a preset."""

from __future__ import annotations

import copy
import json
from pathlib import Path

PRESET_DIR = Path(__file__).with_name("presets")
PRESETS: dict[str, dict] = {p.stem: json.loads(p.read_text()) for p in sorted(PRESET_DIR.glob("*.json"))}


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def preset_key(name: str) -> str:
    """'qwen3_30b_a3b', 'Qwen3-30B-A3B', ... -> the key of PRESETS (KeyError naming the known ones)."""
    for key in PRESETS:
        if _norm(key) == _norm(name):
            return key
    raise KeyError(f"no preset named {name!r}; known: {', '.join(_norm(k) for k in sorted(PRESETS))}")


def preset_config(name: str, num_hidden_layers: int | None = None):
    """The released config as a Qwen3MoeConfig, optionally cut to fewer layers (layer-level checks at real widths)."""
    from transformers import Qwen3MoeConfig

    key = preset_key(name)
    kwargs = copy.deepcopy(PRESETS[key])
    kwargs.pop("architectures", None)
    kwargs.pop("model_type", None)
    if num_hidden_layers is not None:
        if not 1 <= num_hidden_layers <= kwargs["num_hidden_layers"]:
            raise ValueError(
                f"num_hidden_layers={num_hidden_layers} must be in [1, {kwargs['num_hidden_layers']}] for {key}"
            )
        kwargs["num_hidden_layers"] = num_hidden_layers
    return Qwen3MoeConfig(**kwargs)
