"""MX quantization operators (spec mx_quant.md §6): quantize, decode, fused norm / SwiGLU + quantize, and the
MX mode of `npu_quant_matmul`. The bit-level rules live in `mx_format.py`; this module holds the schemas'
argument handling, validation (§3.4) and fake kernels. The MX grouped matmul is in `gmm.py`.

    y, s = npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn)          # x [..., K] -> s [..., ceil(K/64), 2]
    out = npu_quant_matmul(y, w_t, w_s, pertoken_scale=s, scale_dtype=293, pertoken_scale_dtype=293,
                           output_dtype=torch.bfloat16, group_sizes=[1, 1, 32])
"""

from __future__ import annotations

import math

import torch

from . import mx_format as mxf
from .formats import check_nz_read, nz_operand
from .norm import _check_norm_shapes, _rstd, _rstd_shape
from .registry import register
from .validation import check, check_dtype, check_npu_limit, fail, unsupported

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DST_HELP = "23/291 (float8_e5m2), 24/292 (float8_e4m3fn), 296 (float4_e2m1fn_x2)"


def _format(op: str, arg: str, dst_type) -> mxf.MxFormat:
    code = mxf.dtype_code(dst_type)
    if code == mxf.float4_e1m2fn_x2:
        unsupported(op, f"{arg}=297 (float4_e1m2fn_x2)")
    if code not in mxf.FORMATS:
        fail(op, f"{arg}={dst_type} is not an MX element type; allowed codes: {_DST_HELP}")
    return mxf.FORMATS[code]


def _check_scale_alg_round_mode(
    op: str, fmt: mxf.MxFormat, scale_alg: int, round_mode: str, algs_fp8=(0, 1), algs_fp4=(0, 2)
) -> None:
    """The validation matrix of §3.4."""
    algs = algs_fp4 if fmt.packed else algs_fp8
    check(
        scale_alg in algs,
        op,
        f"scale_alg={scale_alg} is not allowed with dst_type {fmt.name}; allowed: {', '.join(map(str, algs))}",
    )
    modes = mxf.FP4_ROUND_MODES if fmt.packed else ("rint",)
    check(
        round_mode in modes,
        op,
        f"round_mode={round_mode!r} is not allowed with dst_type {fmt.name}; allowed: {', '.join(map(repr, modes))}",
    )


def _check_fp4_last_dim(op: str, arg: str, shape, fmt: mxf.MxFormat) -> None:
    if fmt.packed:
        check(
            len(shape) >= 1 and shape[-1] % 2 == 0,
            op,
            f"{arg} has shape {tuple(shape)}; FP4 output packs pairs along the last dim, which must be even",
        )


def _scale_shape(shape, axis: int, block_size: int = mxf.BLOCK_SIZE) -> tuple:
    """§2.2: the quantized axis -> ceil(ceil(D/bs)/2), plus a trailing pair dim."""
    shape = list(shape)
    shape[axis] = math.ceil(math.ceil(shape[axis] / block_size) / 2)
    return tuple(shape) + (2,)


