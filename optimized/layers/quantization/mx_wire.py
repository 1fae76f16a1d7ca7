"""The MXFP8 activation payload: rows quantized once and moved between ranks as data + scales (`MxRows`).

An activation payload is a tensor or MxRows; a linear or the experts take either (MxRows: already quantized, the
recipe's `dynamic_scale` / `pertoken_scale`). The W4A8 sequence-parallel prefill (optimized/phases.py) puts it on
the wire; the exchanges move its rows together (`map_rows`); the MX quant methods consume it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FLOAT8_E4M3FN = 24  # torch ScalarType code (== torch_npu 292)


class MxRows(NamedTuple):
    """MXFP8 activation rows: data [M, K] float8_e4m3fn and their MX scale pairs [M, ceil(K/64), 2] (uint8).

    Rows move together: see `map_rows`."""

    data: torch.Tensor
    scale: torch.Tensor


def map_rows(x, fn):
    """`fn` (a row-wise move: gather, all_to_all, slice) applied to a payload: to both parts of MxRows."""
    return MxRows(fn(x.data), fn(x.scale)) if isinstance(x, MxRows) else fn(x)


def num_rows(x) -> int:
    return (x.data if isinstance(x, MxRows) else x).shape[0]


def mx_quant(x: torch.Tensor) -> MxRows:
    """MXFP8 E4M3 activations as the recipe quantizes them (scale_alg 0, rint): fp8 [M, K], scale [M, K/64, 2]."""
    return MxRows(*torch.ops.npu.npu_dynamic_mx_quant(x, dst_type=FLOAT8_E4M3FN))


def no_mx(x, what: str) -> None:
    """A 16-bit layer refuses MXFP8 rows."""
    if isinstance(x, MxRows):
        raise TypeError(
            f"{what} holds 16-bit weights and cannot take MXFP8 rows (a payload is quantized only for "
            f"MX layers: W4A8 checkpoints)"
        )


def no_mxfp8_rows(x, what: str) -> None:
    """A W4A4 layer quantizes its own input to MXFP4: MXFP8 rows are refused."""
    if isinstance(x, MxRows):
        raise TypeError(f"{what} cannot take MXFP8 rows (the MXFP8 wire of the W4A8 sequence-parallel prefill)")
