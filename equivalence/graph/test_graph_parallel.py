"""Graph-mode decode over real gloo ranks: one graph, zero graph breaks, eager's greedy tokens (fp32).

Each case builds the one-layer tiny model for a TP x EP layout on every rank, generates greedily in eager
mode, then with a GraphDecoder (batch of 3 padded to the captured bucket 4), and asserts on every rank:
tokens identical to eager; dynamo captured exactly one graph with no graph break and no recompile over
the steps; `torch._dynamo.explain` of the decode step reports one graph and zero breaks. Collectives
trace as functional collectives.

Compiler: inductor (the CPU backend graph mode uses) where marked, `aot_eager` elsewhere (the same dynamo
capture and AOTAutograd functionalization, without C++ code generation: several ranks compiling C++ at
once on two cores is what the ci profile cannot afford). The `thorough` profile runs every case with
inductor and adds TP-only and EP-only layouts. World 1 is covered by test_graph.py (inductor).
"""

from __future__ import annotations

import os

import pytest
import torch

from equivalence.support.compare import assert_bitwise_equal, assert_close, tolerance
from equivalence.support.dist import get_pool
from equivalence.support.graph_dp_runs import (
    DP_PROMPTS,
    NEW_TOKENS,
    _compile_fn,
    _graph_dp_vs_eager_task,
)
from equivalence.support.parallel_support import decode_metadata, paged_cache, same_on_all_ranks
from equivalence.support.strategies import BLOCK_SIZE, describe_layout, layout
from fixtures.checkpoints import checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("graph_parallel")]

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
PROMPTS = [[5, 6, 7], list(range(1, 18)), list(range(40, 71))]  # 3, 17, 31 tokens: crosses 16-token blocks


def _case(world, compiler, thorough_only=False, **sizes):
    lay = layout(world, **sizes)
    compiler = "inductor" if THOROUGH else compiler
    sp = f"-sp-{lay['moe_ep_scheme']}" if lay.get("prefill_opt") else ""
    name = f"w{world}-a{lay['attn_tp_size']}t{lay['moe_tp_size']}e{lay['moe_ep_size']}{sp}-{compiler}"
    marks = [pytest.mark.skipif(not THOROUGH, reason="thorough profile only")] if thorough_only else []
    return pytest.param(world, lay, compiler, id=name, marks=marks)


CASES = [
    _case(2, "inductor", attn_tp_size=2, moe_tp_size=1, embed_tp_size=2, lmhead_tp_size=2),  # TP x EP
    _case(4, "aot_eager", attn_tp_size=2, moe_tp_size=2, embed_tp_size=2, lmhead_tp_size=4),  # TP x EP
    # SP prefill (EP by AlltoAll) writes the cache the compiled TP decode reads
    _case(
        2,
        "aot_eager",
        attn_tp_size=2,
        moe_tp_size=1,
        embed_tp_size=2,
        lmhead_tp_size=2,
        prefill_opt=True,
        moe_ep_scheme="alltoall",
    ),
    _case(2, "inductor", True, attn_tp_size=2, moe_tp_size=2, embed_tp_size=1, lmhead_tp_size=2),  # TP only
    _case(4, "inductor", True, attn_tp_size=4, moe_tp_size=1, embed_tp_size=4, lmhead_tp_size=4),  # EP 4
]


@torch.no_grad()
def _graph_vs_eager_task(rank, world, path, lay, compiler, prompts, n):
    from torch._dynamo.utils import counters

    from optimized.distributed import ParallelState
    from optimized.executor.graph import GraphDecoder
    from optimized.executor.model_runner import ModelRunner
    from optimized.model_loader.build import load_model
    from optimized.torchair_standin import running_ge_graph

    model = load_model(path, parallel=ParallelState.build(**lay), dtype=torch.float32, num_hidden_layers=1)
    runner = ModelRunner(model, BLOCK_SIZE)
    eager = runner.generate(prompts, n).tokens
    torch._dynamo.reset()
    runner.decode_forward = GraphDecoder(model, "ge_graph", compiler=_compile_fn(compiler))
    graphs = counters["stats"]["unique_graphs"]
    graph = runner.generate(prompts, n).tokens
    captured = {
        "graphs": counters["stats"]["unique_graphs"] - graphs,
        "breaks": sum(counters["graph_break"].values()),
        "padding": dict(runner.decode_forward.padding),
        "ep_scheme": model.ep_scheme,
    }
    cache, table = paged_cache(model, [len(p) + 2 for p in prompts])
    meta = decode_metadata([len(p) for p in prompts], table)
    decoder = runner.decode_forward
    inputs = decoder.pad_inputs(torch.zeros(len(prompts), dtype=torch.long), meta, list(meta.actual_seq_lengths_kv), 4)
    with running_ge_graph():  # explain runs the graph eagerly, as a GE graph would
        explained = torch._dynamo.explain(decoder._step(BLOCK_SIZE))(*inputs, cache.layers)
    captured["explain"] = (
        explained.graph_count,
        explained.graph_break_count,
        [str(r) for r in explained.break_reasons],
    )
    return {"eager": eager, "graph": graph, "captured": captured}


