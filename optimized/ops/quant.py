"""Symmetric dynamic quantization: `npu_dynamic_quant` (spec §8).

Returns `(y, scale)` with the DE-quantization scale: `x ≈ f32(y) * scale`.
"""

from __future__ import annotations

import torch

from .registry import register
from .validation import check, check_dtype, check_npu_limit, fail, unsupported

OP = "npu_dynamic_quant"
_INPUT_DTYPES = (torch.float16, torch.bfloat16)
_MODES = ("pertoken", "pertensor", "perchannel")

# dst_type code -> (name, DTYPE_MAX). An explicit table (spec §0): int8, quint4x2 (packed into int32),
# float8_e5m2 / float8_e4m3fn and torch_npu's private aliases 291/292. hifloat8 (290) has no rounding rule
# a PyTorch golden can reproduce and is rejected as unsupported.
_INT8, _INT4, _E5M2, _E4M3 = 1, 16, 23, 24
_DST = {
    _INT8: ("int8", 127.0),
    _INT4: ("quint4x2", 7.0),
    _E5M2: ("float8_e5m2", 57344.0),
    _E4M3: ("float8_e4m3fn", 448.0),
}
_ALIASES = {291: _E5M2, 292: _E4M3}
_TORCH_DTYPE_CODES = {torch.int8: _INT8, torch.quint4x2: _INT4, torch.float8_e5m2: _E5M2, torch.float8_e4m3fn: _E4M3}
_FP8 = {_E5M2: torch.float8_e5m2, _E4M3: torch.float8_e4m3fn}


def _dst_code(dst_type) -> int:
    """None -> int8; accepts the int code the dispatcher passes or a torch.dtype (direct python calls)."""
    if dst_type is None:
        return _INT8
    if isinstance(dst_type, torch.dtype):
        if dst_type not in _TORCH_DTYPE_CODES:
            fail(OP, f"dst_type={dst_type} not supported; allowed: {sorted(map(str, _TORCH_DTYPE_CODES))}")
        return _TORCH_DTYPE_CODES[dst_type]
    code = _ALIASES.get(int(dst_type), int(dst_type))
    if code == 290:
        unsupported(OP, "dst_type=290 (hifloat8)")
    if code not in _DST:
        fail(
            OP,
            f"dst_type={dst_type} not supported; allowed codes: 1 (int8), 16 (quint4x2), 23/291 "
            f"(float8_e5m2), 24/292 (float8_e4m3fn)",
        )
    return code


# schema: npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, int? dst_type=None, str quant_mode="pertoken", float dst_type_max=0.0) -> (Tensor, Tensor)  # noqa: E501 (the schema string as the spec writes it)
# rounding: scale = amax * f32(1/DTYPE_MAX); q = xf / scale (fp32 division); int8/int4: round half to even, then
#           saturate; fp8: clamp to [-DTYPE_MAX, DTYPE_MAX] BEFORE the RNE cast (a bare PyTorch cast may overflow
#           to inf/NaN, and fp32->int8 wraps), because the NPU saturates.
# zero rows: amax == 0 -> y = 0 and scale = 0 (the NPU divides 0/0 there; spec §10.17).
# packing (quint4x2): int32 words, last dim H/8; element j of a word sits in bits [4j, 4j+4) (element 2k in
#           the low nibble of byte k, little-endian), two's complement nibbles.


def _validate(input, smooth_scales, group_index, dst_type, quant_mode, dst_type_max) -> int:
    check_dtype(OP, "input", input, _INPUT_DTYPES)
    check(
        2 <= input.dim() <= 8,
        OP,
        f"input must have 2 to 8 dims (Input shape dim should be greater than 1); got shape {tuple(input.shape)}",
    )
    check(quant_mode in _MODES, OP, f"quant_mode must be one of {_MODES}; got {quant_mode!r}")
    if dst_type_max != 0.0:
        unsupported(OP, f"dst_type_max={dst_type_max} (only meaningful for hifloat8)")
    code = _dst_code(dst_type)
    h = input.shape[-1]
    if code == _INT4:
        check(h % 8 == 0, OP, f"dst_type quint4x2 needs input.shape[-1] % 8 == 0; got {h}")
    if group_index is not None:
        check(quant_mode == "pertoken", OP, f"group_index needs quant_mode 'pertoken'; got {quant_mode!r}")
        check(smooth_scales is not None, OP, "group_index needs smooth_scales of shape (E, H)")
        check_dtype(OP, "group_index", group_index, (torch.int32, torch.int64))
        check(group_index.dim() == 1, OP, f"group_index must be 1-D (E,); got shape {tuple(group_index.shape)}")
        e = group_index.shape[0]
        check(
            tuple(smooth_scales.shape) == (e, h),
            OP,
            f"smooth_scales has shape {tuple(smooth_scales.shape)}; expected (E, H) = {(e, h)} with group_index",
        )
        check_npu_limit(e <= 1024, OP, f"group_index has E={e} groups; at most 1024")
    elif smooth_scales is not None:
        expected = (input.shape[-2],) if quant_mode == "perchannel" else (h,)
        check(
            tuple(smooth_scales.shape) == expected,
            OP,
            f"smooth_scales has shape {tuple(smooth_scales.shape)}; expected {expected} for {quant_mode}",
        )
    if smooth_scales is not None:
        check(
            smooth_scales.dtype == input.dtype,
            OP,
            f"smooth_scales has dtype {smooth_scales.dtype}; expected input.dtype={input.dtype}",
        )
    return code


