"""Teacher-forced and generated runs of the optimized model on pool ranks, and the reference's logits for the
same tokens with its routing replayed from the optimized model's (the multi-rank proofs and the first-divergence
report compare the two)."""

from __future__ import annotations

import contextlib

import torch

from equivalence.support.compare import assert_close, max_abs, rel_l2, tolerance, top1_agreement
from equivalence.support.parallel_support import (
    RoutingStats,
    decode_metadata,
    dtype_of,
    input_tie_margins,
    on_host,
    paged_cache,
    rank_model,
    reference_model,
    routing_check,
    runner_of,
)
from fixtures.tiny import tiny_config
from reference.model import SparseMoeBlock

CONFIG = tiny_config("tiny")

VOCAB, H = CONFIG.vocab_size, CONFIG.hidden_size

GEN_TOKENS = 16


@contextlib.contextmanager
def _recording_routes(model, log: dict, inputs: dict):
    """Record each sparse layer's expert ids [T, K] and router input [T, H] (appended per forward) while the
    block runs normally."""
    patched = []
    for i, layer in enumerate(model.layers):
        route = getattr(layer.mlp, "route", None)
        if route is None:
            continue

        def recorded(hidden, _route=route, _i=i):
            weights, ids = _route(hidden)
            log.setdefault(_i, []).append(ids.clone())
            inputs.setdefault(_i, []).append(hidden.float().clone())
            return weights, ids

        layer.mlp.route = recorded
        patched.append(layer.mlp)
    try:
        yield log
    finally:
        for mlp in patched:
            del mlp.route


def teacher_forced_run(model, runner, prompts, forced, cache, table) -> dict:
    """Prefill logits, then one teacher-forced decode step per `forced` row, with each MoE layer's expert ids and
    router inputs (rows: the prefill tokens, then the decode steps; SP prefill rows gathered, padding stripped)."""
    routes, router_inputs = {}, {}
    with _recording_routes(model, routes, router_inputs):
        ids, meta, _ = runner.prefill_inputs(prompts, table)
        out = {"prefill": model(ids, meta, cache.layers)}
        lengths = [len(p) for p in prompts]
        for step, tokens in enumerate(forced):
            meta = decode_metadata(lengths, table)
            out[f"decode{step}"] = model(torch.tensor(tokens, device=table.device), meta, cache.layers)
            lengths = [n + 1 for n in lengths]

    def rows(per_layer):  # rows: prefill tokens, then decode steps
        if model.ep_scheme is None:
            return {i: torch.cat(r) for i, r in per_layer.items()}
        # the SP prefill routed this rank's own tokens: gather them (padding stripped), then the decode rows
        from optimized import distributed as comm

        total, sp = sum(len(p) for p in prompts), model.groups.attn_tp.group
        return {i: torch.cat([comm.all_gather(r[0], sp)[:total]] + r[1:]) for i, r in per_layer.items()}

    out["routes"], out["router_inputs"] = rows(routes), rows(router_inputs)
    return out


@torch.no_grad()
def _logits_task(rank, world, path, lay, dtype_name, prompts, forced, device=None):
    """Prefill logits [T, V] of the packed prompts, then teacher-forced decode logits [steps][B, V], and the
    expert ids every MoE layer picked for every token (the replay of the routing-flip-aware comparison)."""
    model = rank_model(path, lay, dtype_of(dtype_name), device)
    runner = runner_of(model)
    cache, table = paged_cache(model, [len(p) + len(forced) for p in prompts])
    out = teacher_forced_run(model, runner, prompts, forced, cache, table)
    out["ep_scheme"] = model.ep_scheme
    return on_host(out)


