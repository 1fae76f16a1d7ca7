"""Expert load balancing while serving: an engine over real gloo ranks (world 2: attention TP 2, MoE EP 2, MC2
decode; the sequence-parallel prefill with double routing; attention DP 2, each rank its own requests) rebalancing
every 2 steps from a window of 3 steps, with 2 redundant expert slots, gives every request the reference's greedy
tokens (fp32, each prompt alone), while the placements change (weights moved between the ranks between steps) and
/metrics counts the rebalances. With W8A8 / W4A8 experts (bf16), the sequence-parallel prefill's double routing and
the MC2 decode in batch-invariant mode, the rebalancing engine's tokens and every chosen token's logits are bitwise
those of the same engine without EPLB; W4A4 likewise with attention DP 2 (its prefill double-routed, its decode MC2),
since the recipe's sequence-parallel prefill excludes W4A4, unrotated and in the recipe's rotated form (the
Hadamard rotation on the attention linears stays put while the experts move). In each layout the load the engine
counts is top_k rows per token it computed, no padding row among them."""

from __future__ import annotations

import pytest
import torch

from equivalence.support.compare import assert_bitwise_equal
from equivalence.support.dist import get_pool
from equivalence.support.engine_runs import run_engine
from equivalence.support.parallel_support import rank_model, runner_of
from equivalence.support.parallel_support import test_device as worker_device
from equivalence.support.serving_prompts import PROMPTS, ref_greedy
from equivalence.support.strategies import layout
from fixtures.checkpoints import checkpoint, rotation_dir, w4a4_checkpoint, w4a8_checkpoint, w8a8_checkpoint

pytestmark = pytest.mark.distributed

WORLD, MAX_TOKENS = 2, 6
EPLB = dict(enable_eplb=True, num_redundant_experts=2, eplb_window_size=3, eplb_step_interval=2)
LAYOUTS = {
    "tp2_ep2_mc2": layout(WORLD, attn_tp_size=WORLD, moe_tp_size=1, embed_tp_size=2, lmhead_tp_size=2),
    "sp2_alltoall": layout(WORLD, attn_tp_size=WORLD, moe_tp_size=1, prefill_opt=True, moe_ep_scheme="alltoall"),
    "tp1xdp2_ep2": layout(WORLD, attn_tp_size=1, moe_tp_size=1, attn_dp=True),
}
# W4A4 has no sequence-parallel prefill (the recipe excludes it): attention DP, each rank's rows double-routed
ROTATED = "w4a4-rotated"
QUANT_LAYOUT = {"w4a4": "tp1xdp2_ep2", ROTATED: "tp1xdp2_ep2"}
ARRIVALS = [0, 0, 1, 3, 4]  # the step each prompt arrives at: requests join while others decode


def _engine_task(rank, world, lay):
    from optimized.executor.engine import Engine
    from optimized.executor.scheduler import Request
    from optimized.serving.metrics import Metrics

    model = rank_model(str(checkpoint("tiny")), {**lay, **EPLB}, torch.float32)
    before = [tuple(layer.mlp.experts.placement.physical_to_logical) for layer in model.layers]
    engine = Engine(runner_of(model), batch_size=4, num_blocks=64)
    requests = [(step, Request(f"r{i}", list(p), MAX_TOKENS)) for i, (step, p) in enumerate(zip(ARRIVALS, PROMPTS))]
    run_engine(engine, requests)
    metrics = Metrics()
    metrics.eplb = engine.eplb
    after = [tuple(layer.mlp.experts.placement.physical_to_logical) for layer in model.layers]
    return {
        "tokens": [r.tokens for _, r in requests],
        "rebalances": engine.eplb.rebalances,
        "moved": engine.eplb.slots_moved,
        "placements": (before, after),
        "metrics": metrics.render(),
    }


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_an_engine_rebalancing_every_two_steps_gives_the_reference_tokens(name):
    results = get_pool(WORLD).run(_engine_task, LAYOUTS[name], timeout=300)
    for rank, got in enumerate(results):
        for i, (prompt, tokens) in enumerate(zip(PROMPTS, got["tokens"])):
            want = ref_greedy(list(prompt), MAX_TOKENS)
            assert tokens == want, f"{name} rank {rank} request r{i}: {tokens} != reference {want}"
        assert got["rebalances"] > 0, f"{name} rank {rank}: no rebalance ran"
        assert f"qwen3_moe_eplb_rebalances_total {got['rebalances']}" in got["metrics"]
        assert got["placements"] == results[0]["placements"], f"{name}: rank {rank}'s placements differ from rank 0's"
    before, after = results[0]["placements"]
    assert before != after, f"{name}: the rebalances kept every placement: {after}"
    assert sum(got["moved"] for got in results) > 0, f"{name}: no expert slot moved"


