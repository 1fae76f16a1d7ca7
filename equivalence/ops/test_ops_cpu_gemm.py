"""The CPU bf16 linear on oneDNN's prepacked weight (optimized/ops/cpu_gemm.py) is F.linear bit for bit.

- drawn shapes (rows 1-9, N and K up to 300, the decode GEMVs' own shapes among them) and value scales: bitwise
  F.linear, and the packed path was taken (the weight has a packed copy), so a silent fallback cannot pass;
- a weight rewritten in place (a reload) is packed again: the result follows the new values, never a stale copy;
- compiled (inductor, fullgraph): the step calls the operator and returns eager's bits;
- fp32, autograd and inference-mode weights take plain F.linear, with no packed copy;
- a view (an expert's W[g].t(), a new object per call) is packed once and reused; freeing its weight drops the copy;
- the grouped linear (the experts' stacked weight, one cache entry for its groups): each group's rows bitwise
  `linear(rows, W[g].t())`, rows past the groups 0, only the visited groups packed, and repacked after a rewrite.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from equivalence.support.compare import assert_bitwise_equal
from optimized.ops import cpu_gemm

pytestmark = pytest.mark.skipif(
    not cpu_gemm.ONEDNN_BF16, reason="oneDNN bf16 is not available on this CPU, or QWEN3_MOE_CPU_PREPACK=0"
)

DECODE_SHAPES = [(5120, 2048), (2048, 4096), (1536, 2048), (2048, 768)]  # qkv, o, expert gate|up, down (30B-A3B)


def _packed(weight) -> bool:
    return (weight.data_ptr(), tuple(weight.shape), weight.stride()) in cpu_gemm._PACKED


@given(
    rows=st.integers(1, 9),
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_prepacked_linear_is_bitwise_f_linear(rows, n, k, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * scale).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    with torch.no_grad():
        got = cpu_gemm.linear(x, w)
    assert _packed(w), "the prepacked path was not taken"
    assert_bitwise_equal(got, F.linear(x, w), f"prepacked linear [{rows}, {k}] x [{n}, {k}]^T")
    assert_bitwise_equal(torch.ops.qwen3_moe_cpu.linear(x, w), got, "the operator vs the direct kernel call")


@pytest.mark.parametrize("n,k", DECODE_SHAPES)
@pytest.mark.parametrize("rows", [1, 4])
def test_prepacked_linear_decode_shapes_bitwise(n, k, rows):
    g = torch.Generator().manual_seed(n + k + rows)
    x, w = torch.randn(1, rows, k, generator=g).bfloat16(), (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    with torch.no_grad():
        got = cpu_gemm.linear(x, w)
    assert _packed(w) and got.shape == (1, rows, n)
    assert_bitwise_equal(got, F.linear(x, w), f"prepacked linear decode shape [{rows}, {k}] x [{n}, {k}]^T")


def test_weight_rewritten_in_place_is_packed_again():
    w = torch.nn.Parameter(torch.randn(64, 32).bfloat16(), requires_grad=False)
    x = torch.randn(2, 32).bfloat16()
    with torch.no_grad():
        first = cpu_gemm.linear(x, w)
        w.copy_(torch.randn(64, 32).bfloat16())  # a reload into the same storage
        second = cpu_gemm.linear(x, w)
    assert not torch.equal(first, second)
    assert_bitwise_equal(second, F.linear(x, w), "prepacked linear after an in-place weight rewrite")


def test_compiled_linear_calls_the_operator_and_equals_eager():
    from torch._inductor.utils import run_and_get_code

    w = torch.randn(96, 64).bfloat16()
    x = torch.randn(3, 64).bfloat16()

    def f(x):
        return cpu_gemm.linear(torch.relu(x), w) * 2

    with torch.no_grad():
        compiled = torch.compile(f, fullgraph=True, backend="inductor")
        got, code = run_and_get_code(compiled, x)
        want = f(x)
    assert "qwen3_moe_cpu.linear" in "\n".join(code)
    assert_bitwise_equal(got, want, "compiled prepacked linear vs eager")


def test_other_inputs_take_plain_f_linear():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with torch.no_grad():
        assert_bitwise_equal(cpu_gemm.linear(x, w), F.linear(x, w), "fp32 linear")
    assert not _packed(w)
    xb, wb = torch.randn(2, 16).bfloat16().requires_grad_(), torch.randn(8, 16).bfloat16()
    y = cpu_gemm.linear(xb, wb)  # grad enabled and x requires grad: F.linear, differentiable
    assert y.requires_grad and not _packed(wb)
    with torch.inference_mode():
        wi, xi = torch.randn(8, 16).bfloat16(), torch.randn(2, 16).bfloat16()
        assert_bitwise_equal(cpu_gemm.linear(xi, wi), F.linear(xi, wi), "inference-mode weight")
    assert not _packed(wi)


def test_a_view_is_packed_once_and_forgotten_with_its_weight():
    """An expert's weight reaches the kernel as a fresh view per call (W[g].t()): one packed copy, reused; freeing
    the stacked weight drops it."""
    stacked = torch.randn(4, 32, 48).bfloat16()
    first = cpu_gemm.packed_weight(stacked[2].t())
    assert cpu_gemm.packed_weight(stacked[2].t()) is first
    key = (stacked[2].t().data_ptr(), (48, 32), (1, 48))
    assert key in cpu_gemm._PACKED
    del stacked
    assert key not in cpu_gemm._PACKED


def test_prepack_env_zero_turns_the_path_off():
    """QWEN3_MOE_CPU_PREPACK=0 (read at import): no packed path, so no second copy of the weights."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = "from optimized.ops import cpu_gemm; print(cpu_gemm.ONEDNN_BF16)"
    repo = Path(__file__).resolve().parents[2]
    for value, want in (("0", "False"), ("1", "True")):
        env = {**os.environ, cpu_gemm.PREPACK_ENV: value, "PYTHONPATH": str(repo)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == want, (value, out.stdout, out.stderr[-2000:])


def _grouped_inputs(seed: int, counts: list[int], pad: int, k: int, n: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts) + pad, k, generator=g).bfloat16()
    stacked = (torch.randn(len(counts), n, k, generator=g) * 0.05).bfloat16()  # [G, N, K] rows, as the experts
    return x, stacked, stacked.transpose(1, 2)  # the logical [G, K, N] view


