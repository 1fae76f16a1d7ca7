"""The FP4 x FP4 `npu_quant_matmul` does not take a single row (M == 1): strict mode refuses it in the portable kernel
as the NPU would, and the W4A4 linear works around it as the recipe does (module/quantization/mxfp4.py,
MxFp4LinearMethod.apply): the row duplicated, both rows quantized and their scales passed whole, the output sliced
back to one row. The workaround gives the numbers of the single row, bit for bit.

Model-level module: it runs with the route caps on (equivalence/conftest.py), as a batch-1 W4A4 decode does.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from equivalence.npu.record_npu_calls import NpuCallRecorder
from equivalence.support.compare import assert_bitwise_equal
from optimized.layers.quantization.mx_layout import BLOCK, FLOAT4_E2M1, FLOAT8_E8M0
from optimized.layers.quantization.w4a4 import MxFp4LinearMethod, fp4_quant
from optimized.ops import mx_format as mxf
from optimized.ops.validation import STRICT_ENV


def _linear(k: int, n: int, seed: int):
    """A processed W4A4 linear [N, K] with random FP4 codes and E8M0 scales near 1."""
    g = torch.Generator().manual_seed(seed)
    layer, method = nn.Module(), MxFp4LinearMethod()
    method.create_weights(layer, n, k, torch.bfloat16)
    layer.weight.data.copy_(torch.randint(0, 256, layer.weight.shape, dtype=torch.uint8, generator=g))
    layer.weight_scale.data.copy_(torch.randint(122, 132, layer.weight_scale.shape, dtype=torch.uint8, generator=g))
    method.process_weights_after_loading(layer)
    return method, layer


def _fp4_matmul(layer, x: torch.Tensor) -> torch.Tensor:
    """The kernel call MxFp4LinearMethod.apply makes, on the rows of x as they are."""
    xq, xs = fp4_quant(x)
    return torch.ops.npu.npu_quant_matmul(
        xq,
        layer.weight,
        layer.weight_scale,
        pertoken_scale=xs,
        output_dtype=mxf.dtype_code(torch.bfloat16),
        x1_dtype=FLOAT4_E2M1,
        x2_dtype=FLOAT4_E2M1,
        scale_dtype=FLOAT8_E8M0,
        pertoken_scale_dtype=FLOAT8_E8M0,
        group_sizes=[1, 1, BLOCK],
    )


def test_strict_mode_refuses_a_single_row_fp4_matmul(monkeypatch):
    _, layer = _linear(128, 64, 0)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    with pytest.raises(ValueError, match=r"npu_quant_matmul: NPU limit: x1 has M=1 row \(shape \(1, 64\)\)"):
        _fp4_matmul(layer, x[:1])
    assert _fp4_matmul(layer, x).shape == (2, 64)  # two rows: within the kernel's limits
    monkeypatch.setenv(STRICT_ENV, "0")
    assert _fp4_matmul(layer, x[:1]).shape == (1, 64)  # the portable kernel itself computes one row


@given(
    k=st.sampled_from([64, 128, 192]),
    n=st.sampled_from([2, 32, 96]),
    lead=st.sampled_from([(1,), (1, 1)]),
    seed=st.integers(0, 2**16),
)
def test_a_w4a4_linear_at_one_row_duplicates_it_and_gives_the_single_rows_numbers(k, n, lead, seed):
    method, layer = _linear(k, n, seed)
    x = torch.randn(*lead, k, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    with NpuCallRecorder() as recorder:
        got = method.apply(layer, x)  # strict route caps on: a lone row must not reach the kernel
    assert got.shape == (*lead, n)
    (call,) = [c for c in recorder.calls.values() if c["op"] == "npu_quant_matmul"]
    assert call["args"]["x1"]["shape"] == [2, k // 2], "the row is duplicated before the kernel"
    assert call["args"]["pertoken_scale"]["shape"] == [2, -(-k // 64), 2], "both rows' scales go in (not sliced)"
    twice = method.apply(layer, torch.cat([x.reshape(1, k)] * 2))
    assert_bitwise_equal(got.reshape(1, n), twice[:1], "one row vs the first of the same row twice")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STRICT_ENV, "0")
        alone = _fp4_matmul(layer, x.reshape(1, k))  # what a kernel without the limit computes for the row
    assert_bitwise_equal(got.reshape(1, n), alone, "duplicated vs the single row")
