"""Batch-invariant mode's GEMMs (optimized/ops/batch_invariant.py): in the mode, row i of a linear or of an expert
group's matmul is bitwise the row computed alone, whatever the number of rows and wherever the row starts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from optimized.ops import batch_invariant, cpu_gemm

pytestmark = pytest.mark.equivalence

shapes = dict(
    rows=st.integers(1, 9),
    k=st.sampled_from([7, 64, 96, 250]),
    n=st.sampled_from([5, 64, 130]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=30, deadline=None)
@given(**shapes)
def test_linear_rows_are_those_of_each_row_alone(rows, k, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows + 1, k, generator=gen).to(dtype)[1:]  # rows start unaligned
    w = torch.randn(n, k, generator=gen).to(dtype)
    with batch_invariant.mode(True):
        together = cpu_gemm.linear(x, w)
        alone = [cpu_gemm.linear(x[i : i + 1].clone(), w) for i in range(rows)]
    assert torch.equal(together, torch.cat(alone))
    assert together.shape == (rows, n) and together.dtype == dtype


@settings(max_examples=30, deadline=None)
@given(**shapes, groups=st.integers(1, 3), data=st.data())
def test_grouped_matmul_rows_are_those_of_each_row_alone(rows, k, n, dtype, seed, groups, data):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(groups, n, k, generator=gen).to(dtype).transpose(1, 2)  # [G, K, N] as the experts store it
    counts = data.draw(
        st.lists(st.integers(0, rows), min_size=groups, max_size=groups).filter(lambda c: sum(c) == rows)
    )

    def gmm(x, counts):
        return torch.ops.npu.npu_grouped_matmul(
            [x], [w], group_list=torch.tensor(counts), group_type=0, group_list_type=1, split_item=3
        )[0]

    with batch_invariant.mode(True):
        together = gmm(x, counts)
        group_of = [g for g, c in enumerate(counts) for _ in range(c)]
        alone = [gmm(x[i : i + 1].clone(), [int(g == group_of[i]) for g in range(groups)]) for i in range(rows)]
    assert torch.equal(together, torch.cat(alone))
