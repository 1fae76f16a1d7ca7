"""Registers the portable kernels under torch_npu's exact schemas (namespace `npu`).

On an NPU host torch_npu owns `torch.ops.npu.*` and nothing is registered here; everywhere else each
family module (routing, gmm, norm, ...) calls `register(...)` at import time. Either way the portable
kernel stays reachable through `portable_kernel(name)`, so NPU-marked tests can compare the real kernel
with it.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..platform import torch_npu_available
from .schemas import SCHEMAS

NAMESPACE = "npu"
PORTABLE_KERNELS: dict[str, Callable] = {}
_library: torch.library.Library | None = None


def _lib() -> torch.library.Library:
    global _library
    if _library is None:
        _library = torch.library.Library(NAMESPACE, "FRAGMENT")
    return _library


def is_defined(qualname: str) -> bool:
    """Whether `npu::<qualname>` (overload included, e.g. `npu_grouped_matmul.List`) has a schema."""
    name, _, overload = qualname.partition(".")
    try:
        torch._C._dispatch_find_schema_or_throw(f"{NAMESPACE}::{name}", overload)
    except RuntimeError:
        return False
    return True


def register(qualname: str, kernel: Callable, fake: Callable, tags: tuple = ()) -> None:
    """Define `npu::<qualname>` with its torch_npu schema, the portable kernel and the fake kernel.

    Idempotent: a schema that already exists (torch_npu loaded, or this module imported twice) is left
    alone. The kernel is registered as CompositeExplicitAutograd, so it serves CPU and CUDA tensors alike.
    tags: torch.Tag values of the schema (`torch.Tag.inplace` tells torch.compile an op mutates and returns its
    first argument, so it is functionalized and then re-inplaced instead of copied).
    """
    if qualname not in SCHEMAS:
        raise KeyError(f"no torch_npu schema for {qualname!r}; known: {sorted(SCHEMAS)}")
    PORTABLE_KERNELS[qualname] = kernel
    if torch_npu_available() or is_defined(qualname):
        return
    lib = _lib()
    lib.define(SCHEMAS[qualname], tags=tags)
    lib.impl(qualname, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{qualname}", fake, lib=lib)


def portable_kernel(qualname: str) -> Callable:
    """The portable kernel of an operator, callable directly (bypassing the dispatcher)."""
    try:
        return PORTABLE_KERNELS[qualname]
    except KeyError:
        raise KeyError(f"no portable kernel registered for {qualname!r}; have {sorted(PORTABLE_KERNELS)}") from None
