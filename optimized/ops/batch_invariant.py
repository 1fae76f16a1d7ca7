"""Batch-invariant mode (model_config.batch_invariant): every GEMM computes each row as a GEMM of one row.

A CPU GEMM picks its kernel, blocking and reduction split from the number of rows M (MKL's fp32 path most of all), so
a token's output row depends, in its last bits, on how many other tokens share the call: a request's logits then
depend on what it was batched with. In this mode the linears (`cpu_gemm.linear`) and the experts' grouped matmul
(`gmm`) compute row by row, each row copied to a fresh (64-byte aligned) [1, K] buffer, so every row goes through
the same kernel call whatever M is. Attention is per request already (ops/attention.py), norms, softmax, top-k and
sampling reduce within a row. The mode is entered around each engine step (executor/engine.py) and read when a
decode graph is traced, so a compiled graph holds the row-wise operator. See docs/config.md, batch_invariant.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

_enabled = False


def enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def mode(on: bool):
    """Batch-invariant computation on (or off) inside the block; the previous setting after it."""
    global _enabled
    before, _enabled = _enabled, bool(on)
    try:
        yield
    finally:
        _enabled = before


def sum_last(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1, keepdim=True); in this mode a left-to-right sum of elementwise adds, which a compiled graph keeps in
    that order (inductor vectorizes a reduction its own way per batch size: the MoE top-k weights' sum of a decode
    batch of one differed in the last bit from eager's)."""
    if not _enabled:
        return x.sum(dim=-1, keepdim=True)
    total = x[..., :1]
    for i in range(1, x.shape[-1]):
        total = total + x[..., i : i + 1]
    return total


def by_row(fn, a: torch.Tensor, *args) -> torch.Tensor:
    """fn(row, *args) for each row of the 2-D `a`, each row a fresh [1, K] copy, stacked into [M, N]."""
    if a.shape[0] == 0:
        return fn(a, *args)
    return torch.cat([fn(a[i : i + 1].clone(), *args) for i in range(a.shape[0])])


# One row's linear: F.linear, or the prepacked CPU kernel that cpu_gemm installs (its result bit for bit, faster).
_row_linear = F.linear


def use_row_linear(fn) -> None:
    global _row_linear
    _row_linear = fn


def _linear_rows_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return by_row(_row_linear, rows, weight).view(*x.shape[:-1], weight.shape[0])


def _linear_rows_fake(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# An operator, so that a compiled decode graph calls this kernel as eager does (inductor would otherwise see plain
# matmuls of one row and could place or fuse their buffers its own way).
_lib = torch.library.Library("qwen3_moe_invariant", "DEF")
_lib.define("linear_rows(Tensor x, Tensor weight) -> Tensor")
_lib.impl("linear_rows", _linear_rows_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("qwen3_moe_invariant::linear_rows", _linear_rows_fake, lib=_lib)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x weight^T computed row by row (F.linear's per-row result for a batch of one)."""
    return torch.ops.qwen3_moe_invariant.linear_rows(x, weight)
