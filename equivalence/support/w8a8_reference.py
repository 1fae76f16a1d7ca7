"""The W8A8 (and its variants') fixture's fake-quantized reference model."""

from __future__ import annotations

import functools

import torch

from fixtures.checkpoints import checkpoint
from reference.fake_quant import load_fake_quant_model


@functools.lru_cache(maxsize=None)
def fake_quant_reference(name: str, scheme: str = "w8a8"):
    return load_fake_quant_model(checkpoint(name), torch.bfloat16, router_dtype="float32", scheme=scheme)
