"""CPU bf16 linear on oneDNN's prepacked weight layout: `cpu_gemm.linear(x, weight)` == F.linear(x, weight).

`linear(x, weight)` (and `grouped_linear` for the experts) returns F.linear's result bit for bit: the same products
and fp32 accumulation with one bf16 rounding, read from a packed copy of the weight in oneDNN's own order instead of
the plain [N, K] layout oneDNN would reorder inside every call (equivalence/ops/test_ops_cpu_gemm.py). Anything else
(another device, fp32, autograd, an inference-mode weight without a version counter) is plain F.linear.

Invariants: the packed copy is made lazily once per weight and keyed by the weight's memory, shape, strides, owner
and version counter, so a weight rewritten in place or freed and its memory reused is packed again, never read
stale. Traced by torch.compile, `linear` is the opaque operator `qwen3_moe_cpu::linear` (inductor cannot take
oneDNN's packed tensors as graph inputs), so a compiled step calls the same kernel as eager.
QWEN3_MOE_CPU_PREPACK=0 (read once at import) turns the path off. Why and how fast: docs/devices.md.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from optimized import envs
from optimized.ops import batch_invariant

# (data_ptr, shape, strides) -> (weak reference to the weight's owning tensor, its version when packed, the packed copy)
_PACKED: dict[tuple, tuple] = {}


PREPACK_ENV = envs.CPU_PREPACK  # "0": plain F.linear, no packed copies (half the CPU weight memory)


def _onednn_bf16() -> bool:
    if not envs.cpu_prepack():
        return False
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


ONEDNN_BF16 = _onednn_bf16()


def packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` takes the prepacked path (CPU, bf16 operands, a 2-D weight)."""
    return (
        ONEDNN_BF16
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def _cached(key: tuple, weight: torch.Tensor, make):
    """The `_PACKED` entry `key` made from `weight` by `make()`, made again after an in-place write to `weight`'s
    memory and dropped when the tensor owning that memory is freed."""
    # The reference is to the tensor that owns the memory: a view (an expert's W[g].t()) is a new object per call.
    owner = weight if weight._base is None else weight._base
    hit = _PACKED.get(key)
    if hit is not None and hit[0]() is owner and hit[1] == weight._version:
        return hit[2]
    value = make()

    def forget(ref, key=key):
        if _PACKED.get(key, (None,))[0] is ref:
            del _PACKED[key]

    _PACKED[key] = (weakref.ref(owner, forget), weight._version, value)
    return value


def _pack(weight: torch.Tensor) -> torch.Tensor:
    # From [N, K] rows: oneDNN reorders a strided weight (an NZ expert's [K, N] rows, transposed) into a layout its
    # GEMM then re-reorders on every call (tens of times slower); the rows give the ND build's packing.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)  # 1: the decode batch-size hint


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of `weight` [N, K], made on first use and again after any in-place write."""
    return _cached((weight.data_ptr(), tuple(weight.shape), weight.stride()), weight, lambda: _pack(weight))


def packed_groups(weight: torch.Tensor) -> list:
    """The packed copies of a 3-D weight's groups ([G, K, N], each group a transposed view of [N, K] rows), one slot
    per group, packed when the group is first read. A decode step's grouped matmul visits tens of experts: one cache
    lookup per call instead of a view, a key and a lookup per expert (about 40 us each at batch 8)."""
    return _cached(
        ("groups", weight.data_ptr(), tuple(weight.shape), weight.stride()), weight, lambda: [None] * weight.shape[0]
    )


def wants_k_major(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `x @ weight[g]` (a 16-bit [G, K, N] weight on the CPU, no oneDNN packing) reads a weight whose K is
    not contiguous: the CPU's fallback GEMM is several times slower on it than on K-contiguous rows."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 3
        and weight.stride(-2) != 1
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def k_major(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [..., K, N] with the same values, read from a copy whose K is contiguous (a transposed view of
    [..., N, K] rows), made on first use and again after an in-place write to `weight`."""
    key = ("k_major", weight.data_ptr(), tuple(weight.shape), weight.stride())
    return _cached(key, weight, lambda: weight.detach().transpose(-1, -2).contiguous().transpose(-1, -2))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """Rows x[ends[g-1]:ends[g]] times group g of `weight` [G, K, N] (logical [K, N] per group), concatenated; rows
    past ends[-1] are 0. Each group is `linear(rows, weight[g].t())` bit for bit (the same packed kernel); callers
    check `packable(x, weight[0])` and that the weight is not an inference tensor."""
    packs = packed_groups(weight)
    pieces, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            packed = packs[g]
            if packed is None:
                packed = packs[g] = _pack(weight[g].t())
            pieces.append(torch.ops.mkldnn._linear_pointwise(x[start:end], packed, None, "none", [None], ""))
        start = end
    if start < x.shape[0] or not pieces:
        pieces.append(x.new_zeros(x.shape[0] - start, weight.shape[-1]))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _linear_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if weight.is_inference():  # no version counter to tell a rewritten weight: not cached
        return F.linear(x, weight)
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(rows, packed_weight(weight), None, "none", [None], "")
    return y.view(*x.shape[:-1], weight.shape[0])


def _linear_fake(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# A plain library definition (not torch.library.custom_op, whose Python wrapper costs tens of microseconds a call):
# the compiled step calls it through the dispatcher; eager calls the kernel directly.
_lib = torch.library.Library("qwen3_moe_cpu", "DEF")
_lib.define("linear(Tensor x, Tensor weight) -> Tensor")
_lib.impl("linear", _linear_kernel, "CPU")
torch.library.register_fake("qwen3_moe_cpu::linear", _linear_fake, lib=_lib)


def _one_row(row: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _linear_kernel(row, weight) if packable(row, weight) else F.linear(row, weight)


batch_invariant.use_row_linear(_one_row)  # batch-invariant mode's row-by-row linear runs the prepacked kernel


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x weight^T, F.linear's result bit for bit; prepacked on CPU bf16 (see the module docstring)."""
    if batch_invariant.enabled() and x.device.type == "cpu" and x.numel() > 0:
        return batch_invariant.linear(x, weight)  # row by row: no row depends on the others' count
    if packable(x, weight) and x.shape[-1] == weight.shape[1] and x.numel() > 0:
        if torch.compiler.is_compiling():  # traced: the operator, opaque to the compiler
            return torch.ops.qwen3_moe_cpu.linear(x, weight)
        return _linear_kernel(x, weight)
    return F.linear(x, weight)
