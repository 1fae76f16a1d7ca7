"""Portable torch_npu operators: importing this package makes every `torch.ops.npu.<op>` callable.

One module per family, each holding the schema's kernel, its validation and its fake kernel together.
"""
from __future__ import annotations

import importlib

from .registry import portable_kernel, register  # noqa: F401

# Families land one by one; a family module that does not exist yet is simply not registered.
_FAMILIES = ("routing", "gmm", "norm", "rotary", "attention", "cache", "quant", "pending")

for _family in _FAMILIES:
    try:
        importlib.import_module(f"{__name__}.{_family}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{_family}":
            raise