def _out_meta(input: torch.Tensor, code: int, quant_mode: str):
    shape = tuple(input.shape)
    if code == _INT4:
        y = (shape[:-1] + (shape[-1] // 8,), torch.int32)
    else:
        y = (shape, torch.int8 if code == _INT8 else _FP8[code])
    scale = {"pertoken": shape[:-1], "pertensor": (1,), "perchannel": shape[:-2] + shape[-1:]}[quant_mode]
    return y, scale


def _smooth(xf: torch.Tensor, smooth_scales, group_index, quant_mode) -> torch.Tensor:
    if smooth_scales is None:
        return xf
    s = smooth_scales.float()
    if group_index is not None:
        rows = xf.reshape(-1, xf.shape[-1])
        gi = group_index.to(torch.int64)
        n = rows.shape[0]
        if gi.numel() == 0 or bool((gi[1:] < gi[:-1]).any()) or bool(gi[0] < 0) or int(gi[-1]) != n:
            fail(OP, f"group_index must be non-decreasing, start >= 0 and end at the row count {n}; got {gi.tolist()}")
        # row r belongs to group e with group_index[e-1] <= r < group_index[e]
        group = torch.searchsorted(gi, torch.arange(n, device=gi.device), right=True)
        return (rows * s[group]).reshape(xf.shape)
    if quant_mode == "perchannel":
        return xf * s.unsqueeze(-1)  # smooth scales run along axis -2
    return xf * s


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    nib = (q.to(torch.int64) & 0xF).reshape(q.shape[:-1] + (q.shape[-1] // 8, 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    word = (nib << shifts).sum(-1)  # disjoint nibbles: sum == OR; unsigned 32-bit value in int64
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # reinterpret as two's complement


def npu_dynamic_quant(
    input: torch.Tensor,
    *,
    smooth_scales: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    dst_type: int | None = None,
    quant_mode: str = "pertoken",
    dst_type_max: float = 0.0,
):
    code = _validate(input, smooth_scales, group_index, dst_type, quant_mode, dst_type_max)
    _, dmax = _DST[code]
    xf = _smooth(input.float(), smooth_scales, group_index, quant_mode)
    if quant_mode == "pertoken":
        amax = xf.abs().amax(dim=-1, keepdim=True)
    elif quant_mode == "pertensor":
        amax = xf.abs().amax().reshape((1,) * xf.dim()) if xf.numel() else xf.new_zeros((1,) * xf.dim())
    else:
        amax = xf.abs().amax(dim=-2, keepdim=True)
    inv = torch.tensor(1.0 / dmax, dtype=torch.float32).item()  # f32(1/DTYPE_MAX), exact as a python float
    scale = amax * inv
    q = torch.where(scale > 0, xf / scale, torch.zeros_like(xf))
    if code in _FP8:
        y = q.clamp(-dmax, dmax).to(_FP8[code])
    else:
        r = torch.round(q)  # round half to even
        y = r.clamp(-128, 127).to(torch.int8) if code == _INT8 else _pack_int4(r.clamp(-8, 7))
    if quant_mode == "pertoken":
        scale = scale.squeeze(-1)
    elif quant_mode == "pertensor":
        scale = scale.reshape(1)
    else:
        scale = scale.squeeze(-2)
    return y.contiguous(), scale.contiguous()


def _npu_dynamic_quant_fake(
    input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken", dst_type_max=0.0
):
    code = _validate(input, smooth_scales, group_index, dst_type, quant_mode, dst_type_max)
    (y_shape, y_dtype), scale_shape = _out_meta(input, code, quant_mode)
    return input.new_empty(y_shape, dtype=y_dtype), input.new_empty(scale_shape, dtype=torch.float32)


register(OP, npu_dynamic_quant, _npu_dynamic_quant_fake)

__all__ = ["npu_dynamic_quant"]