def _count_task(rank, world, lay):
    from optimized.executor.engine import Engine
    from optimized.executor.scheduler import Request

    # A window longer than the run and no rebalance: the window holds every step's counts after the first
    model = rank_model(
        str(checkpoint("tiny")), {**lay, **EPLB, "eplb_window_size": 64, "eplb_step_interval": 10**6}, torch.float32
    )
    engine = Engine(runner_of(model), batch_size=4, num_blocks=64)
    requests = [(step, Request(f"r{i}", list(p), MAX_TOKENS)) for i, (step, p) in enumerate(zip(ARRIVALS, PROMPTS))]
    run_engine(engine, requests)
    last = torch.stack([block.expert_load for block in engine.eplb.blocks])  # the last step's, not closed yet
    return (engine.eplb.window.sum(0) + last).sum(1).tolist(), [len(r.tokens) for _, r in requests], model.config


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_load_counts_each_real_token_once_and_no_padding_row(name):
    """Summed over the ranks, a layer's routed rows are top_k per token the model computed: a prompt token or a fed
    back one, never a padding row (the SP prefill's tail, a DP group padded to the largest group's batch, an idle
    DP group's dummy row), which routes nowhere real and would draw replicas to the experts zeros choose."""
    results = get_pool(WORLD).run(_count_task, LAYOUTS[name], timeout=300)
    per_layer = [sum(counts) for counts in zip(*(rows for rows, _, _ in results))]
    generated, config = results[0][1], results[0][2]
    fed = sum(len(p) + n - 1 for p, n in zip(PROMPTS, generated))  # a request's last token is never fed back
    top_k = config.num_experts_per_tok
    assert per_layer == [fed * top_k] * len(per_layer), f"{name}: routed rows per layer {per_layer}, tokens {fed}"


def _quant_model(quant: str, lay: dict):
    """This rank's bf16 model of `quant`; `w4a4-rotated`: the recipe's form, a W4A4 conversion of a model whose
    attention widths take the Hadamard rotation (tiny-h128), served with its rotation directory."""
    if quant != ROTATED:
        path = str({"w8a8": w8a8_checkpoint, "w4a8": w4a8_checkpoint, "w4a4": w4a4_checkpoint}[quant]("tiny"))
        return rank_model(path, lay, torch.bfloat16)
    from optimized.distributed import ParallelState
    from optimized.model_loader.build import load_model

    model = load_model(
        w4a4_checkpoint("tiny-h128", "invertible"),
        parallel=ParallelState.build(**lay),
        dtype=torch.bfloat16,
        device=worker_device(),
        hadamard_weight_path=rotation_dir("invertible"),
    )
    assert all(layer.self_attn.merged_qkv_proj.input_rotation is not None for layer in model.layers), "not rotated"
    return model


def _quant_task(rank, world, quant, eplb: bool):
    from optimized.executor.engine import Engine
    from optimized.executor.model_runner import ModelRunner
    from optimized.executor.scheduler import Request

    lay = {**LAYOUTS[QUANT_LAYOUT.get(quant, "sp2_alltoall")], **(EPLB if eplb else {})}
    model = _quant_model(quant, lay)
    engine = Engine(ModelRunner(model, 16, batch_invariant=True), batch_size=4, num_blocks=64)
    requests = [
        (step, Request(f"r{i}", list(p), MAX_TOKENS, record_logits=True))
        for i, (step, p) in enumerate(zip(ARRIVALS, PROMPTS))
    ]
    run_engine(engine, requests)
    counts = (engine.eplb.rebalances, engine.eplb.slots_moved) if eplb else (0, 0)
    return [(r.tokens, torch.stack([torch.as_tensor(x) for x in r.logits])) for _, r in requests], counts


@pytest.mark.parametrize("quant", ["w8a8", "w4a8", "w4a4", ROTATED])
def test_a_rebalancing_quantized_engine_is_bitwise_the_engine_without_eplb(quant):
    pool = get_pool(WORLD)
    with_eplb, without = (pool.run(_quant_task, quant, on, timeout=300) for on in (True, False))
    assert sum(moved for _, (_, moved) in with_eplb) > 0, f"{quant}: no expert slot moved"
    for rank, ((got, (rebalances, _)), (want, _)) in enumerate(zip(with_eplb, without)):
        assert rebalances > 0, f"{quant} rank {rank}: no rebalance ran"
        for i, ((tokens, logits), (want_tokens, want_logits)) in enumerate(zip(got, want)):
            assert tokens == want_tokens, f"{quant} rank {rank} request r{i}: {tokens} != without EPLB {want_tokens}"
            assert_bitwise_equal(logits, want_logits, f"{quant} rank {rank} request r{i}: chosen tokens' logits")