@pytest.mark.parametrize("world, lay, compiler", CASES)
def test_graph_decode_one_graph_equals_eager_fp32(world, lay, compiler):
    results = get_pool(world).run(
        _graph_vs_eager_task, str(checkpoint("tiny")), lay, compiler, PROMPTS, NEW_TOKENS, timeout=600
    )
    got = same_on_all_ranks([r["graph"] for r in results], "graph tokens")
    what = f"{describe_layout(lay)} ({compiler})"
    for rank, r in enumerate(results):
        assert r["graph"] == r["eager"], f"{what} rank {rank}: graph {r['graph']} != eager {r['eager']}"
        c = r["captured"]
        assert c["graphs"] == 1 and c["breaks"] == 0, f"{what} rank {rank}: {c}"
        assert c["explain"][:2] == (1, 0), f"{what} rank {rank}: explain {c['explain']}"
        assert c["padding"] == {3: 4}, f"{what} rank {rank}: {c['padding']}"
        assert c["ep_scheme"] == (lay["moe_ep_scheme"] if lay.get("prefill_opt") else None), f"{what}: {c}"
    assert len(got) == len(PROMPTS)


@pytest.mark.parametrize("compiler", ["inductor"])
def test_graph_decode_under_attention_dp_equals_eager(compiler):
    """The recipe's DP + MC2 decode in graph mode (attention TP 1 x DP 2, MoE EP 2 over MC2): each DP group pads its
    own requests to the bucket of the largest group (3 -> 4), one captured graph on every rank, and the tokens and
    every returned logit within the fp32 entry of eager's (fp32, CPU)."""
    lay = layout(2, attn_tp_size=1, attn_dp=True)
    results = get_pool(2).run(
        _graph_dp_vs_eager_task, str(checkpoint("tiny")), lay, compiler, DP_PROMPTS, NEW_TOKENS, timeout=600
    )
    for rank, r in enumerate(results):
        (tokens, logits), (want_tokens, want_logits) = r["graph"], r["eager"]
        assert tokens == want_tokens, f"rank {rank}: graph {tokens} != eager {want_tokens}"
        for i, (got, want) in enumerate(zip(logits, want_logits)):
            # Not bitwise in fp32: inductor fuses the fp32 reductions of the 4-row padded step in another order than
            # eager's 3-row one (measured max abs difference ~1e-6), as it does at world 1 (test_graph.py); the bf16
            # test below is bitwise.
            assert_close(got, want, tolerance("model.float32"), f"rank {rank} request {i}: graph vs eager logits")
        c = r["captured"]
        assert c["graphs"] == 1 and c["breaks"] == 0, f"rank {rank}: {c}"
        # group 0 runs 3 requests, group 1 two (its dummy never decodes): both pad to the bucket of 3, i.e. 4
        assert c["padding"] == ({3: 4} if rank == 0 else {2: 4}), f"rank {rank}: {c}"


@pytest.mark.parametrize("world, attn_tp", [(2, 1), (4, 2)], ids=["tp1xdp2-ep2", "tp2xdp2-ep4"])
def test_graph_decode_under_attention_dp_bitwise_eager_bf16(world, attn_tp):
    """bf16 graph-mode DP decode, the recipe's layouts' shape (DP + MC2 in one captured graph; at TP 2 also the
    group's all_gather / reduce_scatter inside it): tokens identical and every returned logit bitwise eager's on a
    CPU, where inductor keeps every bf16 rounding of the traced code (`graph.bfloat16.<device>` elsewhere)."""
    lay = layout(world, attn_tp_size=attn_tp, attn_dp=True)
    results = get_pool(world).run(
        _graph_dp_vs_eager_task,
        str(checkpoint("tiny")),
        lay,
        "inductor",
        DP_PROMPTS,
        NEW_TOKENS,
        torch.bfloat16,
        timeout=600,
    )
    for rank, r in enumerate(results):
        (tokens, logits), (want_tokens, want_logits) = r["graph"], r["eager"]
        assert tokens == want_tokens, f"rank {rank}: graph {tokens} != eager {want_tokens}"
        assert len(logits) == len(want_logits) == len(DP_PROMPTS)
        for i, (got, want) in enumerate(zip(logits, want_logits)):
            if got.device.type == "cpu":
                assert_bitwise_equal(got, want, f"rank {rank} request {i}: bf16 graph vs eager DP decode logits")
            else:
                assert_close(got, want, f"graph.bfloat16.{got.device.type}", f"rank {rank} request {i}")
        c = r["captured"]
        assert c["graphs"] == 1 and c["breaks"] == 0, f"rank {rank}: {c}"
