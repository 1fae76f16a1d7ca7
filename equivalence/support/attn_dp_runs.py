"""Attention-data-parallel layouts and runs on pool ranks: generation (fp32 and bf16 with its routes) and
the routes each request took, for the proofs against the reference."""

from __future__ import annotations

import torch

from equivalence.support.parallel_support import (
    dtype_of,
    generation_with_phase_log,
    on_host,
    rank_model,
)
from equivalence.support.strategies import BLOCK_SIZE

DISPATCH, COMBINE = "npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2"


def dp_layout(world: int, attn_tp: int, lmhead_tp: int = 1, embed_tp: int = 1) -> dict:
    return dict(
        world_size=world,
        attn_tp_size=attn_tp,
        moe_tp_size=1,
        moe_ep_size=world,
        embed_tp_size=embed_tp,
        lmhead_tp_size=lmhead_tp,
        prefill_opt=False,
        moe_ep_scheme="auto",
        attn_dp=True,
    )


def _describe(lay: dict) -> str:
    return (
        f"W={lay['world_size']} attn_tp={lay['attn_tp_size']} x dp={lay['world_size'] // lay['attn_tp_size']} "
        f"EP={lay['moe_ep_size']} embed_tp={lay['embed_tp_size']} lmhead_tp={lay['lmhead_tp_size']}"
    )


@torch.no_grad()
def _generate_task(rank, world, path, lay, dtype_name, prompts, n, eos):
    from optimized import distributed as comm
    from optimized.executor.model_runner import ModelRunner

    model = rank_model(path, lay, dtype_of(dtype_name))
    runner = ModelRunner(model, BLOCK_SIZE)
    with comm.count_bytes() as counter:
        res = runner.generate(
            prompts,
            n,
            eos_token_id=eos,
            return_logits=True,
            prompt_logits_positions=[list(range(len(p))) for p in prompts],
        )
    return on_host(
        {
            "tokens": res.tokens,
            "finish": res.finish_reasons,
            "logits": res.logits,
            "prompt_logits": res.prompt_logits,
            "decode_steps": len(res.decode_seconds),
            "mc2_calls": {op: counter.calls.get(op, 0) for op in (DISPATCH, COMBINE)},
            "kv_blocks": runner.pool_blocks(prompts, n),
        }
    )


@torch.no_grad()
def _generate_bf16_task(rank, world, path, lay, prompts, n, kv_cache_dtype="auto"):
    """bf16 `generate`, with every sparse layer's expert ids and router inputs per forward gathered over the job: the
    real rows of every DP group, group by group in packed order (what the reference replays; the router inputs bound
    which flips are near-ties, `input_tie_margins`)."""
    from optimized import distributed as comm
    from optimized.executor.model_runner import ModelRunner

    model = rank_model(path, lay, torch.bfloat16)
    ids_log, inputs_log, steps = {}, {}, []
    blocks = [(i, layer.mlp) for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "route")]
    for i, mlp in blocks:

        def recorded(hidden, _route=mlp.route, _i=i):
            weights, ids = _route(hidden)
            ids_log.setdefault(_i, []).append(ids.clone())
            inputs_log.setdefault(_i, []).append(hidden.float().clone())
            return weights, ids

        mlp.route = recorded
    try:
        with generation_with_phase_log(model, lambda meta, ids: steps.append(meta.dp)):
            res = ModelRunner(model, BLOCK_SIZE, kv_cache_dtype=kv_cache_dtype).generate(
                prompts, n, return_logits=True, prompt_logits_positions=[list(range(len(p))) for p in prompts]
            )
    finally:
        for _, mlp in blocks:
            del mlp.route
    a = model.groups.attn_tp.size

    def real_rows(log):  # per layer, per forward: every rank's real rows, in rank (= packed) order
        out = {}
        for i, per_forward in log.items():
            for rows, dp in zip(per_forward, steps):
                sizes = comm.all_gather(
                    torch.tensor([rows.shape[0]], device=rows.device), model.groups.world.group
                ).tolist()
                chunks = comm.all_gather(rows, model.groups.world.group, sizes=sizes).split(sizes)
                out.setdefault(i, []).append(torch.cat([c[: dp.active(r // a, r % a)] for r, c in enumerate(chunks)]))
        return out

    return on_host(
        {
            "tokens": res.tokens,
            "logits": res.logits,
            "prompt_logits": res.prompt_logits,
            "routes": real_rows(ids_log),
            "router_inputs": real_rows(inputs_log),
            "kv_heads": model.layers[0].self_attn.num_kv_heads,
        }
    )


def _request_routes(routes: dict, prompts, tokens, world: int, lay: dict, max_new_tokens: int) -> list[dict]:
    """Per request, each sparse layer's expert ids [prompt + generated - 1, K]: its prefill rows, then one row per
    decode step it ran in, found by the engine's schedule (the batch dealt over the DP groups by load in tokens,
    `scheduler.deal`, a group's rows in its requests' order, a group with nothing to run stepping one dummy row)."""
    from optimized.executor.scheduler import deal

    batch, dp = len(prompts), world // lay["attn_tp_size"]
    dealt = deal([len(p) + max_new_tokens for p in prompts], dp)
    groups = [[b for b in range(batch) if dealt[b] == d] for d in range(dp)]
    out = [{i: [] for i in routes} for _ in range(batch)]
    at = 0
    for g in groups:  # the prefill packs group by group
        for b in g:
            for i, r in routes.items():
                out[b][i].append(r[0][at : at + len(prompts[b])])
            at += len(prompts[b])
        at += 0 if g else 1  # an idle group's dummy token
    for s in range(max(len(t) for t in tokens) - 1):
        order = [r for g in groups for r in ([r for r in g if s < len(tokens[r]) - 1] or [None])]
        for row, b in enumerate(order):
            if b is not None:
                for i, r in routes.items():
                    out[b][i].append(r[1 + s][row : row + 1])
    return [{i: torch.cat(rows) for i, rows in per.items()} for per in out]
