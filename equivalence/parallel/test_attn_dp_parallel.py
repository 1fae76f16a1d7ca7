"""Attention data parallel (`parallel_config.attn_dp`: the batch split over attn_dp_size = world / attn_tp DP groups,
all-gather before merged_qkv_proj and reduce-scatter after o_proj inside each DP group, MoE expert parallel over
every rank, lm_head over each DP group's tokens gathered inside its attention TP group, the chosen ids shared)
equals the reference, over real gloo ranks.

Layouts: world 4 as attention TP 2 x DP 2 (EP 4), world 8 as TP 4 x DP 2 (KV heads replicated) and TP 2 x DP 4 (EP 8),
TP 2 x DP 2 with a vocab-parallel embedding inside each DP group and an lm_head vocab-parallel over all four ranks,
and pure DP (TP 1 x DP 4, no gather at all) with a vocab-parallel lm_head spanning two DP groups. Every case runs the
engine through `ModelRunner.generate`:
- fp32: batches of 1-5 requests (dividing the DP size and not: each request runs in the DP group of least load in
  tokens when it is added, a group with nothing to run steps a dummy token into the null block), a drawn EOS id (a
  token the reference generates for a drawn request at a drawn step) so requests finish at different steps and DP
  groups run uneven batches or dummy rows; the generated tokens are exactly the reference's greedy tokens
  (16 unless EOS), the finish reasons match, and every returned logit (each prompt position, and each generated
  token's) is within `model.float32` of the reference's;
- every decode step of every MoE layer went through one MC2 dispatch / combine pair and the prefill through none
  (the recipe: double routing in prefill, MC2 in decode);
- bf16, routing-flip aware: the reference replays the expert ids every DP rank chose (gathered over the job; a flip
  only on a near-tie, `router_tie.model.bfloat16`), prompt and generated logits within `model.parallel.bfloat16`,
  every generated token the replayed reference's argmax or within that tolerance; top-1 agreement with the
  reference's own routing and the flip rate reported;
- the paged KV cache of each DP rank holds only its DP group's requests (and its dummy).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from equivalence.support.attn_dp_runs import (
    COMBINE,
    DISPATCH,
    _describe,
    _generate_bf16_task,
    _generate_task,
    _request_routes,
    dp_layout,
)
from equivalence.support.compare import assert_close, max_abs, rel_l2, tolerance, top1_agreement
from equivalence.support.dist import get_pool
from equivalence.support.logits_runs import replayed_routing
from equivalence.support.parallel_support import (
    RoutingStats,
    rank_model,
    reference_model,
    run_property,
    same_on_all_ranks,
)
from equivalence.support.strategies import BLOCK_SIZE, prompt_length
from fixtures.checkpoints import checkpoint
from fixtures.tiny import tiny_config
from reference.generate import greedy_generate

pytestmark = pytest.mark.distributed

CONFIG = tiny_config("tiny")
GEN_TOKENS = 16


CASES = [
    pytest.param(4, dp_layout(4, 2), id="w4-tp2xdp2-ep4"),
    pytest.param(4, dp_layout(4, 2, lmhead_tp=4, embed_tp=2), id="w4-tp2xdp2-ep4-embed2-lmhead4"),
    pytest.param(4, dp_layout(4, 1, lmhead_tp=2), id="w4-tp1xdp4-ep4-lmhead2"),
    pytest.param(8, dp_layout(8, 4), id="w8-tp4xdp2-ep8"),
    pytest.param(8, dp_layout(8, 2), id="w8-tp2xdp4-ep8"),
]


def _reference_run(ref, prompt, n, eos):
    """(tokens up to and including the first EOS, logits [len(prompt) + len(tokens) - 1, V] of the whole run)."""
    tokens = greedy_generate(ref, torch.tensor([prompt]), n)[0].tolist()
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + tokens[:-1]]))[0]
    return tokens, logits


# Batch sizes first in the order hypothesis tries them: not dividing the DP size, dividing it, fewer than DP groups.
BATCHES = (5, 4, 3, 1, 2)


@st.composite
def dp_prompts(draw) -> list[list[int]]:
    """A batch of BATCHES' sizes, prompt lengths biased to the 16-token block boundaries, seeded ids."""
    lengths = [draw(prompt_length(40)) for _ in range(draw(st.sampled_from(BATCHES)))]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]


@st.composite
def _eos_choice(draw, batch: int):
    """(request, step) whose reference token becomes the EOS id, or None (every request runs 16 tokens)."""
    if draw(st.integers(0, 3)) == 3:
        return None
    return draw(st.integers(0, batch - 1)), draw(st.integers(0, GEN_TOKENS - 2))


