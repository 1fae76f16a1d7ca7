"""Graph mode's collectives: under torch.compile (fullgraph) `reduce_scatter` and `all_to_all_single` trace as the
functional collectives (`_c10d_functional.*`, what torchair lowers to HCCL ops) and give eager's result bit for bit,
on real gloo ranks (graph DP decode at attention TP > 1 traces `reduce_scatter` after o_proj). Their results are the
collectives' own outputs: dynamo's rewrite of an in-place `dist` collective adds a buffer (`new_empty`) and a
`copy_` into it per call, an extra device copy per collective per layer in every decode graph."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from equivalence.support.dist import get_pool

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("graph_parallel")]


def _compiled_vs_eager(rank, world, rows_per_rank, splits, seed):
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend

    from optimized.distributed import collectives as comm

    pg = dist.group.WORLD
    torch.manual_seed(seed + rank)
    x = torch.randn(rows_per_rank * world, 3)
    send = splits[rank]  # rows this rank sends to each rank
    recv = [splits[src][rank] for src in range(world)]  # rows each rank sends this one
    y = torch.randn(sum(send), 5).to(torch.bfloat16)

    def step(x, y):
        return comm.reduce_scatter(x, pg), comm.all_to_all_single(y, pg, recv, send), comm.all_to_all_single(x, pg)

    ops = []

    def backend(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
        return gm

    counter = CompileCounterWithBackend(backend)
    torch._dynamo.reset()
    got = torch.compile(step, backend=counter, fullgraph=True)(x, y)
    want = step(x, y)
    return [(g.dtype, g.shape, bool(torch.equal(g, w))) for g, w in zip(got, want)], counter.frame_count, ops


@settings(max_examples=4, deadline=None)
@given(
    rows=st.integers(1, 3),
    splits=st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=2), min_size=2, max_size=2),
    seed=st.integers(0, 100),
)
def test_reduce_scatter_and_all_to_all_trace_as_functional_collectives_equal_to_eager(rows, splits, seed):
    for rank, (results, frames, ops) in enumerate(get_pool(2).run(_compiled_vs_eager, rows, splits, seed, timeout=120)):
        assert frames == 1, f"rank {rank}: {frames} graphs (a graph break)"
        assert all(equal for _, _, equal in results), (rank, results)
        functional = " ".join(ops)
        for name in ("reduce_scatter_tensor", "all_to_all_single"):
            assert f"_c10d_functional.{name}" in functional, f"rank {rank}: no functional {name} in {ops}"
        assert "copy_" not in ops and "new_empty" not in ops, f"rank {rank}: a collective copied its result: {ops}"
