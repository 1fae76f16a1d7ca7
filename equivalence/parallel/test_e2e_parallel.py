"""The whole optimized model, sharded over real gloo ranks, computes what the reference computes.

For world sizes 1, 2, 4, 8 (corner layouts of `strategies.corner_layouts` plus drawn layouts):
- fp32 logits: a packed prefill of 1-3 prompts of different lengths (each compared with the reference run
  on that prompt alone), then teacher-forced decode steps over the paged cache (each step's logits vs the
  reference's logits at that position), within `model.float32`;
- fp32 greedy generation of 16 tokens, 2-3 prompts of different lengths crossing 16-token blocks: token
  for token identical to the reference's greedy generation of each prompt alone;
- bf16 MoE block, routing-flip aware: a token may pick another expert set than the reference only when
  its reference top-k margin is a near-tie (`router_tie.bfloat16`); every row is then re-checked with the
  reference forced to the optimized expert ids (within `layer.bfloat16`); the flip rate is reported;
- bf16 whole model, routing-flip aware: the reference replays the optimized model's expert choice in every
  sparse layer (flips allowed on near-ties only, `router_tie.model.bfloat16`, rate reported); logits within
  `model.parallel.bfloat16`; top-1 agreement (replayed, and of the reference's own routing) reported;
- bf16 greedy generation: the optimized model's 16 tokens, teacher-forced through the reference (routing
  replayed): every token is the reference's argmax or within `model.parallel.bfloat16` of it (a near-tie);
  exact token agreement with the reference's own greedy run is reported.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import strategies as st

from equivalence.support.compare import assert_close, max_abs, rel_l2, tolerance, top1_agreement, token_agreement
from equivalence.support.dist import get_pool
from equivalence.support.parallel_support import (
    decode_metadata,
    RoutingStats,
    dtype_of,
    input_tie_margins,
    on_host,
    paged_cache,
    rank_model,
    reference_model,
    routing_check,
    run_property,
    runner_of,
    same_on_all_ranks,
)
from equivalence.support.strategies import (
    corner_layouts,
    describe_layout,
    hidden_kinds,
    hidden_states,
    layouts,
    prompt_batches,
    seeds,
)
from fixtures.checkpoints import checkpoint
from fixtures.tiny import tiny_config
from reference.generate import greedy_generate
from reference.model import SparseMoeBlock

pytestmark = pytest.mark.distributed

WORLDS = (1, 2, 4, 8)
FIXTURES = ("tiny", "tiny-nonorm", "tiny-dense")
CONFIG = tiny_config("tiny")
VOCAB, H = CONFIG.vocab_size, CONFIG.hidden_size
GEN_TOKENS = 16


def layout_cases(examples: dict[int, tuple[int, int]]):
    """(world, layout or None = drawn, examples) per world: corners get examples[w][0], drawn examples[w][1]."""
    cases = []
    for w in WORLDS:
        corner, drawn = examples[w]
        if corner:
            for lay in corner_layouts(w, CONFIG)[: 1 if w == 8 else None]:
                cases.append(
                    pytest.param(
                        w,
                        lay,
                        corner,
                        id=f"w{w}-corner-a{lay['attn_tp_size']}t{lay['moe_tp_size']}e{lay['moe_ep_size']}",
                    )
                )
        if drawn:
            cases.append(pytest.param(w, None, drawn, id=f"w{w}-drawn"))
    return cases


def _layout_strategy(world, lay):
    return st.just(lay) if lay is not None else layouts(world, CONFIG)


# ------------------------------------------------------------------------------------------ worker tasks


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


# ----------------------------------------------------------------------------------------- reference side


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


# -------------------------------------------------------------------------------------------- fp32 tests


@pytest.mark.parametrize("world, lay, n", layout_cases({1: (3, 0), 2: (1, 2), 4: (1, 2), 8: (1, 1)}))
def test_logits_prefill_and_decode_equal_reference_fp32(world, lay, n):
    def check(layout, name, prompts, steps, seed):
        path = str(checkpoint(name))
        forced = _draw_forced(seed, len(prompts), steps)
        got = same_on_all_ranks(
            get_pool(world).run(_logits_task, path, layout, "float32", prompts, forced, timeout=120), "logits"
        )
        want = _reference_logits(reference_model(name), prompts, forced)
        for b, ((gp, gd), (wp, wd)) in enumerate(zip(_model_logits(got, prompts, forced), want)):
            what = f"{describe_layout(layout)} {name} request {b} (len {len(prompts[b])})"
            assert_close(gp, wp, "model.float32", f"{what} prefill logits")
            assert_close(gd, wd, "model.float32", f"{what} decode logits ({steps} steps)")

    run_property(
        check,
        n,
        layout=_layout_strategy(world, lay),
        name=st.sampled_from(FIXTURES),
        prompts=prompt_batches(VOCAB, 1, 3, 40),
        steps=st.integers(0, 3),
        seed=seeds,
    )


@pytest.mark.parametrize("world, lay, n", layout_cases({1: (2, 0), 2: (1, 1), 4: (1, 1), 8: (1, 0)}))
def test_greedy_generation_identical_to_reference_fp32(world, lay, n):
    def check(layout, name, prompts):
        path = str(checkpoint(name))
        got = same_on_all_ranks(
            get_pool(world).run(_generate_task, path, layout, "float32", prompts, GEN_TOKENS, timeout=120), "generation"
        )
        ref = reference_model(name)
        want = [greedy_generate(ref, torch.tensor([p]), GEN_TOKENS)[0].tolist() for p in prompts]
        for b, (g, w) in enumerate(zip(got, want)):
            assert g == w, (
                f"{describe_layout(layout)} {name} request {b} (prompt length {len(prompts[b])}): "
                f"optimized {g} != reference {w}"
            )

    run_property(
        check,
        n,
        layout=_layout_strategy(world, lay),
        name=st.sampled_from(FIXTURES),
        prompts=prompt_batches(VOCAB, 2, 3, 40, distinct_lengths=True),
    )


# -------------------------------------------------------------------------------------------- bf16 tests


@pytest.mark.parametrize("world, lay, n", layout_cases({1: (3, 0), 2: (1, 1), 4: (1, 1), 8: (1, 1)}))
def test_moe_block_bf16_equals_reference_with_routing_replay(world, lay, n):
    path = str(checkpoint("tiny"))
    ref = reference_model("tiny", "bfloat16")
    near_tie = tolerance("router_tie.bfloat16").rtol

    def check(layout, tokens, kind, layer_idx, seed):
        x = hidden_states(kind, seed, tokens, H, torch.bfloat16)
        got = same_on_all_ranks(
            get_pool(world).run(_moe_bf16_task, path, layout, layer_idx, x, timeout=120), "bf16 moe"
        )
        block = ref.model.layers[layer_idx].mlp
        with torch.no_grad():
            _, _, probs = block.route(x)
            stats = routing_check(probs, block.top_k, got["ids"], near_tie)
            want = block(x, expert_ids=got["ids"].long())
        what = f"{describe_layout(layout)} bf16 {kind} x{tokens} layer {layer_idx}: {stats}"
        print(what)
        assert stats.clear_flips == 0, what
        assert_close(got["out"], want, "layer.bfloat16", f"{what}; MoE block vs reference replaying its routing")

    run_property(
        check,
        n + 1,
        layout=_layout_strategy(world, lay),
        tokens=st.integers(1, 40),
        kind=hidden_kinds,
        layer_idx=st.integers(0, CONFIG.num_hidden_layers - 1),
        seed=seeds,
    )


@pytest.mark.parametrize("world, lay, n", layout_cases({1: (2, 0), 2: (1, 1), 4: (1, 1), 8: (1, 1)}))
def test_logits_bf16_within_tolerance_routing_flip_aware(world, lay, n):
    def check(layout, name, prompts, steps, seed):
        forced = _draw_forced(seed, len(prompts), steps)
        got = same_on_all_ranks(
            get_pool(world).run(_logits_task, str(checkpoint(name)), layout, "bfloat16", prompts, forced, timeout=120),
            "bf16 logits",
        )
        assert_bf16_logits_match_replayed_reference(got, name, prompts, forced, f"{describe_layout(layout)} {name}")

    run_property(
        check,
        n,
        layout=_layout_strategy(world, lay),
        name=st.sampled_from(FIXTURES),
        prompts=prompt_batches(VOCAB, 1, 3, 40),
        steps=st.integers(0, 3),
        seed=seeds,
    )


@pytest.mark.parametrize("world, lay, n", layout_cases({1: (1, 0), 2: (1, 0), 4: (0, 1), 8: (1, 0)}))
def test_greedy_generation_bf16_picks_reference_argmax_or_near_tie(world, lay, n):
    tol = tolerance("model.parallel.bfloat16")
    near_tie = tolerance("router_tie.model.bfloat16").rtol

    def check(layout, name, prompts):
        path = str(checkpoint(name))
        ref = reference_model(name, "bfloat16")
        tokens = same_on_all_ranks(
            get_pool(world).run(_generate_task, path, layout, "bfloat16", prompts, GEN_TOKENS, timeout=120),
            "bf16 generation",
        )
        # Teacher-force the optimized tokens through the optimized model (to record its routing) and the reference.
        forced = [[tokens[b][s] for b in range(len(prompts))] for s in range(GEN_TOKENS - 1)]
        got = same_on_all_ranks(
            get_pool(world).run(_logits_task, path, layout, "bfloat16", prompts, forced, timeout=120), "bf16 logits"
        )
        stats: list[RoutingStats] = []
        replayed = _reference_logits(ref, prompts, forced, got["routes"], near_tie, stats)
        own = [greedy_generate(ref, torch.tensor([p]), GEN_TOKENS)[0] for p in prompts]
        agreement = token_agreement(torch.tensor(tokens), torch.stack(own))
        total = sum(stats, RoutingStats())
        report = (
            f"{describe_layout(layout)} {name} bf16 generation: token agreement with the reference's own "
            f"greedy run {agreement:.4f}; {total}"
        )
        print(report)
        assert total.clear_flips == 0, report
        for b, (wp, wd) in enumerate(replayed):
            ref_logits = torch.cat([wp[-1:], wd]).float()  # [GEN_TOKENS, V] at each choice
            chosen = ref_logits.gather(-1, torch.tensor(tokens[b])[:, None])[:, 0]
            best = ref_logits.max(-1).values
            slack = tol.atol + tol.rtol * best.abs()
            bad = (best - chosen > slack).nonzero().flatten().tolist()
            assert not bad, (
                f"{report}; request {b}: step(s) {bad} chose a token the reference scores "
                f"{(best - chosen)[bad].tolist()} below its argmax (allowed {slack[bad].tolist()})"
            )

    run_property(
        check,
        n,
        layout=_layout_strategy(world, lay),
        name=st.sampled_from(FIXTURES),
        prompts=prompt_batches(VOCAB, 2, 3, 40, distinct_lengths=True),
    )