@pytest.mark.parametrize("world, lay", CASES)
def test_attn_dp_generation_equals_reference_fp32(world, lay):
    path = str(checkpoint("tiny"))
    ref = reference_model("tiny")

    def check(prompts, data):
        pick = data.draw(_eos_choice(len(prompts)))
        eos = None if pick is None else greedy_generate(ref, torch.tensor([prompts[pick[0]]]), GEN_TOKENS)[0][pick[1]]
        eos = None if eos is None else int(eos)
        got = same_on_all_ranks(
            [
                {k: v for k, v in r.items() if k != "kv_blocks"}
                for r in get_pool(world).run(
                    _generate_task, path, lay, "float32", prompts, GEN_TOKENS, eos, timeout=180
                )
            ],
            "attn DP generation",
        )
        what = f"{_describe(lay)} batch {len(prompts)} eos {eos}"
        for b, prompt in enumerate(prompts):
            want, logits = _reference_run(ref, prompt, GEN_TOKENS, eos)
            assert got["tokens"][b] == want, f"{what} request {b}: optimized {got['tokens'][b]} != reference {want}"
            assert got["finish"][b] == ("eos" if eos is not None and want[-1] == eos else "length"), what
            assert_close(got["prompt_logits"][b], logits[: len(prompt)], "model.float32", f"{what} request {b} prompt")
            assert_close(got["logits"][b], logits[len(prompt) - 1 :], "model.float32", f"{what} request {b} generated")
        steps = got["decode_steps"]
        assert steps == max(len(t) for t in got["tokens"]) - 1, f"{what}: {steps} decode steps"
        want_calls = {DISPATCH: 2 * steps * CONFIG.num_hidden_layers, COMBINE: steps * CONFIG.num_hidden_layers}
        assert got["mc2_calls"] == want_calls, f"{what}: MC2 calls {got['mc2_calls']} != {want_calls}"
        worst = max(
            max_abs(g, _reference_run(ref, p, GEN_TOKENS, eos)[1][len(p) - 1 :]) for g, p in zip(got["logits"], prompts)
        )
        lengths = [len(t) for t in got["tokens"]]
        print(f"{what}: tokens {lengths}, finish {got['finish']}, max_abs vs reference {worst:.2e}")

    run_property(check, 4, prompts=dp_prompts(), data=st.data())


