"""Input checks shared by every portable kernel, dtype codes, and the two package-wide switches.

Errors always name the operator and the argument, and say what was expected and what arrived.
"""

from __future__ import annotations

from typing import Iterable

import torch

from optimized import envs

# torch_npu passes `int? *_dtype` arguments as c10::ScalarType codes; its private low-bit types are
# carried in uint8 storage (op-plugin's TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP).
DTYPE_CODES: dict[int, torch.dtype] = {
    0: torch.uint8,
    1: torch.int8,
    2: torch.int16,
    3: torch.int32,
    4: torch.int64,
    5: torch.float16,
    6: torch.float32,
    7: torch.float64,
    11: torch.bool,
    15: torch.bfloat16,
    23: torch.float8_e5m2,
    24: torch.float8_e4m3fn,
    285: torch.uint8,  # int4 (packed)
    290: torch.uint8,  # hifloat8
    291: torch.float8_e5m2,
    292: torch.float8_e4m3fn,
    296: torch.uint8,  # float4_e2m1fn_x2
    297: torch.uint8,  # float4_e1m2fn_x2
}


def dtype_from_code(op: str, arg: str, code: int) -> torch.dtype:
    if code not in DTYPE_CODES:
        raise ValueError(f"{op}: {arg}={code} is not a known dtype code; known: {sorted(DTYPE_CODES)}")
    return DTYPE_CODES[code]


# Which caps a `check_npu_limit` states: ROUTE caps depend on what the caller passes (dtypes, modes, layouts);
# DIMS caps on the checkpoint's dimensions (head dims the tiny fixtures do not have); FP32 caps reject float32
# where the NPU takes 16-bit (the fp32 exact-path proofs run float32 on purpose).
ROUTE, DIMS, FP32 = "route", "dims", "fp32"
STRICT_ENV = envs.STRICT_NPU_LIMITS
STRICT_LEVELS = {"0": (), "1": (ROUTE, DIMS, FP32), "route": (ROUTE,)}


def strict_npu_limits(kind: str = ROUTE) -> bool:
    """Whether caps of `kind` are enforced. QWEN3_MOE_STRICT_NPU_LIMITS: 0 (default) none, 1 every cap,
    `route` only the route caps (how the equivalence suite runs its tiny-model tests: what the model passes is
    what an NPU accepts, at any fixture size and also in the fp32 proofs)."""
    return kind in STRICT_LEVELS[envs.strict_npu_limits()]  # an EnvError (a ValueError) for another value


def soc_variant() -> str:
    """Which SoC's rounding the norm kernels reproduce: 'a2a3' (Atlas A2/A3, default) or '950'."""
    return envs.npu_golden_soc()


def fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def check(condition: bool, op: str, message: str) -> None:
    if not condition:
        fail(op, message)


def check_npu_limit(condition: bool, op: str, message: str, kind: str = ROUTE) -> None:
    """A hardware cap of `kind` (ROUTE, DIMS, FP32): raised only when strict mode enforces it."""
    if not condition and strict_npu_limits(kind):
        fail(op, f"NPU limit: {message} (strict mode; unset {STRICT_ENV} to allow)")


def check_dtype(op: str, arg: str, tensor: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if tensor.dtype not in allowed:
        fail(op, f"{arg} has dtype {tensor.dtype}; allowed: {', '.join(str(d) for d in allowed)}")


def check_dim(op: str, arg: str, tensor: torch.Tensor, allowed: Iterable[int]) -> None:
    allowed = tuple(allowed)
    if tensor.dim() not in allowed:
        fail(op, f"{arg} must have {' or '.join(map(str, allowed))} dims; got shape {tuple(tensor.shape)}")


def check_shape(op: str, arg: str, tensor: torch.Tensor, expected: tuple) -> None:
    if tuple(tensor.shape) != tuple(expected):
        fail(op, f"{arg} has shape {tuple(tensor.shape)}; expected {tuple(expected)}")


def check_rows_and_ids(
    op: str, x: torch.Tensor, x_dtypes: Iterable[torch.dtype], ids: torch.Tensor, ids_name: str
) -> None:
    """The routing operators' pair: 2-D rows `x` [N, H] and 2-D int32 expert ids [N, K] with as many rows."""
    check_dim(op, "x", x, (2,))
    check_dim(op, ids_name, ids, (2,))
    check_dtype(op, "x", x, x_dtypes)
    check_dtype(op, ids_name, ids, (torch.int32,))
    check(x.shape[0] == ids.shape[0], op, f"x has {x.shape[0]} rows but {ids_name} has {ids.shape[0]}; they must match")


def unsupported(op: str, feature: str) -> None:
    raise NotImplementedError(f"{op}: {feature} not supported by the portable kernel")
