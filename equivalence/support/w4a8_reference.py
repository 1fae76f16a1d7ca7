"""The W4A8 fixture's fake-quantized reference model, and the bf16 reference of the same weights."""

from __future__ import annotations

import functools

import torch

from equivalence.support.parallel_support import reference_model
from fixtures.checkpoints import checkpoint
from reference.fake_quant import load_fake_quant_model


@functools.lru_cache(maxsize=None)
def fake_quant_reference(name: str):
    return load_fake_quant_model(checkpoint(name), torch.bfloat16, router_dtype="float32")


@functools.lru_cache(maxsize=None)
def bf16_reference(name: str):
    return reference_model(name, "bfloat16")