@given(
    counts=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    pad=st.integers(0, 3),
    k=st.integers(1, 96),
    n=st.integers(1, 96),
    seed=st.integers(0, 2**16),
)
def test_grouped_linear_is_bitwise_linear_per_group(counts, pad, k, n, seed):
    x, stacked, weight = _grouped_inputs(seed, counts, pad, k, n)
    ends = torch.tensor(counts).cumsum(0).tolist()
    with torch.no_grad():
        got = cpu_gemm.grouped_linear(x, weight, ends)
    packs = cpu_gemm._PACKED[("groups", weight.data_ptr(), tuple(weight.shape), weight.stride())][2]
    assert [p is not None for p in packs] == [c > 0 for c in counts], "only the visited groups are packed"
    assert got.shape == (x.shape[0], n)
    start = 0
    for group, end in enumerate(ends):
        assert_bitwise_equal(got[start:end], F.linear(x[start:end], stacked[group]), f"group {group} of {counts}")
        start = end
    assert not got[start:].any(), "rows past the last group are 0"


def test_grouped_linear_repacks_a_rewritten_weight():
    x, stacked, weight = _grouped_inputs(1, [2, 0, 3], 1, 32, 16)
    stacked = torch.nn.Parameter(stacked, requires_grad=False)
    weight = stacked.transpose(1, 2)
    ends = [2, 2, 5]
    with torch.no_grad():
        first = cpu_gemm.grouped_linear(x, weight, ends)
        stacked.copy_(torch.randn(stacked.shape).bfloat16())  # a reload into the same storage
        second = cpu_gemm.grouped_linear(x, weight, ends)
    assert not torch.equal(first, second)
    assert_bitwise_equal(second[:2], F.linear(x[:2], stacked[0]), "group 0 after the rewrite")
    assert_bitwise_equal(second[2:5], F.linear(x[2:5], stacked[2]), "group 2 after the rewrite")
