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

import pytest
import torch
from hypothesis import strategies as st

from equivalence.support.compare import assert_close, token_agreement, tolerance
from equivalence.support.dist import get_pool
from equivalence.support.logits_runs import (
    CONFIG,
    GEN_TOKENS,
    VOCAB,
    H,
    _draw_forced,
    _generate_task,
    _logits_task,
    _model_logits,
    _moe_bf16_task,
    _reference_logits,
    assert_bf16_logits_match_replayed_reference,
)
from equivalence.support.parallel_support import (
    RoutingStats,
    reference_model,
    routing_check,
    run_property,
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
from reference.generate import greedy_generate

pytestmark = pytest.mark.distributed

WORLDS = (1, 2, 4, 8)
FIXTURES = ("tiny", "tiny-nonorm", "tiny-dense")


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


# ----------------------------------------------------------------------------------------- reference side


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
