"""Model-level equivalence tests run the portable kernels with the NPU route caps enforced, and the double-routing
exchange moves MXFP8 rows the way the NPU re-routing kernel takes them (fp8 pairs as bf16, scale bytes alongside).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, strategies as st

from equivalence.support.compare import assert_bitwise_equal
from equivalence.conftest import MODEL_LEVEL_STRICTNESS
from equivalence.support.dist import get_pool
from optimized.layers.exchange import re_routing
from optimized.layers.quantization.mx_wire import MxRows
from optimized.ops.validation import STRICT_ENV

H = 64


def _strictness(rank, world):
    return os.environ.get(STRICT_ENV)


def test_model_level_tests_and_their_pool_ranks_enforce_the_route_caps():
    assert os.environ.get(STRICT_ENV) == MODEL_LEVEL_STRICTNESS == "route"
    assert get_pool(2).run(_strictness) == ["route", "route"]


def _counts(ranks, local, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (ranks, local), generator=g)


def test_route_level_rejects_fp8_tokens_but_lets_the_fp32_proofs_and_tiny_dims_through(monkeypatch):
    counts = _counts(2, 3, 0)
    a = int(counts.sum())
    fp8 = torch.zeros(a, H, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="NPU limit: tokens has dtype torch.float8_e4m3fn"):
        torch.ops.npu.npu_moe_re_routing(fp8, counts)
    torch.ops.npu.npu_moe_re_routing(torch.zeros(a, H), counts)  # fp32: a FP32 cap, off here
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(ValueError, match="NPU limit: tokens has dtype torch.float32"):
        torch.ops.npu.npu_moe_re_routing(torch.zeros(a, H), counts)
    monkeypatch.setenv(STRICT_ENV, "yes")
    with pytest.raises(ValueError, match="QWEN3_MOE_STRICT_NPU_LIMITS='yes'; allowed"):
        torch.ops.npu.npu_moe_re_routing(torch.zeros(a, H), counts)


@given(ranks=st.integers(1, 4), local=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_mx_rows_re_routing_is_a_bit_exact_move_of_data_and_scales(ranks, local, seed):
    counts = _counts(ranks, local, seed)
    a = int(counts.sum())
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (a, H), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)  # NaNs too
    scale = torch.randint(0, 256, (a, H // 64, 2), dtype=torch.uint8, generator=g)
    moved, idx, per_expert = re_routing(MxRows(data, scale), counts)  # strict route level: no NPU limit hit
    plain, plain_idx, plain_per_expert = re_routing(torch.randn(a, H, generator=g).bfloat16(), counts)
    assert_bitwise_equal(idx, plain_idx, "permutation")
    assert_bitwise_equal(per_expert, plain_per_expert, "per-expert counts")
    assert_bitwise_equal(moved.data, data[idx.long()], "fp8 data")
    assert_bitwise_equal(moved.scale, scale[idx.long()], "scale bytes")
