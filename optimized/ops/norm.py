"""RMSNorm family: `npu_rms_norm`, `npu_add_rms_norm`, `npu_add_rms_norm_cast` (spec §1-§3).

Every op normalizes over the trailing `gamma.dim()` axes with fp32 statistics; the ops differ only in where
they round. `soc_variant()` picks the cast points of Atlas A2/A3 (variant A, default) or Ascend 950
(variant B) for the two fused add+norm ops; `npu_rms_norm` rounds once on every SoC.
"""

from __future__ import annotations

import torch

from .registry import register
from .validation import check, check_dtype, check_shape, soc_variant

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# (self, gamma) dtype pairs accepted by npu_rms_norm on Atlas A2/A3 (spec §1 table).
_RMS_NORM_PAIRS = {
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
}


# --- shared pieces ------------------------------------------------------------------------------------


def _check_norm_shapes(op: str, x_arg: str, x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> None:
    check(1 <= x.dim() <= 8, op, f"{x_arg} must have 1 to 8 dims; got shape {tuple(x.shape)}")
    check(
        1 <= gamma.dim() <= x.dim(),
        op,
        f"gamma must have 1 to {x_arg}.dim()={x.dim()} dims (The gamma shape should not be bigger than "
        f"self shape.); got gamma shape {tuple(gamma.shape)}",
    )
    check_shape(op, "gamma", gamma, tuple(x.shape[x.dim() - gamma.dim() :]))
    check(epsilon >= 0, op, f"epsilon must be >= 0; got {epsilon}")


def _rstd_shape(x: torch.Tensor, g: int) -> tuple:
    # rstd keeps the rank: the g normalized axes become 1 (spec §1 output 2).
    return tuple(x.shape[: x.dim() - g]) + (1,) * g


def _rstd(xf: torch.Tensor, g: int, epsilon: float) -> torch.Tensor:
    """fp32 `1 / sqrt(mean(xf^2) + f32(eps))` over the last g axes, keepdim (spec §1 steps 2-3)."""
    ms = xf.square().mean(dim=tuple(range(-g, 0)), keepdim=True)
    return 1.0 / torch.sqrt(ms + epsilon)  # the python eps is converted to fp32 by the fp32 add


# --- npu_rms_norm -------------------------------------------------------------------------------------
# schema: npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)
# rounding: y = rne_{x.dtype}(f32(x) * rstd * f32(gamma)) -- one rounding at the end, all products in fp32.


def _validate_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> None:
    op = "npu_rms_norm"
    check_dtype(op, "self", self, _FLOATS)
    check_dtype(op, "gamma", gamma, _FLOATS)
    check(
        (self.dtype, gamma.dtype) in _RMS_NORM_PAIRS,
        op,
        f"(self, gamma) dtypes ({self.dtype}, {gamma.dtype}) not allowed; allowed pairs: "
        f"{sorted((str(a), str(b)) for a, b in _RMS_NORM_PAIRS)}",
    )
    _check_norm_shapes(op, "self", self, gamma, epsilon)


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06):
    _validate_rms_norm(self, gamma, epsilon)
    xf = self.float()
    rstd = _rstd(xf, gamma.dim(), epsilon)
    y = (xf * rstd * gamma.float()).to(self.dtype)
    return y.contiguous(), rstd.contiguous()


def _npu_rms_norm_fake(self, gamma, epsilon=1e-06):
    _validate_rms_norm(self, gamma, epsilon)
    return self.new_empty(self.shape), self.new_empty(_rstd_shape(self, gamma.dim()), dtype=torch.float32)


register("npu_rms_norm", npu_rms_norm, _npu_rms_norm_fake, traceable=npu_rms_norm)


# --- npu_add_rms_norm ---------------------------------------------------------------------------------
# schema: npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)
# rounding A (a2a3): x = rne(f32(x1)+f32(x2)); norm from the ROUNDED x; y = rne(f32(rne(x*rstd)) * f32(gamma)).
# rounding B (950):  xs = f32(x1)+f32(x2) kept fp32; y = rne(xs*rstd*f32(gamma)); x = rne(xs).


