"""The one comparison module: error metrics and the tolerance table.

Every tolerance used anywhere in the suite is an entry of TOLERANCES, with the measured error that
justifies it. Bit-exact comparisons (routing, indices, counts, cache writes, MX bit patterns) do not use
this table: they use `assert_bitwise_equal`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    """Elementwise |a - e| <= atol + rtol * |e|, and optionally a bound on the relative L2 error."""

    atol: float
    rtol: float
    why: str
    max_rel_l2: float | None = None


TOLERANCES: dict[str, Tolerance] = {
    # --- single operators vs independent plain math (same inputs, different reduction order) ---
    "op.float32": Tolerance(
        atol=1e-5, rtol=1e-4,
        why="spec npu_ops_moe §0: fp32 matmul/reduction reassociation; op-plugin tests use rtol 1e-4..1e-3",
    ),
    "op.float16": Tolerance(
        atol=1e-3, rtol=1e-3,
        why="spec §0: fp16 outputs rounded once; reassociation moves a result across at most ~1 fp16 ulp (2^-11)",
    ),
    "op.bfloat16": Tolerance(
        atol=1e-2, rtol=1e-2,
        why="spec §0: bf16 outputs rounded once; 1 bf16 ulp is 2^-8 relative, reassociation can flip one rounding",
    ),
}


def tolerance(name: str) -> Tolerance:
    try:
        return TOLERANCES[name]
    except KeyError:
        raise KeyError(f"no tolerance named {name!r}; the table has {sorted(TOLERANCES)}") from None


def op_tolerance(dtype: torch.dtype) -> Tolerance:
    """The per-operator tolerance for outputs of `dtype`."""
    return tolerance(f"op.{str(dtype).removeprefix('torch.')}")


# --- metrics ---------------------------------------------------------------------------------------


def max_abs(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.numel() == 0:
        return 0.0
    return (actual.double() - expected.double()).abs().max().item()


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e|| (0 when both are zero)."""
    diff = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    return diff / scale if scale > 0 else diff


def cosine(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double().flatten(), expected.double().flatten()
    denom = a.norm() * e.norm()
    return 1.0 if denom == 0 else (a @ e / denom).item()


def top1_agreement(actual_logits: torch.Tensor, expected_logits: torch.Tensor) -> float:
    """Fraction of positions whose argmax over the last dim agrees."""
    return (actual_logits.argmax(-1) == expected_logits.argmax(-1)).double().mean().item()


def token_agreement(actual_tokens: torch.Tensor, expected_tokens: torch.Tensor) -> float:
    """Fraction of generated tokens that agree position by position."""
    return (actual_tokens == expected_tokens).double().mean().item()


def describe(actual: torch.Tensor, expected: torch.Tensor) -> str:
    return (f"max_abs={max_abs(actual, expected):.3e} rel_l2={rel_l2(actual, expected):.3e} "
            f"cosine={cosine(actual, expected):.8f} shape={tuple(actual.shape)}")


# --- assertions ------------------------------------------------------------------------------------


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: str | Tolerance, what: str = "") -> None:
    """Elementwise closeness (and relative L2 if the entry bounds it), with all metrics in the message."""
    tol = tolerance(tol) if isinstance(tol, str) else tol
    label = f"{what}: " if what else ""
    if actual.shape != expected.shape:
        raise AssertionError(f"{label}shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = actual.double(), expected.double()
    both_nan = a.isnan() & e.isnan()
    bad = ~(((a - e).abs() <= tol.atol + tol.rtol * e.abs()) | both_nan | (a == e))
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{label}{int(bad.sum())} of {a.numel()} elements outside atol={tol.atol} rtol={tol.rtol}; "
            f"first at {first}: {a[first].item()} vs {e[first].item()}; {describe(actual, expected)}")
    if tol.max_rel_l2 is not None:
        err = rel_l2(actual, expected)
        if err > tol.max_rel_l2:
            raise AssertionError(f"{label}rel_l2 {err:.3e} > {tol.max_rel_l2}; {describe(actual, expected)}")


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same shape, dtype and bytes (NaN payloads included)."""
    label = f"{what}: " if what else ""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(f"{label}{actual.dtype}{tuple(actual.shape)} != {expected.dtype}{tuple(expected.shape)}")
    if actual.numel() == 0:
        return
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    a = actual.contiguous().view(width) if actual.dtype != torch.bool else actual
    e = expected.contiguous().view(width) if expected.dtype != torch.bool else expected
    diff = a != e
    if diff.any():
        first = tuple(int(i) for i in diff.nonzero()[0])
        raise AssertionError(f"{label}{int(diff.sum())} of {a.numel()} elements differ bitwise; first at {first}: "
                             f"{actual[first]} vs {expected[first]}")