def _y_meta(shape, fmt: mxf.MxFormat):
    shape = tuple(shape)
    if fmt.packed:
        return shape[:-1] + (shape[-1] // 2,), torch.uint8
    return shape, fmt.torch_dtype


# ---------------------------------------------------------------------------------------------------
# npu_dynamic_mx_quant(Tensor input, *, int axis=-1, str round_mode="rint", int dst_type=296, int block_size=32,
#                      int? scale_alg=0, float dst_type_max=0.0, float max_low_bound=0.0) -> (Tensor, Tensor)
# ---------------------------------------------------------------------------------------------------
OP_QUANT = "npu_dynamic_mx_quant"


def _validate_quant(input, axis, round_mode, dst_type, block_size, scale_alg, dst_type_max, max_low_bound):
    op = OP_QUANT
    check_dtype(op, "input", input, _INPUT_DTYPES)
    check(1 <= input.dim() <= 7, op, f"input must have 1 to 7 dims; got shape {tuple(input.shape)}")
    check(
        -input.dim() <= axis < input.dim(),
        op,
        f"axis={axis} is out of range for input of shape {tuple(input.shape)} (allowed [{-input.dim()}, "
        f"{input.dim() - 1}])",
    )
    fmt = _format(op, "dst_type", dst_type)
    alg = 0 if scale_alg is None else scale_alg
    _check_scale_alg_round_mode(op, fmt, alg, round_mode)
    check(
        block_size > 0 and block_size % 32 == 0 and block_size <= 1024,
        op,
        f"block_size={block_size}; allowed: a multiple of 32 in [32, 1024]",
    )
    check(
        block_size == 32 or input.dtype != torch.float32,
        op,
        f"block_size={block_size} with a float32 input; allowed: 32",
    )
    check(block_size == 32 or alg != 2, op, f"block_size={block_size} with scale_alg=2; allowed: 32")
    if alg == 2:
        check(
            dst_type_max == 0.0 or 6.0 <= dst_type_max <= 12.0,
            op,
            f"dst_type_max={dst_type_max}; allowed: 0.0 or a value in [6.0, 12.0]",
        )
    else:
        check(
            dst_type_max == 0.0,
            op,
            f"dst_type_max={dst_type_max} with scale_alg={alg}; allowed: 0.0 (only scale_alg=2 uses it)",
        )
    check(max_low_bound >= 0.0, op, f"max_low_bound={max_low_bound}; allowed: >= 0.0")
    check(
        max_low_bound == 0.0 or alg == 1,
        op,
        f"max_low_bound={max_low_bound} with scale_alg={alg}; allowed: 0.0 (only scale_alg=1 uses it)",
    )
    _check_fp4_last_dim(op, "input", input.shape, fmt)
    return fmt, alg


def npu_dynamic_mx_quant(
    input: torch.Tensor,
    *,
    axis: int = -1,
    round_mode: str = "rint",
    dst_type: int = 296,
    block_size: int = 32,
    scale_alg: int | None = 0,
    dst_type_max: float = 0.0,
    max_low_bound: float = 0.0,
):
    fmt, alg = _validate_quant(input, axis, round_mode, dst_type, block_size, scale_alg, dst_type_max, max_low_bound)
    return mxf.mx_quantize(
        input,
        fmt,
        axis=axis,
        round_mode=round_mode,
        scale_alg=alg,
        block_size=block_size,
        dst_type_max=dst_type_max,
        max_low_bound=max_low_bound,
    )


def _npu_dynamic_mx_quant_fake(
    input, *, axis=-1, round_mode="rint", dst_type=296, block_size=32, scale_alg=0, dst_type_max=0.0, max_low_bound=0.0
):
    fmt, _ = _validate_quant(input, axis, round_mode, dst_type, block_size, scale_alg, dst_type_max, max_low_bound)
    y_shape, y_dtype = _y_meta(input.shape, fmt)
    scale_shape = _scale_shape(input.shape, axis % input.dim(), block_size)
    return input.new_empty(y_shape, dtype=y_dtype), input.new_empty(scale_shape, dtype=torch.uint8)


register(OP_QUANT, npu_dynamic_mx_quant, _npu_dynamic_mx_quant_fake)


# ---------------------------------------------------------------------------------------------------
# npu_anti_mx_quant(Tensor x, Tensor mxscale, *, int? axis=-1, int? dst_type=15, int? src_type=292) -> Tensor
# y = decode(x) * 2^(mxscale-127) in fp32 (exact), rounded (RNE) to dst_type; byte 0xFF -> NaN (§6.7).
# None for an optional argument means its schema default.
# ---------------------------------------------------------------------------------------------------
OP_ANTI = "npu_anti_mx_quant"
_OUT_DTYPES = {15: torch.bfloat16, 5: torch.float16, 6: torch.float32}


def mx_output_dtype(op: str, arg: str, value, default: int) -> torch.dtype:
    code = default if value is None else mxf.dtype_code(value)
    check(
        code in _OUT_DTYPES, op, f"{arg}={value} is not allowed; allowed codes: 15 (bfloat16), 5 (float16), 6 (float32)"
    )
    return _OUT_DTYPES[code]


def _validate_anti(x, mxscale, axis, dst_type, src_type):
    op = OP_ANTI
    fmt = _format(op, "src_type", 292 if src_type is None else src_type)
    if fmt.packed:
        check_dtype(op, "x", x, (torch.uint8,))
    else:
        check(x.dtype == fmt.torch_dtype, op, f"x has dtype {x.dtype}; src_type={src_type} needs {fmt.torch_dtype}")
    check(1 <= x.dim() <= 7, op, f"x must have 1 to 7 dims; got shape {tuple(x.shape)}")
    axis = -1 if axis is None else axis
    check(
        -x.dim() <= axis < x.dim(),
        op,
        f"axis={axis} is out of range for x of shape {tuple(x.shape)} (allowed [{-x.dim()}, {x.dim() - 1}])",
    )
    check_dtype(op, "mxscale", mxscale, (torch.uint8, torch.float8_e8m0fnu))
    logical = tuple(x.shape[:-1]) + ((2 * x.shape[-1],) if fmt.packed else tuple(x.shape[-1:]))
    expected = _scale_shape(logical, axis % x.dim())
    check(
        tuple(mxscale.shape) == expected,
        op,
        f"mxscale has shape {tuple(mxscale.shape)}; expected {expected} for x of logical shape {logical} "
        f"quantized along axis {axis}",
    )
    return fmt, axis % x.dim(), logical, mx_output_dtype(op, "dst_type", dst_type, 15)


def npu_anti_mx_quant(
    x: torch.Tensor,
    mxscale: torch.Tensor,
    *,
    axis: int | None = -1,
    dst_type: int | None = 15,
    src_type: int | None = 292,
) -> torch.Tensor:
    fmt, axis, _, out_dtype = _validate_anti(x, mxscale, axis, dst_type, src_type)
    values = mxf.decode_elements(x, fmt).movedim(axis, -1)
    factors = mxf.expand_scales(mxscale.movedim(axis, -2), values.shape[-1])
    return (values * factors).movedim(-1, axis).to(out_dtype).contiguous()


def _npu_anti_mx_quant_fake(x, mxscale, *, axis=-1, dst_type=15, src_type=292):
    _, _, logical, out_dtype = _validate_anti(x, mxscale, axis, dst_type, src_type)
    return x.new_empty(logical, dtype=out_dtype)


register(OP_ANTI, npu_anti_mx_quant, _npu_anti_mx_quant_fake)


# ---------------------------------------------------------------------------------------------------
# npu_rms_norm_dynamic_mx_quant(Tensor x, Tensor gamma, *, Tensor? beta=None, float epsilon=1e-06,
#     int scale_alg=0, str round_mode="rint", int dst_type=296) -> (Tensor, Tensor, Tensor)
# npu_add_rms_norm_dynamic_mx_quant(Tensor x1, Tensor x2, Tensor gamma, *, Tensor? beta=None,
#     float epsilon=1e-06, int scale_alg=0, str round_mode="rint", int dst_type=296) -> (Tensor, Tensor, Tensor, Tensor)
# rounding: t = rne_{x.dtype}(xf * rstd * f32(gamma) (+ f32(beta))), all in fp32, then t is MX-quantized along the
#           last axis exactly as npu_dynamic_mx_quant (block 32). The add variant normalizes the fp32 sum
#           s = f32(x1) + f32(x2) and returns x_out = rne(s) (§6.2, §6.3). rstd: full shape, fp32.
# ---------------------------------------------------------------------------------------------------
OP_RMS = "npu_rms_norm_dynamic_mx_quant"
OP_ADD_RMS = "npu_add_rms_norm_dynamic_mx_quant"
_NORM_DTYPES = (torch.bfloat16, torch.float16)


def _validate_norm(op, x_arg, x, gamma, beta, epsilon, scale_alg, round_mode, dst_type):
    check_dtype(op, x_arg, x, _NORM_DTYPES)
    check(1 <= x.dim() <= 7, op, f"{x_arg} must have 1 to 7 dims; got shape {tuple(x.shape)}")
    check(
        gamma.dtype in (x.dtype, torch.float32),
        op,
        f"gamma has dtype {gamma.dtype}; allowed: {x.dtype} ({x_arg}.dtype), torch.float32",
    )
    _check_norm_shapes(op, x_arg, x, gamma, epsilon)
    if beta is not None:
        check(
            beta.dtype == gamma.dtype and beta.shape == gamma.shape,
            op,
            f"beta is {beta.dtype}{tuple(beta.shape)}; expected gamma's {gamma.dtype}{tuple(gamma.shape)}",
        )
    fmt = _format(op, "dst_type", dst_type)
    _check_scale_alg_round_mode(op, fmt, scale_alg, round_mode, algs_fp4=(0,))
    _check_fp4_last_dim(op, x_arg, x.shape, fmt)
    return fmt


def _norm_quant(s: torch.Tensor, dtype, gamma, beta, epsilon, fmt, scale_alg, round_mode):
    """(y, mxscale, rstd) from the fp32 input s of the norm."""
    rstd = _rstd(s, gamma.dim(), epsilon)
    t = s * rstd * gamma.float()
    if beta is not None:
        t = t + beta.float()
    y, scale = mxf.mx_quantize(t.to(dtype), fmt, round_mode=round_mode, scale_alg=scale_alg)
    return y, scale, rstd.contiguous()


def _norm_fakes(x, gamma, fmt):
    y_shape, y_dtype = _y_meta(x.shape, fmt)
    return (
        x.new_empty(y_shape, dtype=y_dtype),
        x.new_empty(_scale_shape(x.shape, x.dim() - 1), dtype=torch.uint8),
        x.new_empty(_rstd_shape(x, gamma.dim()), dtype=torch.float32),
    )


def npu_rms_norm_dynamic_mx_quant(
    x: torch.Tensor,
    gamma: torch.Tensor,
    *,
    beta: torch.Tensor | None = None,
    epsilon: float = 1e-06,
    scale_alg: int = 0,
    round_mode: str = "rint",
    dst_type: int = 296,
):
    fmt = _validate_norm(OP_RMS, "x", x, gamma, beta, epsilon, scale_alg, round_mode, dst_type)
    return _norm_quant(x.float(), x.dtype, gamma, beta, epsilon, fmt, scale_alg, round_mode)


def _npu_rms_norm_dynamic_mx_quant_fake(
    x, gamma, *, beta=None, epsilon=1e-06, scale_alg=0, round_mode="rint", dst_type=296
):
    fmt = _validate_norm(OP_RMS, "x", x, gamma, beta, epsilon, scale_alg, round_mode, dst_type)
    return _norm_fakes(x, gamma, fmt)


def _validate_add_norm(x1, x2, gamma, beta, epsilon, scale_alg, round_mode, dst_type):
    fmt = _validate_norm(OP_ADD_RMS, "x1", x1, gamma, beta, epsilon, scale_alg, round_mode, dst_type)
    check(
        x2.dtype == x1.dtype and x2.shape == x1.shape,
        OP_ADD_RMS,
        f"x2 is {x2.dtype}{tuple(x2.shape)}; expected x1's {x1.dtype}{tuple(x1.shape)}",
    )
    return fmt


def npu_add_rms_norm_dynamic_mx_quant(
    x1: torch.Tensor,
    x2: torch.Tensor,
    gamma: torch.Tensor,
    *,
    beta: torch.Tensor | None = None,
    epsilon: float = 1e-06,
    scale_alg: int = 0,
    round_mode: str = "rint",
    dst_type: int = 296,
):
    fmt = _validate_add_norm(x1, x2, gamma, beta, epsilon, scale_alg, round_mode, dst_type)
    s = x1.float() + x2.float()
    y, scale, rstd = _norm_quant(s, x1.dtype, gamma, beta, epsilon, fmt, scale_alg, round_mode)
    return y, s.to(x1.dtype).contiguous(), scale, rstd


def _npu_add_rms_norm_dynamic_mx_quant_fake(
    x1, x2, gamma, *, beta=None, epsilon=1e-06, scale_alg=0, round_mode="rint", dst_type=296
):
    fmt = _validate_add_norm(x1, x2, gamma, beta, epsilon, scale_alg, round_mode, dst_type)
    y, scale, rstd = _norm_fakes(x1, gamma, fmt)
    return y, x1.new_empty(x1.shape), scale, rstd


register(OP_RMS, npu_rms_norm_dynamic_mx_quant, _npu_rms_norm_dynamic_mx_quant_fake)
register(OP_ADD_RMS, npu_add_rms_norm_dynamic_mx_quant, _npu_add_rms_norm_dynamic_mx_quant_fake)


# ---------------------------------------------------------------------------------------------------
# npu_swiglu_mx_quant(Tensor x, *, Tensor? group_index=None, int activate_dim=-1, bool activate_left=False,
#     int swiglu_mode=0, float clamp_limit=7.0, float glu_alpha=1.702, float glu_bias=1.0, int group_mode=0,
#     int axis=-1, int dst_type=296, str round_mode="rint", int scale_alg=0, float max_dtype_value=0)
#     -> (Tensor, Tensor)
# rounding: halves L | R along activate_dim; t = rne_{x.dtype}(silu(L) * R) (activate_left) or silu(R) * L,
#           in fp32 with npu_swiglu's expression a * sigmoid(a) * b, then MX-quantized along `axis` (block 32).
# group_index: rows (the dims before the last, flattened) past sum(counts) (group_mode 0) or group_index[-1]
#           (group_mode 1) belong to no group and are written as y 0 and scale byte 0 (§6.4).
# ---------------------------------------------------------------------------------------------------
OP_SWIGLU = "npu_swiglu_mx_quant"


def _validate_swiglu(
    x, group_index, activate_dim, swiglu_mode, group_mode, axis, dst_type, round_mode, scale_alg, max_dtype_value
):
    op = OP_SWIGLU
    check_dtype(op, "x", x, _NORM_DTYPES)
    check(2 <= x.dim() <= 7, op, f"x must have 2 to 7 dims; got shape {tuple(x.shape)}")
    for name, dim in (("activate_dim", activate_dim), ("axis", axis)):
        check(
            -x.dim() <= dim < x.dim(),
            op,
            f"{name}={dim} is out of range for x of shape {tuple(x.shape)} (allowed [{-x.dim()}, {x.dim() - 1}])",
        )
    act, axis = activate_dim % x.dim(), axis % x.dim()
    check(
        x.shape[act] % 2 == 0,
        op,
        f"x has odd size {x.shape[act]} along activate_dim={activate_dim}; it splits into two equal halves",
    )
    if swiglu_mode == 1:
        unsupported(op, "swiglu_mode=1 (clamped, interleaved SwiGLU)")
    check(swiglu_mode == 0, op, f"swiglu_mode={swiglu_mode}; allowed: 0, 1")
    fmt = _format(op, "dst_type", dst_type)
    _check_scale_alg_round_mode(op, fmt, scale_alg, round_mode, algs_fp4=(0,))
    check(
        max_dtype_value == 0,
        op,
        f"max_dtype_value={max_dtype_value}; allowed: 0 (only scale_alg=2 uses it, which this operator does not take)",
    )
    t_shape = list(x.shape)
    t_shape[act] //= 2
    _check_fp4_last_dim(op, "the activation (x with activate_dim halved)", t_shape, fmt)
    if group_index is not None:
        check_dtype(op, "group_index", group_index, (torch.int64,))
        check(
            group_index.dim() == 1 and 1 <= group_index.shape[0] <= 256,
            op,
            f"group_index must be 1-D with 1 to 256 groups; got shape {tuple(group_index.shape)}",
        )
        check(group_mode in (0, 1), op, f"group_mode={group_mode}; allowed: 0 (counts), 1 (cumsum)")
        if act != x.dim() - 1 or axis != x.dim() - 1:
            unsupported(op, f"group_index with activate_dim={activate_dim}, axis={axis} (only the last dim)")
    return fmt, act, axis, t_shape


def _valid_rows(group_index: torch.Tensor, group_mode: int, rows: int) -> int:
    values = group_index.tolist()
    if group_mode == 0:
        check(all(v >= 0 for v in values), OP_SWIGLU, f"group_index (group_mode=0, counts) must be >= 0; got {values}")
        total = sum(values)
    else:
        check(
            all(v >= 0 for v in values) and all(a <= b for a, b in zip(values, values[1:])),
            OP_SWIGLU,
            f"group_index (group_mode=1, cumsum) must be non-negative and non-decreasing; got {values}",
        )
        total = values[-1]
    check(total <= rows, OP_SWIGLU, f"group_index covers {total} rows but x has {rows}")
    return total


def npu_swiglu_mx_quant(
    x: torch.Tensor,
    *,
    group_index: torch.Tensor | None = None,
    activate_dim: int = -1,
    activate_left: bool = False,
    swiglu_mode: int = 0,
    clamp_limit: float = 7.0,
    glu_alpha: float = 1.702,
    glu_bias: float = 1.0,
    group_mode: int = 0,
    axis: int = -1,
    dst_type: int = 296,
    round_mode: str = "rint",
    scale_alg: int = 0,
    max_dtype_value: float = 0,
):
    fmt, act, axis, _ = _validate_swiglu(
        x, group_index, activate_dim, swiglu_mode, group_mode, axis, dst_type, round_mode, scale_alg, max_dtype_value
    )
    left, right = x.float().chunk(2, dim=act)
    a, b = (left, right) if activate_left else (right, left)
    t = (a * torch.sigmoid(a) * b).to(x.dtype)
    y, scale = mxf.mx_quantize(t, fmt, axis=axis, round_mode=round_mode, scale_alg=scale_alg)
    if group_index is not None:
        rows = math.prod(x.shape[:-1])
        valid = _valid_rows(group_index, group_mode, rows)
        # Rows past the groups are zeroed (shapes spelled out: reshape(0, -1) is ambiguous for a rank with no rows).
        y.view(torch.uint8).reshape(rows, y.shape[-1])[valid:] = 0
        scale.reshape(rows, scale.numel() // max(rows, 1))[valid:] = 0
    return y, scale


def _npu_swiglu_mx_quant_fake(
    x,
    *,
    group_index=None,
    activate_dim=-1,
    activate_left=False,
    swiglu_mode=0,
    clamp_limit=7.0,
    glu_alpha=1.702,
    glu_bias=1.0,
    group_mode=0,
    axis=-1,
    dst_type=296,
    round_mode="rint",
    scale_alg=0,
    max_dtype_value=0,
):
    fmt, _, axis, t_shape = _validate_swiglu(
        x, group_index, activate_dim, swiglu_mode, group_mode, axis, dst_type, round_mode, scale_alg, max_dtype_value
    )
    y_shape, y_dtype = _y_meta(t_shape, fmt)
    return x.new_empty(y_shape, dtype=y_dtype), x.new_empty(_scale_shape(t_shape, axis), dtype=torch.uint8)


register(OP_SWIGLU, npu_swiglu_mx_quant, _npu_swiglu_mx_quant_fake)


# ---------------------------------------------------------------------------------------------------
# npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, Tensor? pertoken_scale=None,
#     Tensor? bias=None, int? output_dtype=None, int? x1_dtype=None, int? x2_dtype=None,
#     int? pertoken_scale_dtype=None, int? scale_dtype=None, int[]? group_sizes=None, Tensor? y_scale=None) -> Tensor
# MX modes only (scale_dtype / pertoken_scale_dtype == 293): `pertoken_scale` is x1's E8M0 scale
# [..., M, ceil(K/64), 2], `scale` is x2's [ceil(K/64), N, 2]. MXFP8: x1 fp8 [..., M, K], x2 fp8 [K, N] (any strides);
# A4W4: x1 uint8 [..., M, K/2] (x1_dtype=296), x2 uint8 [K, N/2] (x2_dtype=296, packed along N).
# numerics: both operands dequantized to fp32 (exact), one fp32 matmul, + fp32 bias, rounded once to
# output_dtype (None -> bfloat16). Not bit-exact vs the NPU (accumulation order, §13.7).
# ---------------------------------------------------------------------------------------------------
OP_QMM = "npu_quant_matmul"


def mx_operand_format(op: str, arg: str, t: torch.Tensor, dtype_arg: str, code) -> mxf.MxFormat:
    """Element format of an MX matmul operand: a native fp8 tensor, or uint8 declared FP4 by its dtype code."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmt = mxf.E4M3 if t.dtype == torch.float8_e4m3fn else mxf.E5M2
        check(
            code is None or mxf.FORMATS.get(mxf.dtype_code(code)) is fmt,
            op,
            f"{dtype_arg}={code} contradicts {arg}.dtype {t.dtype}; allowed: None or its code",
        )
        return fmt
    check(
        t.dtype == torch.uint8 and code is not None and mxf.dtype_code(code) == mxf.float4_e2m1fn_x2,
        op,
        f"{arg} is {t.dtype} with {dtype_arg}={code}; allowed: torch.float8_e4m3fn / torch.float8_e5m2, or "
        f"torch.uint8 with {dtype_arg}=296 (packed float4_e2m1fn_x2)",
    )
    return mxf.E2M1


def check_mx_scale(op: str, arg: str, scale, expected: tuple) -> None:
    check(scale is not None, op, f"{arg} is required in MX mode (E8M0 bytes of shape {expected})")
    check_dtype(op, arg, scale, (torch.uint8, torch.float8_e8m0fnu))
    check(tuple(scale.shape) == tuple(expected), op, f"{arg} has shape {tuple(scale.shape)}; expected {expected}")


def _check_fp4_rows(x1: torch.Tensor, f1: mxf.MxFormat) -> None:
    """The FP4 x FP4 (A4W4) kernel does not take a single row, M == 1: the recipe's MxFp4LinearMethod.apply
    (module/quantization/mxfp4.py, "the FP4 quant matmul kernel's m == 1 limitation") duplicates it to M = 2 first;
    spec a4w4_hadamard.md §3.1 step 1, mx_quant.md §9.4. A route cap: the caller's batch decides it."""
    check_npu_limit(
        not f1.packed or x1.shape[-2] != 1,
        OP_QMM,
        f"x1 has M=1 row (shape {tuple(x1.shape)}); the FP4 x FP4 kernel needs M != 1 (duplicate the row, slice the "
        f"output)",
    )


def _validate_qmm(
    x1,
    x2,
    scale,
    offset,
    pertoken_scale,
    bias,
    output_dtype,
    x1_dtype,
    x2_dtype,
    pertoken_scale_dtype,
    scale_dtype,
    group_sizes,
    y_scale,
):
    op = OP_QMM
    if mxf.float8_e8m0fnu not in (scale_dtype, pertoken_scale_dtype):
        unsupported(
            op,
            f"scale_dtype={scale_dtype}, pertoken_scale_dtype={pertoken_scale_dtype} (only the MX "
            f"modes, scale_dtype=293 and pertoken_scale_dtype=293, are implemented)",
        )
    for name, code in (("scale_dtype", scale_dtype), ("pertoken_scale_dtype", pertoken_scale_dtype)):
        check(code == mxf.float8_e8m0fnu, op, f"{name}={code} in MX mode; allowed: 293 (float8_e8m0fnu)")
    check(
        group_sizes is None or list(group_sizes) == [1, 1, 32],
        op,
        f"group_sizes={group_sizes} in MX mode; allowed: [1, 1, 32] (or None)",
    )
    check(offset is None and y_scale is None, op, "offset and y_scale must be None in MX mode")
    f1 = mx_operand_format(op, "x1", x1, "x1_dtype", x1_dtype)
    f2 = mx_operand_format(op, "x2", x2, "x2_dtype", x2_dtype)
    if f1.packed != f2.packed:
        unsupported(op, f"x1 {f1.name} with x2 {f2.name} (MX A8W4 linear; MXFP8 x MXFP8 and FP4 x FP4 are supported)")
    check(x1.dim() in (2, 3), op, f"x1 must be [M, K] or [B, M, K]; got shape {tuple(x1.shape)}")
    check(x2.dim() == 2, op, f"x2 must be [K, N]; got shape {tuple(x2.shape)}")
    k = x1.shape[-1] * (2 if f1.packed else 1)
    check(
        x2.shape[0] == k,
        op,
        f"x2 has shape {tuple(x2.shape)}; expected [K={k}, N{'/2' if f2.packed else ''}] "
        f"for x1 of shape {tuple(x1.shape)}",
    )
    n = x2.shape[1] * (2 if f2.packed else 1)
    _check_fp4_rows(x1, f1)
    kb = math.ceil(k / 64)
    check_mx_scale(op, "pertoken_scale", pertoken_scale, tuple(x1.shape[:-1]) + (kb, 2))
    check_mx_scale(op, "scale", scale, (kb, n, 2))
    if bias is not None:
        check_dtype(op, "bias", bias, (torch.float32, torch.bfloat16))
        check(tuple(bias.shape) in ((n,), (1, n)), op, f"bias has shape {tuple(bias.shape)}; expected ({n},)")
    return f1, f2, k, n, mx_output_dtype(op, "output_dtype", output_dtype, 15)


def npu_quant_matmul(
    x1: torch.Tensor,
    x2: torch.Tensor,
    scale: torch.Tensor,
    *,
    offset=None,
    pertoken_scale=None,
    bias=None,
    output_dtype=None,
    x1_dtype=None,
    x2_dtype=None,
    pertoken_scale_dtype=None,
    scale_dtype=None,
    group_sizes=None,
    y_scale=None,
) -> torch.Tensor:
    f1, f2, k, _, out_dtype = _validate_qmm(
        x1,
        x2,
        scale,
        offset,
        pertoken_scale,
        bias,
        output_dtype,
        x1_dtype,
        x2_dtype,
        pertoken_scale_dtype,
        scale_dtype,
        group_sizes,
        y_scale,
    )
    # An NZ x2 is read by the NZ rules: as its dtype, or as FP4 pairs along N (x2 [K, N/2]).
    check_nz_read(OP_QMM, "x2", nz_operand(OP_QMM, "x2", x2), -1 if f2.packed else None)
    a = mxf.dequantize(x1, pertoken_scale, f1)  # [M, K] fp32
    b = mxf.dequantize_weight(x2, scale, f2, k)
    y = a @ b
    if bias is not None:
        y = y + bias.float().reshape(-1)
    return y.to(out_dtype)


def _npu_quant_matmul_fake(
    x1,
    x2,
    scale,
    *,
    offset=None,
    pertoken_scale=None,
    bias=None,
    output_dtype=None,
    x1_dtype=None,
    x2_dtype=None,
    pertoken_scale_dtype=None,
    scale_dtype=None,
    group_sizes=None,
    y_scale=None,
):
    _, _, _, n, out_dtype = _validate_qmm(
        x1,
        x2,
        scale,
        offset,
        pertoken_scale,
        bias,
        output_dtype,
        x1_dtype,
        x2_dtype,
        pertoken_scale_dtype,
        scale_dtype,
        group_sizes,
        y_scale,
    )
    return x1.new_empty(tuple(x1.shape[:-1]) + (n,), dtype=out_dtype)


register(OP_QMM, npu_quant_matmul, _npu_quant_matmul_fake)


__all__ = [
    "npu_dynamic_mx_quant",
    "npu_anti_mx_quant",
    "npu_rms_norm_dynamic_mx_quant",
    "npu_add_rms_norm_dynamic_mx_quant",
    "npu_swiglu_mx_quant",
    "npu_quant_matmul",
]
