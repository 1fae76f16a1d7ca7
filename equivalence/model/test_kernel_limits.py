"""The kernels' documented limits that the model's calls could reach, enforced by the portable kernels in strict mode
(a model-level module: the route caps are on, as for every model test; the dims caps are switched on where a test
says so). Each limit is defined beside its kernel with its source; the FP4 matmul's M == 1 limit is proven with the
W4A4 linear (equivalence/quant/test_w4a4_single_row.py), the MC2 limits in equivalence/ops/test_ops_mc2.py.
"""

from __future__ import annotations

import pytest
import torch

from optimized.ops import mx_format as mxf
from optimized.ops.validation import STRICT_ENV

FP8 = torch.float8_e4m3fn


def _paged_fp8_attention(query_rows: int, *, nq=2, nkv=1, d=16, block=16):
    """One request reading a per-token FP8 paged cache (key/value_quant_mode 4, the FP8 KV decode's call)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(query_rows, nq, d, generator=g).bfloat16()
    cache = torch.randn(2, block, nkv * d, generator=g).to(FP8)
    scale = torch.rand(2, block, generator=g)
    return torch.ops.npu.npu_fused_infer_attention_score_v2(
        q,
        cache,
        cache,
        num_query_heads=nq,
        num_key_value_heads=nkv,
        softmax_scale=d**-0.5,
        input_layout="TND",
        sparse_mode=0,
        actual_seq_qlen=[query_rows],
        actual_seq_kvlen=[5],
        block_table=torch.tensor([[1]], dtype=torch.int32),
        block_size=block,
        dequant_scale_key=scale,
        dequant_scale_value=scale,
        key_quant_mode=4,
        value_quant_mode=4,
    )[0]


def test_per_token_kv_dequantization_takes_one_query_row_per_request(monkeypatch):
    assert _paged_fp8_attention(1).shape == (1, 2, 16)  # a decode row: within the limit
    with pytest.raises(ValueError, match=r"NPU limit: key_quant_mode=4 takes one query row per batch .* \[2\]"):
        _paged_fp8_attention(2)
    monkeypatch.setenv(STRICT_ENV, "0")
    assert _paged_fp8_attention(2).shape == (2, 2, 16)  # the portable kernel computes it


def test_paged_cache_width_and_tnd_value_dims_are_dims_caps(monkeypatch):
    """Nkv*D <= 65535 for the (num_blocks, block_size, H) cache, and TND's Dv = 192 only without GQA or paging: off at
    the route level (the tiny fixtures' head dims are deliberate), on with every cap."""
    _paged_fp8_attention(1, nq=2, nkv=1, d=192)
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(ValueError, match=r"NPU limit: .*Nkv\*D <= 65535; got 65536"):
        _paged_fp8_attention(1, nq=256, nkv=256, d=256)
    with pytest.raises(ValueError, match=r"NPU limit: TND with Dv = 192 takes neither GQA nor a paged cache"):
        _paged_fp8_attention(1, nq=2, nkv=1, d=192)


def _mx_gmm(groups: int, rows: int = 2, k: int = 64, n: int = 2):
    """An A4W4 grouped matmul over `groups` experts (FP4 x FP4, weights packed along N)."""
    x = torch.zeros(rows, k // 2, dtype=torch.uint8)
    w = torch.zeros(groups, k, n // 2, dtype=torch.uint8)
    xs = torch.full((rows, k // 64, 2), 127, dtype=torch.uint8)
    ws = torch.full((groups, k // 64, n, 2), 127, dtype=torch.uint8)
    counts = torch.zeros(groups, dtype=torch.int64)
    counts[0] = rows
    return torch.ops.npu.npu_grouped_matmul(
        [x],
        [w],
        scale=[ws],
        per_token_scale=[xs],
        group_list=counts,
        group_type=0,
        group_list_type=1,
        split_item=3,
        output_dtype=mxf.dtype_code(torch.bfloat16),
        x_dtype=mxf.float4_e2m1fn_x2,
        weight_dtype=mxf.float4_e2m1fn_x2,
        scale_dtype=mxf.float8_e8m0fnu,
        per_token_scale_dtype=mxf.float8_e8m0fnu,
    )[0]


def test_an_mx_grouped_matmul_takes_at_most_1024_groups(monkeypatch):
    assert _mx_gmm(1024).shape == (2, 2)
    with pytest.raises(ValueError, match="npu_grouped_matmul: NPU limit: weight\\[0\\] has 1025 groups; at most 1024"):
        _mx_gmm(1025)
    monkeypatch.setenv(STRICT_ENV, "0")
    assert _mx_gmm(1025).shape == (2, 2)