def assert_bf16_logits_match_replayed_reference(
    got: dict,
    name: str,
    prompts,
    forced,
    what: str,
    *,
    replayed_ref=None,
    own_ref=None,
    tol: str = "model.parallel.bfloat16",
    near_tie: str = "router_tie.model.bfloat16",
    ties_from_router_inputs: bool = False,
):
    """bf16 logits of `_logits_task` vs a reference replaying the optimized expert ids (`replayed_ref`, default
    the bf16 reference of `name`): no clear routing flip (every flip a near-tie by `near_tie`, or with
    `ties_from_router_inputs` by the bound its router input difference allows, `near_tie` the slack), prefill
    and decode logits within `tol`; agreement with `own_ref` (default the same reference) on its own routing is
    reported. Returns (optimized logits, replayed reference's logits, `own_ref`'s logits, the report), every
    request's rows concatenated."""
    own_ref = own_ref if own_ref is not None else reference_model(name, "bfloat16")
    replayed_ref = replayed_ref if replayed_ref is not None else own_ref
    stats: list[RoutingStats] = []
    inputs = got["router_inputs"] if ties_from_router_inputs else None
    replayed = _reference_logits(replayed_ref, prompts, forced, got["routes"], tolerance(near_tie).rtol, stats, inputs)
    own = _reference_logits(own_ref, prompts, forced)
    total = sum(stats, RoutingStats())
    mine = _model_logits(got, prompts, forced)
    a, r, o = (torch.cat([torch.cat(x) for x in xs]) for xs in (mine, replayed, own))
    report = (
        f"{what} bf16: {total}; replayed: max_abs {max_abs(a, r):.2e} rel_l2 {rel_l2(a, r):.2e}, top-1 "
        f"{top1_agreement(a, r):.4f}; own routing: top-1 {top1_agreement(a, o):.4f}, max_abs "
        f"{max_abs(a, o):.2e}, rel_l2 {rel_l2(a, o):.2e}"
    )
    print(report)
    assert total.clear_flips == 0, report
    for b, ((gp, gd), (wp, wd)) in enumerate(zip(mine, replayed)):
        assert_close(gp, wp, tol, f"{report}; request {b} prefill logits")
        assert_close(gd, wd, tol, f"{report}; request {b} decode logits")
    return a, r, o, report


@torch.no_grad()
def _generate_task(rank, world, path, lay, dtype_name, prompts, n):
    model = rank_model(path, lay, dtype_of(dtype_name))
    return runner_of(model).generate(prompts, n).tokens


@torch.no_grad()
def _moe_bf16_task(rank, world, path, lay, layer_idx, x):
    mlp = rank_model(path, lay, torch.bfloat16).layers[layer_idx].mlp
    x = x.to(next(mlp.parameters()).device)
    return on_host({"out": mlp(x), "ids": mlp.route(x)[1]})


@contextlib.contextmanager
def replayed_routing(ref, ids_of_layer: dict, near_tie: float, stats: list, inputs_of_layer: dict | None = None):
    """Every reference SparseMoeBlock uses the given expert ids [T, K] of its layer (T = the tokens of the
    next forward) and records how they compare with its own top-k (`routing_check`) into `stats`. With the
    optimized router's inputs [T, H] per layer, each token's near-tie bound is derived from them
    (`input_tie_margins`, slack `near_tie`) instead of being `near_tie`."""
    blocks = [(i, layer.mlp) for i, layer in enumerate(ref.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    for i, block in blocks:

        def forward(x, expert_ids=None, _block=block, _i=i):
            forced = ids_of_layer[_i].long()
            flat = x.reshape(-1, x.shape[-1])
            _, _, probs = _block.route(flat)
            bound = (
                near_tie
                if inputs_of_layer is None
                else input_tie_margins(_block.gate.weight, flat, inputs_of_layer[_i], near_tie)
            )
            stats.append(routing_check(probs, _block.top_k, forced, bound))
            return SparseMoeBlock.forward(_block, x, expert_ids=forced)

        block.forward = forward
    try:
        yield
    finally:
        for _, block in blocks:
            del block.forward


def _rows(prompts):
    off = 0
    for p in prompts:
        yield slice(off, off + len(p))
        off += len(p)


def _draw_forced(seed, batch, steps):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, batch), generator=g).tolist()


def _reference_logits(ref, prompts, forced, routes=None, near_tie=0.0, stats=None, router_inputs=None):
    """Per request: the reference's logits at the prompt positions [S, V] and at the forced steps [steps, V].

    With `routes` (the optimized model's ids per sparse layer, prefill rows then one row per request per
    step), the reference replays them; with `router_inputs` (the same rows), near-ties are derived from them.
    """
    out = []
    steps, batch = len(forced), len(prompts)
    total = sum(len(p) for p in prompts)

    def of_request(per_layer, b, rows):
        return {
            i: torch.cat([r[rows]] + [r[total + s * batch + b][None] for s in range(steps)])
            for i, r in per_layer.items()
        }

    for b, (p, rows) in enumerate(zip(prompts, _rows(prompts))):
        seq = torch.tensor([p + [forced[s][b] for s in range(steps)]])
        ctx = contextlib.nullcontext()
        if routes is not None:
            inputs = None if router_inputs is None else of_request(router_inputs, b, rows)
            ctx = replayed_routing(ref, of_request(routes, b, rows), near_tie, stats, inputs)
        with torch.no_grad(), ctx:
            logits = ref(seq)[0]
        out.append((logits[: len(p)], logits[len(p) :]))
    return out


def _model_logits(got, prompts, forced):
    steps = len(forced)
    return [
        (
            got["prefill"][rows],
            torch.stack([got[f"decode{s}"][b] for s in range(steps)]) if steps else got["prefill"][:0],
        )
        for b, rows in enumerate(_rows(prompts))
    ]
