"""Expert load balancing's placement (optimized/layers/eplb/placement.py) changes which physical slot computes a
token's expert, never the MoE layer's output: for every placement hypothesis draws (any permutation of the experts
over the slots, redundant replicas of any expert, uneven replica counts, R = 0 included), the layer built with it
equals the layer without EPLB on the same rows, over real gloo ranks, under every token exchange: tensor parallel
(MoE TP and EP), EP all-gather, double routing (all-to-all) and MC2 dispatch / combine, fp32 and W8A8 / W4A8 /
W4A4 (MXFP4 experts quantizing their own input to MXFP4: a row's codes and scales depend on that row alone).

Bitwise where the per-expert arithmetic is unchanged: in batch-invariant mode (model_config.batch_invariant: each
row's GEMM is a GEMM of one row, so a row's expert output does not depend on how many rows share its slot) the
double routing and MC2 outputs, and the tensor-parallel one with a single EP rank, are bitwise equal: each token's
K expert outputs come back to it and are summed in the order of its K choices, whichever slot computed them.
Where the sum is split by rank, it is not: under tensor parallelism over several EP ranks and under EP all-gather,
each rank sums the choices its own slots computed and the ranks' partial sums are added (all_reduce /
reduce_scatter); moving an expert to another rank regroups that sum, a reassociation (`eplb.partial_sums.*`).
In the default mode a slot's row count changes with the placement and a CPU GEMM may round a row differently with
the row count (`layer.float32` / `layer.bfloat16`, the layer tolerances).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from equivalence.support.compare import assert_bitwise_equal, assert_close
from equivalence.support.dist import get_pool
from equivalence.support.eplb_runs import CHECKPOINTS, CONFIG, DTYPES, eplb_block, placements
from equivalence.support.parallel_support import rank_model, run_property
from equivalence.support.sp_ep_runs import _mine
from equivalence.support.strategies import hidden_kinds, hidden_states, layout, seeds

pytestmark = pytest.mark.distributed

H = CONFIG.hidden_size
TP, AG, DR, MC2 = "tp", "allgather", "alltoall", "dispatch_combine"
# (world, moe_tp_size, exchange): MoE TP only, TP over EP ranks, and the EP exchanges (moe_tp 1, EP = world).
CASES = [(2, 2, TP), (2, 1, TP), (4, 2, TP), (2, 1, AG), (4, 1, AG), (2, 1, DR), (4, 1, DR), (2, 1, MC2), (4, 1, MC2)]


def _split_by_rank(world: int, moe_tp: int, exchange: str) -> bool:
    """Whether the exchange adds the ranks' partial sums of a token's K choices (a placement regroups them)."""
    return exchange in (TP, AG) and world // moe_tp > 1


def _layer_task(rank, world, lay, quant, exchange, p2l, x, layer_idx):
    from optimized.layers.exchange import build_exchange
    from optimized.ops import batch_invariant

    path = str(CHECKPOINTS[quant]("tiny"))
    base = rank_model(path, lay, DTYPES[quant])
    block, plain = eplb_block(path, base, layer_idx, p2l), base.layers[layer_idx].mlp
    ex = None if exchange == TP else build_exchange(exchange, base.config, base.groups)
    rows = _mine(x, rank, world) if exchange in (AG, DR) else x  # AG / DR: each rank its own rows
    out = {}
    with torch.no_grad():
        for invariant in (True, False):
            with batch_invariant.mode(invariant):
                out[invariant] = (block(rows, ex), plain(rows, ex))
    return out


def _check(world, moe_tp, exchange, quant, examples):
    lay = layout(world, attn_tp_size=world, moe_tp_size=moe_tp)
    ep = world // moe_tp
    dtype = DTYPES[quant]

    def check(p2l, kind, tokens, layer_idx, seed):
        x = hidden_states(kind, seed, tokens, H, dtype)
        results = get_pool(world).run(_layer_task, lay, quant, exchange, p2l, x, layer_idx, timeout=120)
        what = f"{quant} {exchange} world {world} moe_tp {moe_tp} placement {p2l} {kind} x{tokens}"
        for rank, out in enumerate(results):
            got, want = out[True]
            if _split_by_rank(world, moe_tp, exchange):
                assert_close(got.float(), want.float(), f"eplb.partial_sums.{_name(dtype)}", f"{what} rank {rank}")
            else:
                assert_bitwise_equal(got, want, f"{what} rank {rank} (batch-invariant)")
            got, want = out[False]
            assert_close(got.float(), want.float(), f"layer.{_name(dtype)}", f"{what} rank {rank} (default mode)")

    run_property(
        check,
        examples,
        p2l=placements(ep),
        kind=hidden_kinds,
        tokens=st.integers(1, 9),
        layer_idx=st.integers(0, CONFIG.num_hidden_layers - 1),
        seed=seeds,
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("world, moe_tp, exchange", CASES)
def test_placement_keeps_the_layer_output_fp32(world, moe_tp, exchange):
    _check(world, moe_tp, exchange, "float32", 3)


@pytest.mark.parametrize("quant", ["w8a8", "w4a8", "w4a4"])
@pytest.mark.parametrize("world, moe_tp, exchange", [(2, 1, TP), (2, 1, AG), (2, 1, DR), (4, 1, MC2)])
def test_placement_keeps_the_layer_output_quantized(world, moe_tp, exchange, quant):
    _check(world, moe_tp, exchange, quant, 2)
