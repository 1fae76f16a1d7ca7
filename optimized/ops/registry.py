"""Registers the portable kernels under torch_npu's exact schemas (namespace `npu`).

On an NPU host torch_npu owns `torch.ops.npu.*` and nothing is registered here; everywhere else each
family module (routing, gmm, norm, ...) calls `register(...)` at import time. Either way the portable
kernel stays reachable through `portable_kernel(name)`, so NPU-marked tests can compare the real kernel
with it.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Callable

import torch

from ..platform import torch_npu_available
from .schemas import SCHEMAS

NAMESPACE = "npu"
PORTABLE_KERNELS: dict[str, Callable] = {}
# qualname -> the kernel's body as tensor operations a compiler can trace: no host read of tensor data, so the
# compiled decode step may inline it and fuse it with its neighbours (see `inline_in_inductor`).
TRACEABLE_KERNELS: dict[str, Callable] = {}
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


def register(
    qualname: str, kernel: Callable, fake: Callable, tags: tuple = (), traceable: Callable | None = None
) -> None:
    """Define `npu::<qualname>` with its torch_npu schema, the portable kernel and the fake kernel.

    Idempotent: a schema that already exists (torch_npu loaded, or this module imported twice) is left
    alone. The kernel is registered as CompositeExplicitAutograd, so it serves CPU and CUDA tensors alike.
    tags: torch.Tag values of the schema (`torch.Tag.inplace` tells torch.compile an op mutates and returns its
    first argument, so it is functionalized and then re-inplaced instead of copied).
    traceable: the kernel's semantics as tensor operations with no host read of tensor data (the kernel itself
    when it has none), which inductor may inline in a compiled graph instead of calling the opaque operator; it may
    return NotImplemented for calls it does not cover, which then stay the operator.
    """
    if qualname not in SCHEMAS:
        raise KeyError(f"no torch_npu schema for {qualname!r}; known: {sorted(SCHEMAS)}")
    PORTABLE_KERNELS[qualname] = kernel
    if traceable is not None:
        TRACEABLE_KERNELS[qualname] = traceable
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


@functools.cache
def kernels_source_hash() -> str:
    """A hash of the portable kernels' source (every module of this package): what the traced bodies a compiled graph
    inlines are made of. Inductor's caches key on the traced graph, not on a decomposition's code, so graph mode adds
    this to their key and to the compile cache's: a changed kernel recompiles instead of reusing stale code."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _opaque_when_batch_invariant(body: Callable) -> Callable:
    """`body` as inductor's decomposition, except in batch-invariant mode (read when a graph is traced): there the
    operator stays opaque and runs its eager kernel, whose row reductions do not depend on the batch size (inductor
    generates its own reduction loops per decode bucket)."""
    from . import batch_invariant

    @functools.wraps(body)
    def traced(*args, **kwargs):
        return NotImplemented if batch_invariant.enabled() else body(*args, **kwargs)

    return traced


def inline_in_inductor() -> list[str]:
    """Give inductor the traceable portable kernels as decompositions of their operators; returns their names.

    In eager mode every portable kernel is an opaque operator: a Python body run call by call. Compiled by
    inductor, an operator with a decomposition is traced through instead, so its elementwise work fuses with
    its neighbours and its Python runs once, at compile time, not at every decode step. Only inductor's table
    is touched: eager calls, other backends and the recorded operator calls still see the operators. On an NPU
    host torch_npu owns the operators (its fused kernels are the point of the graph) and nothing is inlined.
    Idempotent.
    """
    if torch_npu_available():
        return []
    from torch._inductor.decomposition import decompositions, register_decomposition
    from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
    from torch._library.utils import get_layout_constraint_tag

    for qualname, body in TRACEABLE_KERNELS.items():
        name, _, overload = qualname.partition(".")
        op = getattr(getattr(torch.ops, NAMESPACE), name)
        op = getattr(op, overload or "default")
        if op not in decompositions:
            register_decomposition(op)(_opaque_when_batch_invariant(body))
        if op not in lowerings:
            # A call the body returns NotImplemented for stays the operator: inductor calls it as a fallback kernel
            # (with the layout rule it gives any custom operator), which it refuses to create itself for an operator
            # that also has a decomposition.
            constraint = tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
            make_fallback(op, layout_constraint=constraint, warn=False, override_decomp=True)
    return sorted(TRACEABLE_KERNELS)
