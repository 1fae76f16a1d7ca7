"""What the benchmarks share: the model shapes they run (released presets, the tiny fixture), dtypes, progress."""

from __future__ import annotations

import sys

import torch

from optimized.errors import UsageError
from optimized.model_loader.model_path import fixture_config
from optimized.model_loader.presets import PRESETS, preset_config

BENCH_PRESETS = {"qwen3_30b_a3b": "Qwen3-30B-A3B", "qwen3_235b_a22b": "Qwen3-235B-A22B", "tiny": "tiny"}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
GB = 1e9


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def bench_config(preset: str, layers: int):
    if preset == "tiny":
        config = fixture_config("tiny", "bench --preset tiny")
        config.num_hidden_layers = layers
        return config
    try:
        return preset_config(BENCH_PRESETS[preset], num_hidden_layers=layers)
    except ValueError as e:
        raise UsageError(f"--layers: {e}") from None


def full_layer_count(preset: str) -> int:
    """Decoder layers of the released model (or of the tiny fixture)."""
    if preset == "tiny":
        return fixture_config("tiny", "bench --preset tiny").num_hidden_layers
    return PRESETS[BENCH_PRESETS[preset]]["num_hidden_layers"]
