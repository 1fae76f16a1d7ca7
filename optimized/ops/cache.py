"""Paged KV-cache writes: `npu_scatter_nd_update` and `npu_scatter_nd_update_` (spec §7).

Pure data movement, bit-exact for every dtype (fp8, bool and ints included): `self` and `updates` are
bit-cast to a same-width integer dtype with `.view(dtype)` (which keeps `self`'s storage) before the write.
"""

from __future__ import annotations

import torch

from ..platform import torch_npu_available
from .registry import register
from .validation import check, check_dtype, check_shape, unsupported

_INDEX_DTYPES = (torch.int32, torch.int64)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _validate(op: str, self: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> None:
    check(1 <= self.dim() <= 8, op, f"self must have 1 to 8 dims; got shape {tuple(self.shape)}")
    check_dtype(op, "indices", indices, _INDEX_DTYPES)
    check(indices.dim() >= 2, op, f"indices must have at least 2 dims; got shape {tuple(indices.shape)}")
    a = indices.shape[-1]
    check(1 <= a <= self.dim(), op, f"indices.shape[-1] (index depth) must be in [1, self.dim()={self.dim()}]; got {a}")
    check(updates.dtype == self.dtype, op, f"updates has dtype {updates.dtype}; expected self.dtype={self.dtype}")
    check_shape(op, "updates", updates, tuple(indices.shape[:-1]) + tuple(self.shape[a:]))
    if self.element_size() not in _BITS:
        unsupported(op, f"self dtype {self.dtype} (element size {self.element_size()})")


def _check_range(op: str, self: torch.Tensor, idx: torch.Tensor) -> None:
    """Every tuple within [0, self.shape[d]); IndexError names the first bad tuple (NPU has no negative indices)."""
    a = idx.shape[-1]
    if idx.shape[0] == 0:
        return
    low, high = torch.aminmax(idx, dim=0)  # one pass and one host read when every tuple is in range
    if min(low.tolist()) >= 0 and all(h < n for h, n in zip(high.tolist(), self.shape)):
        return
    limits = torch.tensor(self.shape[:a], dtype=torch.int64, device=idx.device)
    bad = ((idx < 0) | (idx >= limits)).any(dim=-1)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise IndexError(
            f"{op}: indices tuple {tuple(int(v) for v in idx[first])} (at flat position {first} of "
            f"indices.shape[:-1]={tuple(bad.shape)}) is out of range for self shape "
            f"{tuple(self.shape)}; each index d must satisfy 0 <= index < self.shape[d]"
        )


def _scatter_into(op: str, target: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> None:
    """Write `updates` into `target` (mutated) at the tuples of `indices`; duplicates: last occurrence wins."""
    a = indices.shape[-1]
    idx = indices.reshape(-1, a).to(torch.int64)
    _check_range(op, target, idx)
    upd = updates.reshape((idx.shape[0],) + tuple(target.shape[a:]))
    bits = _BITS[target.element_size()]
    target_bits = target.view(bits)  # same storage: the write lands in `target`
    if idx.shape[0] == 1:  # one tuple (a decode step's token): no duplicates to resolve
        target_bits.index_put_(tuple(idx.unbind(-1)), upd.view(bits))
        return
    # duplicates: keep only the LAST occurrence of each tuple (stable sort of the linear slot index), so the
    # write below has unique indices and is deterministic.
    lin = torch.zeros(idx.shape[0], dtype=torch.int64, device=idx.device)
    for d in range(a):  # loop over index depth (<= 8), not over tokens
        lin = lin * target.shape[d] + idx[:, d]
    sorted_lin, perm = torch.sort(lin, stable=True)
    is_last = torch.ones_like(sorted_lin, dtype=torch.bool)
    is_last[:-1] = sorted_lin[1:] != sorted_lin[:-1]
    keep = perm[is_last]
    target_bits.index_put_(tuple(idx[keep].unbind(-1)), upd[keep].view(bits))


# --- npu_scatter_nd_update ----------------------------------------------------------------------------
# schema: npu_scatter_nd_update(Tensor self, Tensor indices, Tensor updates) -> Tensor
# duplicates: the last occurrence of a repeated index tuple wins (spec §10.15; NPU leaves it unspecified).


def npu_scatter_nd_update(self: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    op = "npu_scatter_nd_update"
    _validate(op, self, indices, updates)
    out = self.clone(memory_format=torch.contiguous_format)
    _scatter_into(op, out, indices, updates)
    return out


def _npu_scatter_nd_update_fake(self, indices, updates):
    _validate("npu_scatter_nd_update", self, indices, updates)
    return self.new_empty(self.shape)


register("npu_scatter_nd_update", npu_scatter_nd_update, _npu_scatter_nd_update_fake)


# --- npu_scatter_nd_update_ ---------------------------------------------------------------------------
# schema: npu_scatter_nd_update_(Tensor(a!) self, Tensor indices, Tensor updates) -> Tensor(a!)
# duplicates: last occurrence wins, as in the functional variant; self is mutated and returned.


def npu_scatter_nd_update_(self: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    op = "npu_scatter_nd_update_"
    _validate(op, self, indices, updates)
    _scatter_into(op, self, indices, updates)
    return self


def _npu_scatter_nd_update__fake(self, indices, updates):
    _validate("npu_scatter_nd_update_", self, indices, updates)
    return self


# torch.Tag.inplace: torch.compile auto-functionalizes the op (it mutates and returns `self`) and inductor re-inplaces
# it, so a compiled step writes its tokens' slots in the cache itself: no copy of the cache, cost flat in the pool.
register("npu_scatter_nd_update_", npu_scatter_nd_update_, _npu_scatter_nd_update__fake, tags=(torch.Tag.inplace,))


# Older torch refuses to auto-functionalize an op whose output aliases an input, inplace tag or not. There a
# Functionalize kernel rewrites the call as the functional op plus a write-back into `self` (correct, but the
# compiled step then copies the cache). Registered only where this package defined the schema.
def _npu_scatter_nd_update__functionalize(self, indices, updates):
    from torch._subclasses.functional_tensor import CppFunctionalizeAPI

    api = CppFunctionalizeAPI()
    self_, indices_, updates_ = api.unwrap_tensors((self, indices, updates))
    with api.redispatch_to_next():
        out = torch.ops.npu.npu_scatter_nd_update(self_, indices_, updates_)
    api.replace(self, out)
    api.commit_update(self)
    api.sync(self)
    return self


def auto_functionalized_in_place() -> bool:
    """Whether torch.compile functionalizes npu_scatter_nd_update_ as an in-place op (re-inplaced by inductor)."""
    from torch._higher_order_ops.auto_functionalize import can_auto_functionalize

    return can_auto_functionalize(torch.ops.npu.npu_scatter_nd_update_.default)


_FUNCTIONALIZE_LIB: torch.library.Library | None = None
if (
    not torch_npu_available()
    and not auto_functionalized_in_place()
    and not torch._C._dispatch_has_kernel_for_dispatch_key("npu::npu_scatter_nd_update_", "Functionalize")
):
    _FUNCTIONALIZE_LIB = torch.library.Library("npu", "FRAGMENT")
    _FUNCTIONALIZE_LIB.impl("npu_scatter_nd_update_", _npu_scatter_nd_update__functionalize, "Functionalize")

__all__ = ["npu_scatter_nd_update", "npu_scatter_nd_update_"]