def test_attn_dp_kv_cache_holds_only_the_dp_groups_requests():
    lay = dp_layout(4, 2)
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 17]  # dealt by load in tokens: group 0: 0, 2; group 1: 1
    out = get_pool(4).run(_generate_task, str(checkpoint("tiny")), lay, "float32", prompts, 4, None, timeout=180)
    blocks = [r["kv_blocks"] for r in out]
    per_group = [sum(-(-(len(p) + 4) // BLOCK_SIZE) for p in g) for g in (prompts[0::2], prompts[1::2])]
    assert per_group == [1 + 2, 3]
    assert blocks == [1 + max(per_group)] * 4, blocks  # each group's pool: its own requests, the null block


@torch.no_grad()
def _non_finite_task(rank, world, path, lay, prompts):
    from optimized.executor.model_runner import ModelRunner, NonFiniteLogitsError

    model = rank_model(path, lay, torch.float32)
    runner, calls = ModelRunner(model, BLOCK_SIZE), []
    forward = model.forward

    def nan_for_request_1_at_decode_step_2(ids, meta, caches, *a, **kw):
        logits = forward(ids, meta, caches, *a, **kw)
        calls.append(meta.is_prefill)
        if calls.count(False) == 2 and model.groups.dp_rank == 0:
            logits[1, 7] = float("nan")  # DP group 0's ranks hold its logits: row 1 is request 2's
        return logits

    model.forward = nan_for_request_1_at_decode_step_2  # the model is cached per worker: restored below
    try:
        runner.generate(prompts, 6)
    except NonFiniteLogitsError as e:
        return str(e)
    finally:
        del model.forward
    return None


def test_attn_dp_non_finite_logits_stop_generation_naming_step_and_request():
    """Under attention DP too, a NaN logits row of a running request stops generation on every rank with the step
    and the request named (not a -1 token or token 0 forever)."""
    prompts = [[1, 2, 3], [4, 5, 6], [6, 7, 8, 9]]  # dealt by load in tokens (budgets 9, 9, 10): groups 0, 2 | 1
    out = get_pool(4).run(_non_finite_task, str(checkpoint("tiny")), dp_layout(4, 2), prompts, timeout=180)
    for message in out:
        assert message is not None and message.startswith(
            "decode step 2 produced non-finite logits (NaN or inf) for request 2, after 2 generated token(s)"
        ), out


@pytest.mark.parametrize("world, lay", [CASES[0], CASES[3]])
def test_attn_dp_bf16_within_tolerance_routing_flip_aware(world, lay):
    """bf16 `generate` vs the bf16 reference replaying the optimized expert ids (a flip only on a near-tie,
    `router_tie.model.bfloat16`): prompt and generated logits within `model.parallel.bfloat16`, every generated token
    the replayed reference's argmax or within that tolerance of it; top-1 agreement with the reference's own routing
    and the flip rate reported."""
    path = str(checkpoint("tiny"))
    ref = reference_model("tiny", "bfloat16")
    tol = tolerance("model.parallel.bfloat16")
    near_tie = tolerance("router_tie.model.bfloat16").rtol

    def check(prompts):
        got = same_on_all_ranks(
            get_pool(world).run(_generate_bf16_task, path, lay, prompts, GEN_TOKENS, timeout=180),
            "attn DP bf16 generation",
        )
        stats: list[RoutingStats] = []
        mine, replayed, own = [], [], []
        for b, (prompt, ids_of_layer) in enumerate(
            zip(prompts, _request_routes(got["routes"], prompts, got["tokens"], world, lay, GEN_TOKENS))
        ):
            tokens = got["tokens"][b]
            seq = torch.tensor([prompt + tokens[:-1]])
            with torch.no_grad(), replayed_routing(ref, ids_of_layer, near_tie, stats):
                want = ref(seq)[0].float()
            with torch.no_grad():
                own.append(ref(seq)[0].float()[len(prompt) - 1 :])
            what = f"{_describe(lay)} bf16 request {b}"
            assert_close(got["prompt_logits"][b], want[: len(prompt)], "model.parallel.bfloat16", f"{what} prompt")
            assert_close(got["logits"][b], want[len(prompt) - 1 :], "model.parallel.bfloat16", f"{what} generated")
            at_choice = want[len(prompt) - 1 :]
            chosen = at_choice.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
            best = at_choice.max(-1).values
            slack = tol.atol + tol.rtol * best.abs()
            bad = (best - chosen > slack).nonzero().flatten().tolist()
            assert not bad, f"{what}: step(s) {bad} chose a token the replayed reference scores below its argmax"
            mine.append(got["logits"][b].float())
            replayed.append(at_choice)
        total = sum(stats, RoutingStats())
        a, r, o = torch.cat(mine), torch.cat(replayed), torch.cat(own)
        report = (
            f"{_describe(lay)} bf16 batch {len(prompts)}: {total}; replayed max_abs {max_abs(a, r):.2e}, "
            f"top-1 {top1_agreement(a, r):.4f}; own routing top-1 {top1_agreement(a, o):.4f}"
        )
        print(report)
        assert total.clear_flips == 0, report

    run_property(check, 2, prompts=dp_prompts())


@torch.no_grad()
def _gathers_task(rank, world, path, lay, prompts, n):
    """(group size, dtype, shape) of every all_gather a plain DP `generate` issues (no logits asked for)."""
    from optimized.distributed import collectives
    from optimized.executor.model_runner import ModelRunner

    model = rank_model(path, lay, torch.float32)
    seen, all_gather = [], collectives.all_gather

    def recorded(x, group, *a, **k):
        seen.append((1 if group is None else torch.distributed.get_world_size(group), str(x.dtype), tuple(x.shape)))
        return all_gather(x, group, *a, **k)

    collectives.all_gather = recorded
    try:
        tokens = ModelRunner(model, BLOCK_SIZE).generate(prompts, n).tokens
    finally:
        collectives.all_gather = all_gather
    return {"seen": seen, "tokens": tokens}


def test_attn_dp_shares_chosen_ids_not_logits():
    """The recipe's DP lm_head: no vocab-wide tensor crosses ranks in a plain generate (hidden rows are gathered inside
    the attention TP group, the engine's packed read vector of chosen ids over the DP group: one float32 value per
    row of a greedy step without logprobs); gathering every group's logits over the job, as this build once did,
    fails here."""
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    out = get_pool(4).run(_gathers_task, str(checkpoint("tiny")), dp_layout(4, 2), prompts, 3, timeout=180)
    for rank, r in enumerate(out):
        wide = [s for s in r["seen"] if s[0] > 1 and s[2][-1] == CONFIG.vocab_size]  # (a 1-rank gather is a no-op)
        assert not wide, f"rank {rank}: vocab-wide all_gathers {wide}"
        ids = [s for s in r["seen"] if s[0] > 1 and len(s[2]) == 1]
        assert ids and all(size == 2 and dtype == "torch.float32" and shape[0] <= 2 for size, dtype, shape in ids), (
            f"rank {rank}: id shares {ids} (DP 2: a group of 2, at most 2 rows per group)"
        )
    same_on_all_ranks([r["tokens"] for r in out], "tokens")


def _cached_reference(ref, prompt, tokens, ids_of_layer, near_tie, stats, kv_heads_per_scale):
    """The reference through its own cache (per-token FP8 with `kv_heads_per_scale`, None: 16-bit): the prompt in
    one forward, then each generated token, replaying the DP run's routing; the logits each token was chosen from."""
    from reference.fake_quant import fake_quantize_kv_cache

    model = ref if kv_heads_per_scale is None else fake_quantize_kv_cache(ref, kv_heads_per_scale)
    cache, out, at = model.new_cache(), [], 0
    try:
        for ids in [prompt] + [[t] for t in tokens[:-1]]:
            rows = {i: r[at : at + len(ids)] for i, r in ids_of_layer.items()}
            with torch.no_grad(), replayed_routing(ref, rows, near_tie, stats):
                out.append(model(torch.tensor([ids]), cache)[0][-1:].float())
            at += len(ids)
    finally:
        if kv_heads_per_scale is not None:
            del ref.new_cache
    return torch.cat(out)


@pytest.mark.parametrize("world, lay", [CASES[0]])
def test_attn_dp_fp8_kv_cache_within_the_fp8_kv_reference(world, lay):
    """The per-token FP8 KV cache under attention DP (TP 2 x DP 2, EP 4, MC2 decode; bf16 weights): every generated
    token's logits within `model.parallel.bfloat16` of the reference with the same FP8 KV cache rule (one scale per
    token over the KV heads a rank holds) replaying the DP routing, and `model.fp8_kv.bfloat16` min_separation times
    closer to it than to the 16-bit-cache reference (a cache that silently stayed 16-bit under DP fails here)."""
    path = str(checkpoint("tiny"))
    ref = reference_model("tiny", "bfloat16")
    near_tie = tolerance("router_tie.model.bfloat16").rtol
    prompts = [[1, 2, 3, 4, 5, 6, 7], list(range(20, 39)), [9, 8, 7]]
    got = same_on_all_ranks(
        get_pool(world).run(_generate_bf16_task, path, lay, prompts, GEN_TOKENS, "float8", timeout=240),
        "attn DP fp8 kv generation",
    )
    stats: list[RoutingStats] = []
    near = far = 0.0
    for b, (prompt, ids_of_layer) in enumerate(
        zip(prompts, _request_routes(got["routes"], prompts, got["tokens"], world, lay, GEN_TOKENS))
    ):
        tokens = got["tokens"][b]
        fp8 = _cached_reference(ref, prompt, tokens, ids_of_layer, near_tie, stats, got["kv_heads"])
        plain = _cached_reference(ref, prompt, tokens, ids_of_layer, near_tie, [], None)
        mine = got["logits"][b].float()
        assert_close(mine[1:], fp8[1:], "model.parallel.bfloat16", f"{_describe(lay)} FP8 KV request {b}")
        near, far = max(near, rel_l2(mine[1:], fp8[1:])), max(far, rel_l2(mine[1:], plain[1:]))
    total = sum(stats, RoutingStats())
    report = f"{_describe(lay)} FP8 KV: {total}; decode rel_l2 vs FP8-KV reference {near:.3e}, vs 16-bit {far:.3e}"
    print(report)
    assert total.clear_flips == 0, report
    assert far >= tolerance("model.fp8_kv.bfloat16").min_separation * near, report


def test_attn_dp_kv_pool_blocks_is_per_dp_group_and_refused_when_too_small():
    """kv_pool_blocks under attention DP: each DP group's own pool (requests dealt by load in tokens), a pool too small
    for a group's requests refused naming the per-group need."""
    out = get_pool(4).run(_pool_task, str(checkpoint("tiny")), dp_layout(4, 2), timeout=180)
    for rank, (blocks, error) in enumerate(out):
        assert blocks == 6, f"rank {rank}: pool of {blocks} blocks, kv_pool_blocks 6 asked"
        assert error.startswith(
            "kv_pool_blocks=3 is too small: these requests need 5 blocks of 16 tokens per DP group"
        ), error


@torch.no_grad()
def _pool_task(rank, world, path, lay):
    from optimized.executor.engine import Engine
    from optimized.executor.model_runner import ModelRunner

    model = rank_model(path, lay, torch.float32)
    sizes = []
    init = Engine.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        sizes.append(self.cache.num_blocks)

    Engine.__init__ = record
    try:
        # budgets 23, 32, 23: group 0: requests 0 and 2 (2 + 2 blocks + null); group 1: 1 (2 blocks + null)
        prompts = [[1] * 20, [2] * 29, [3] * 20]
        ModelRunner(model, BLOCK_SIZE, kv_pool_blocks=6).generate(prompts, 3)
        try:
            ModelRunner(model, BLOCK_SIZE, kv_pool_blocks=3).generate(prompts, 3)
            error = None
        except ValueError as e:
            error = str(e)
    finally:
        Engine.__init__ = init
    return sizes[0], error