def _validate_add_rms_norm(op: str, x1, x2, gamma, epsilon, allowed=_FLOATS) -> None:
    check_dtype(op, "x1", x1, allowed)
    check(x2.dtype == x1.dtype, op, f"x2 has dtype {x2.dtype}; expected x1.dtype={x1.dtype}")
    check(gamma.dtype == x1.dtype, op, f"gamma has dtype {gamma.dtype}; expected x1.dtype={x1.dtype}")
    check_shape(op, "x2", x2, tuple(x1.shape))
    _check_norm_shapes(op, "x1", x1, gamma, epsilon)


def _add_rms_norm(x1, x2, gamma, epsilon):
    """(y_fp32_unrounded_or_None, y, rstd, x) under the active SoC variant."""
    dt, g = x1.dtype, gamma.dim()
    xs = x1.float() + x2.float()
    gf = gamma.float()
    if soc_variant() == "950":
        rstd = _rstd(xs, g, epsilon)
        y32 = xs * rstd * gf
        return y32, y32.to(dt), rstd, xs.to(dt)
    x = xs.to(dt)
    xf = x.float()
    rstd = _rstd(xf, g, epsilon)
    t = xf * rstd
    y = t * gf if dt == torch.float32 else (t.to(dt).float() * gf).to(dt)
    return None, y, rstd, x


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06):
    _validate_add_rms_norm("npu_add_rms_norm", x1, x2, gamma, epsilon)
    _, y, rstd, x = _add_rms_norm(x1, x2, gamma, epsilon)
    return y.contiguous(), rstd.contiguous(), x.contiguous()


def _npu_add_rms_norm_fake(x1, x2, gamma, epsilon=1e-06):
    _validate_add_rms_norm("npu_add_rms_norm", x1, x2, gamma, epsilon)
    rstd = x1.new_empty(_rstd_shape(x1, gamma.dim()), dtype=torch.float32)
    return x1.new_empty(x1.shape), rstd, x1.new_empty(x1.shape)


register("npu_add_rms_norm", npu_add_rms_norm, _npu_add_rms_norm_fake, traceable=npu_add_rms_norm)


# --- npu_add_rms_norm_cast ----------------------------------------------------------------------------
# schema: npu_add_rms_norm_cast(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor, Tensor)  # noqa: E501 (the schema string as the spec writes it)
# rounding A (a2a3): (y2, rstd, x) as npu_add_rms_norm variant A, y1 = f32(y2) exactly.
# rounding B (950):  y1 = xs*rstd*f32(gamma) unrounded fp32, y2 = rne(y1).

_CAST_DTYPES = (torch.float16, torch.bfloat16)


def npu_add_rms_norm_cast(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06):
    _validate_add_rms_norm("npu_add_rms_norm_cast", x1, x2, gamma, epsilon, _CAST_DTYPES)
    y32, y2, rstd, x = _add_rms_norm(x1, x2, gamma, epsilon)
    y1 = y2.float() if y32 is None else y32
    return y1.contiguous(), y2.contiguous(), rstd.contiguous(), x.contiguous()


def _npu_add_rms_norm_cast_fake(x1, x2, gamma, epsilon=1e-06):
    _validate_add_rms_norm("npu_add_rms_norm_cast", x1, x2, gamma, epsilon, _CAST_DTYPES)
    rstd = x1.new_empty(_rstd_shape(x1, gamma.dim()), dtype=torch.float32)
    return (x1.new_empty(x1.shape, dtype=torch.float32), x1.new_empty(x1.shape), rstd, x1.new_empty(x1.shape))


register("npu_add_rms_norm_cast", npu_add_rms_norm_cast, _npu_add_rms_norm_cast_fake, traceable=npu_add_rms_norm_cast)

__all__ = ["npu_rms_norm", "npu_add_rms_norm", "npu_add_rms_norm_cast"]
