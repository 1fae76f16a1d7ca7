"""Rotary position embedding: `npu_apply_rotary_pos_emb` (spec §4).

The NPU kernel overwrites query/key in place despite its non-aliasing schema; this portable kernel follows
the schema instead: it never mutates its inputs and returns fresh tensors (spec §10.4). Only the returned
values are meaningful on every backend.
"""

from __future__ import annotations

import torch

from .registry import register
from .validation import DIMS, check, check_dtype, check_npu_limit, fail, soc_variant, strict_npu_limits, unsupported

OP = "npu_apply_rotary_pos_emb"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_MODES = ("half", "quarter", "interleave")
# layout -> (rank, N axis, B axis or None). op-plugin maps every string other than BNSD/SBND/TND to BSND.
_LAYOUTS = {"TND": (3, 1, None), "BSND": (4, 2, 0), "SBND": (4, 2, 1), "BNSD": (4, 1, 0)}


def _layout(layout: str) -> str:
    # fallback: any string that is not BNSD/SBND/TND ("BSND", "BSH", typos) selects BSND, as op-plugin does.
    return layout if layout in ("BNSD", "SBND", "TND") else "BSND"


# schema: npu_apply_rotary_pos_emb(Tensor query, Tensor key, Tensor cos, Tensor sin, str layout='BSND', str rotary_mode='half') -> (Tensor, Tensor)  # noqa: E501 (the schema string as the spec writes it)
# rounding: bf16 -> fp32 expression, one RNE rounding (the A2/A3 kernel rounds ties away; differs on exact ties
#           only); fp16/fp32 -> native dtype arithmetic, a = rne(x*cos), b = rne(rot(x)*sin), out = rne(a + b).


def _validate(query, key, cos, sin, layout, rotary_mode) -> None:
    check(rotary_mode in _MODES, OP, f"rotary_mode must be one of {_MODES}; got {rotary_mode!r}")
    name = _layout(layout)
    rank, n_axis, b_axis = _LAYOUTS[name]
    tensors = {"query": query, "key": key, "cos": cos, "sin": sin}
    for arg, t in tensors.items():
        check(
            t.dim() == rank,
            OP,
            f"{arg} must have {rank} dims for layout {layout!r} ({name}); got shape {tuple(t.shape)}",
        )
    check_dtype(OP, "query", query, _FLOATS)
    for arg in ("key", "cos", "sin"):
        check(
            tensors[arg].dtype == query.dtype,
            OP,
            f"{arg} has dtype {tensors[arg].dtype}; expected query.dtype={query.dtype}",
        )
    d = query.shape[-1]
    check(key.shape[-1] == d, OP, f"key head dim {key.shape[-1]} != query head dim {d}")
    check(cos.shape == sin.shape, OP, f"sin shape {tuple(sin.shape)} != cos shape {tuple(cos.shape)}")
    if cos.shape[-1] < d:
        unsupported(OP, f"partial rotary (cos/sin head dim {cos.shape[-1]} < query head dim {d})")
    check(cos.shape[-1] == d, OP, f"cos/sin head dim {cos.shape[-1]} must equal query head dim {d}")
    multiple = 4 if rotary_mode == "quarter" else 2
    check(d % multiple == 0, OP, f"head dim D={d} must be a multiple of {multiple} for rotary_mode {rotary_mode!r}")
    check(
        cos.shape[n_axis] == 1,
        OP,
        f"cos/sin N axis (dim {n_axis} in {name}) must be 1; got cos shape {tuple(cos.shape)}",
    )
    for axis in range(rank - 1):
        if axis == n_axis:
            continue
        check(
            key.shape[axis] == query.shape[axis],
            OP,
            f"key dim {axis} is {key.shape[axis]}; expected query's {query.shape[axis]} (layout {name})",
        )
        # Ascend 950 lets cos/sin have batch 1 and broadcast; everything else must match exactly.
        ok = cos.shape[axis] == query.shape[axis] or (axis == b_axis and cos.shape[axis] == 1)
        check(ok, OP, f"cos/sin dim {axis} is {cos.shape[axis]}; expected query's {query.shape[axis]} (layout {name})")
    if strict_npu_limits() and soc_variant() == "a2a3":  # Atlas A2/A3 kernel caps: strict mode only
        check_npu_limit(d in (64, 128), OP, f"head dim D must be 64 or 128 on Atlas A2/A3; got {d}", DIMS)
        check_npu_limit(rotary_mode == "half", OP, f"rotary_mode must be 'half' on Atlas A2/A3; got {rotary_mode!r}")
        check_npu_limit(name in ("BSND", "TND"), OP, f"layout must be BSND or TND on Atlas A2/A3; got {layout!r}")
        check_npu_limit(query.numel() > 0 and key.numel() > 0, OP, "empty query/key not supported on Atlas A2/A3")
        check_npu_limit(
            cos.shape[:-1] == query.shape[:n_axis] + (1,) + query.shape[n_axis + 1 : -1],
            OP,
            "cos/sin batch broadcast is Ascend 950 only",
        )


def _rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "half":  # rot(x) = cat(-x[h:], x[:h])
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    if mode == "quarter":  # rot(x) = cat(-x2, x1, -x4, x3)
        x1, x2, x3, x4 = x.chunk(4, dim=-1)
        return torch.cat((-x2, x1, -x4, x3), dim=-1)
    if mode == "interleave":  # rot(x)[2i] = -x[2i+1], rot(x)[2i+1] = x[2i]
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    fail(OP, f"rotary_mode must be one of {_MODES}; got {mode!r}")


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    if x.dtype == torch.bfloat16:
        xf = x.float()
        out = (xf * cos.float() + _rotate(xf, mode) * sin.float()).to(x.dtype)
    else:
        out = x * cos + _rotate(x, mode) * sin  # PyTorch fp16 ops round each result exactly once (IEEE fp16)
    return out.contiguous()


def npu_apply_rotary_pos_emb(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: str = "BSND",
    rotary_mode: str = "half",
):
    _validate(query, key, cos, sin, layout, rotary_mode)
    # cos/sin have N = 1 at the layout's N axis, so plain broadcasting applies them to every head.
    return _apply(query, cos, sin, rotary_mode), _apply(key, cos, sin, rotary_mode)


def _npu_apply_rotary_pos_emb_fake(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    _validate(query, key, cos, sin, layout, rotary_mode)
    return query.new_empty(query.shape), key.new_empty(key.shape)


register(OP, npu_apply_rotary_pos_emb, _npu_apply_rotary_pos_emb_fake, traceable=npu_apply_rotary_pos_emb)

__all__ = ["npu_apply_rotary_pos_emb"]
