"""The W4A4 fixture's fake-quantized reference model, with the given Hadamard rotation."""

from __future__ import annotations

import functools

import torch

from fixtures.checkpoints import bf16_checkpoint, rotation_dir
from reference.fake_quant import load_fake_quant_model


@functools.lru_cache(maxsize=None)
def fake_quant_reference(name: str, rotation: str):
    return load_fake_quant_model(bf16_checkpoint(name), torch.bfloat16, "float32", "w4a4", rotation_dir(rotation))
