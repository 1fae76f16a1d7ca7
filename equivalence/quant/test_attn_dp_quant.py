"""W4A8 and W8A8 (MXFP8) checkpoints under attention data parallel (`parallel_config.attn_dp`), over real gloo ranks.

Layout: world 4 as attention TP 2 x DP 2 with MoE EP 4 (`dp_layout(4, 2)`): the prefill's MoE by double routing, the
decode's by MC2 dispatch / combine of each rank's own rows with the padding masked. As the recipe does (spec
npu_ops_moe.md §1 paths B and D: `scale=None`, dispatch `quant_mode=0`) the activations travel 16-bit and every MXFP8
linear and every expert quantizes its own input, per row and per 32-block (spec mx_quant.md §9), so a padding row or
another DP group's row can never share a scale with a real token; the tests below hold that from the outside.

The batch of 3 requests fills neither DP group evenly: group 1 runs one request and a one-token dummy, its second TP
rank holds only padding in decode, and group 0's prefill rows end in padding.
- prefill and decode logits of `generate` vs the fake-quant reference (`reference/fake_quant.py`, W4A8 or W8A8)
  replaying the expert ids every DP rank chose, within `model.w4a8.bfloat16` / `model.w8a8.bfloat16` (a flip only where
  the router input difference can overturn the token's margin, as test_e2e_w4a8 / test_e2e_w8a8 excuse it), and
  `min_separation` times closer to it than to the BF16 reference replaying the same routing (so DP quantizes);
- W4A8: greedy tokens follow the fake-quant reference's own greedy run, parting only at a step where the reference
scores the
  two tokens within `model.w4a8.bfloat16` (a near-tie);
- a request's tokens and prompt / generated logits are bitwise the same whatever fills the rest of the batch (a
  dummy, another request, padding rows on its own TP rank in a batch of 5, the other DP group, the other TP rank):
  the check that fails if padding rows or another DP group's rows reach a real token's quantized rows;
- every rank runs each layer's QKV and o_proj through npu_quant_matmul in every forward and every expert grouped
  matmul on MXFP8 activations (one skipped MX point hides inside the whole-model tolerance);
- graph-mode DP decode (GraphDecoder, each DP group padded to the captured bucket) gives eager's tokens and logits.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
from equivalence.support.graph_dp_runs import DP_PROMPTS, NEW_TOKENS, _graph_dp_vs_eager_task
from equivalence.support.logits_runs import replayed_routing
from equivalence.support.parallel_support import RoutingStats, rank_model, runner_of, same_on_all_ranks
from equivalence.support.w4a8_reference import bf16_reference
from equivalence.support.w4a8_reference import fake_quant_reference as w4a8_reference
from equivalence.support.w8a8_reference import fake_quant_reference as w8a8_reference
from fixtures.checkpoints import w4a8_checkpoint, w8a8_checkpoint
from fixtures.tiny import tiny_config
from reference.generate import greedy_generate

pytestmark = pytest.mark.distributed

CONFIG = tiny_config("tiny")
WORLD, LAYOUT = 4, dp_layout(4, 2)
GEN_TOKENS = 16
CHECKPOINTS = {"w4a8": w4a8_checkpoint, "w8a8": w8a8_checkpoint}
ORACLES = {"w4a8": w4a8_reference, "w8a8": w8a8_reference}


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]


# DP group 0 runs requests 0 and 1, group 1 request 2 and a dummy.
PROMPTS = _prompts(12, (9, 17, 25))


@functools.lru_cache(maxsize=None)
def _dp_generation(scheme: str) -> dict:
    """bf16 `generate` of PROMPTS under the DP layout with the expert ids and router inputs of every DP rank."""
    out = get_pool(WORLD).run(
        _generate_bf16_task, str(CHECKPOINTS[scheme]("tiny")), LAYOUT, PROMPTS, GEN_TOKENS, timeout=300
    )
    return same_on_all_ranks(out, f"attn DP {scheme} generation")


@pytest.mark.parametrize("scheme", list(CHECKPOINTS))
def test_attn_dp_quantized_logits_match_fake_quant_reference_replaying_routing(scheme):
    """Prompt and generated logits of every request within the scheme's model entry of the fake-quant reference
    replaying the DP routing (no unexcused flip), every chosen token its argmax or within that entry, and the BF16
    reference replaying the same routing `min_separation` times farther."""
    got = _dp_generation(scheme)
    oracle, plain = ORACLES[scheme]("tiny"), bf16_reference("tiny")
    tol = f"model.{scheme}.bfloat16"
    slack = tolerance("router_tie.float32").rtol
    routes = _request_routes(got["routes"], PROMPTS, got["tokens"], WORLD, LAYOUT, GEN_TOKENS)
    inputs = _request_routes(got["router_inputs"], PROMPTS, got["tokens"], WORLD, LAYOUT, GEN_TOKENS)
    stats: list[RoutingStats] = []
    mine, replayed, unquantized = [], [], []
    for b, prompt in enumerate(PROMPTS):
        tokens = got["tokens"][b]
        seq = torch.tensor([prompt + tokens[:-1]])
        with torch.no_grad(), replayed_routing(oracle, routes[b], slack, stats, inputs[b]):
            want = oracle(seq)[0].float()
        with torch.no_grad(), replayed_routing(plain, routes[b], 1.0, []):  # the same routing, no quantization
            unquantized.append(plain(seq)[0].float())
        what = f"{_describe(LAYOUT)} {scheme} request {b}"
        assert_close(got["prompt_logits"][b], want[: len(prompt)], tol, f"{what} prompt")
        assert_close(got["logits"][b], want[len(prompt) - 1 :], tol, f"{what} generated")
        at_choice = want[len(prompt) - 1 :]  # every chosen token: the replayed argmax or a tie
        chosen = at_choice.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        best = at_choice.max(-1).values
        bad = (best - chosen > tolerance(tol).atol + tolerance(tol).rtol * best.abs()).nonzero().flatten().tolist()
        assert not bad, f"{what}: step(s) {bad} chose a token the replayed reference scores below its argmax"
        mine.append(torch.cat([got["prompt_logits"][b].float(), got["logits"][b].float()[1:]]))
        replayed.append(want)
    total = sum(stats, RoutingStats())
    a, r, u = torch.cat(mine), torch.cat(replayed), torch.cat(unquantized)
    separation = rel_l2(a, u) / max(rel_l2(a, r), 1e-30)
    report = (
        f"{_describe(LAYOUT)} {scheme.upper()} batch {len(PROMPTS)}: {total}; vs fake-quant replayed: max_abs "
        f"{max_abs(a, r):.2e} rel_l2 {rel_l2(a, r):.2e} top-1 {top1_agreement(a, r):.4f}; BF16 replaying the "
        f"routing rel_l2 {rel_l2(a, u):.2e}: {separation:.2f}x farther"
    )
    print(report)
    assert total.clear_flips == 0, report
    assert separation >= tolerance(tol).min_separation, report


def test_attn_dp_w4a8_greedy_run_leaves_the_fake_quant_reference_only_at_a_near_tie():
    """Greedy tokens under DP follow the fake-quant reference's own greedy run, and where they part, the reference
    scores the two tokens at that step within `model.w4a8.bfloat16` of each other: a near-tie the table lets flip.
    (A whole-run agreement ratio measures nothing after the first flip: on the tiny fixtures' near-flat logits it
    ranged 0.26-0.73 over five prompt sets for DP and for the TP layout alike.)"""
    got = _dp_generation("w4a8")["tokens"]
    ref, tol = w4a8_reference("tiny"), tolerance("model.w4a8.bfloat16")
    parted = []
    for b, prompt in enumerate(PROMPTS):
        want = greedy_generate(ref, torch.tensor([prompt]), GEN_TOKENS)[0].tolist()
        split = next((i for i, (x, y) in enumerate(zip(got[b], want)) if x != y), None)
        if split is None:
            continue
        with torch.no_grad():
            scores = ref(torch.tensor([prompt + want[:split]]))[0, -1].float()  # the reference at the parting step
        best, mine = scores[want[split]], scores[got[b][split]]
        parted.append((b, split, float(best - mine)))
        assert best - mine <= tol.atol + tol.rtol * best.abs(), (
            f"request {b} step {split}: DP chose {got[b][split]} (reference score {float(mine):.4f}), the fake-quant "
            f"reference {want[split]} ({float(best):.4f}): not a near-tie within model.w4a8.bfloat16"
        )
    print(f"{_describe(LAYOUT)} W4A8 greedy: parted from the fake-quant reference at (request, step, margin) {parted}")


@pytest.mark.parametrize("scheme", list(CHECKPOINTS))
def test_attn_dp_quantized_request_does_not_depend_on_padding_or_other_dp_group(scheme):
    """Requests A, B, C in three batches: [A, B, C] (C beside a dummy; in decode DP group 1's second TP rank holds only
    padding), [A, B, F, C, D] (groups of 3: F decodes beside a padding row on its TP rank) and [D, A, B, C] (B moves
    to the other DP group, A to the other TP rank). Every token and logit of A, B and C is bitwise the same in all
    three (on the CPU every kernel is row-independent and MX scales are per row, so any difference is a padding row
    or another request's row leaking into theirs). Decode ran through MC2."""
    # lengths whose budgets (+ n) the load dealing splits as told: ABC 0 2 | 1, ABFCD 0 2 4 | 1 3, DABC 0 2 | 1 3
    a, b, c, d, f = _prompts(5, (6, 17, 23, 5, 8))
    n, path = 6, str(CHECKPOINTS[scheme]("tiny"))
    batches = {"ABC": ([a, b, c], [0, 1, 2]), "ABFCD": ([a, b, f, c, d], [0, 1, 3]), "DABC": ([d, a, b, c], [1, 2, 3])}
    runs = {}
    for name, (batch, where) in batches.items():
        got = same_on_all_ranks(
            [
                {k: v for k, v in r.items() if k != "kv_blocks"}
                for r in get_pool(WORLD).run(_generate_task, path, LAYOUT, "bfloat16", batch, n, None, timeout=300)
            ],
            f"{scheme} {name}",
        )
        steps = got["decode_steps"]
        want_calls = {DISPATCH: 2 * steps * CONFIG.num_hidden_layers, COMBINE: steps * CONFIG.num_hidden_layers}
        assert got["mc2_calls"] == want_calls, f"{scheme} {name}: MC2 calls {got['mc2_calls']} != {want_calls}"
        runs[name] = {key: [got[key][i] for i in where] for key in ("tokens", "logits", "prompt_logits")}
    for name in ("ABFCD", "DABC"):
        for key, want in runs["ABC"].items():
            for req, (x, y) in enumerate(zip(runs[name][key], want)):
                label = f"{_describe(LAYOUT)} {scheme}: request {'ABC'[req]} {key} in batch {name} vs in ABC"
                if key == "tokens":
                    assert x == y, f"{label}: {x} != {y}"
                else:
                    assert torch.equal(x, y), f"{label}: max_abs {max_abs(x, y):.3e}"


class _NpuOpCounter(TorchDispatchMode):
    """Counts the `torch.ops.npu` calls by operator, and the grouped matmuls given no MX activation scale."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}
        self.gmm_16bit = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "npu":
            name = func.__name__.split(".")[0]
            self.counts[name] = self.counts.get(name, 0) + 1
            self.gmm_16bit += name == "npu_grouped_matmul" and kwargs.get("per_token_scale") is None
        return func(*args, **kwargs)


@torch.no_grad()
def _mx_calls_task(rank, world, path, lay, prompts, n):
    model = rank_model(path, lay, torch.bfloat16)
    with _NpuOpCounter() as counter:
        steps = len(runner_of(model).generate(prompts, n).decode_seconds)
    return {"counts": counter.counts, "gmm_16bit": counter.gmm_16bit, "forwards": 1 + steps}


@pytest.mark.parametrize("scheme", list(CHECKPOINTS))
def test_attn_dp_quantized_step_runs_every_linear_and_expert_in_mx(scheme):
    """The DP step calls the layers' quant methods, not a 16-bit shortcut: on every rank, each layer's merged QKV and
    row-parallel o_proj run npu_quant_matmul in every forward (prefill and each decode step), and every expert grouped
    matmul takes MXFP8 activations (per_token_scale). The whole-model tolerance alone cannot see one skipped MX
    point (an o_proj on 16-bit activations stayed within model.w4a8.bfloat16 when planted)."""
    prompts = _prompts(5, (6, 17, 23))
    out = get_pool(WORLD).run(_mx_calls_task, str(CHECKPOINTS[scheme]("tiny")), LAYOUT, prompts, 3, timeout=300)
    for rank, r in enumerate(out):
        what = f"{_describe(LAYOUT)} {scheme} rank {rank}: {r}"
        assert r["counts"].get("npu_quant_matmul") == 2 * CONFIG.num_hidden_layers * r["forwards"], what
        assert r["counts"].get("npu_grouped_matmul", 0) > 0 and r["gmm_16bit"] == 0, what


@pytest.mark.parametrize("scheme", list(CHECKPOINTS))
def test_graph_decode_under_attention_dp_quantized_equals_eager(scheme):
    """Graph-mode DP + MC2 decode of a quantized checkpoint (attention TP 2 x DP 2, EP 4, bf16, aot_eager: dynamo
    capture and functionalization without C++ codegen, which two cores cannot afford for four ranks): each DP group
    pads to the bucket of the largest (3 -> 4; the padding rows are quantized and exchanged as real rows of the
    graph, their results dropped), one graph, no break, and eager's tokens and logits bitwise (aot_eager runs eager's
    kernels; MX scales are per row, so the padding cannot move a real row)."""
    results = get_pool(WORLD).run(
        _graph_dp_vs_eager_task,
        str(CHECKPOINTS[scheme]("tiny")),
        LAYOUT,
        "aot_eager",
        DP_PROMPTS,
        NEW_TOKENS,
        torch.bfloat16,
        timeout=300,
    )
    for rank, r in enumerate(results):
        (tokens, logits), (want_tokens, want_logits) = r["graph"], r["eager"]
        assert tokens == want_tokens, f"{scheme} rank {rank}: graph {tokens} != eager {want_tokens}"
        for i, (got, want) in enumerate(zip(logits, want_logits)):
            assert torch.equal(got, want), f"{scheme} rank {rank} request {i}: graph vs eager {max_abs(got, want)=}"
        c = r["captured"]
        assert c["graphs"] == 1 and c["breaks"] == 0, f"{scheme} rank {rank}: {c}"
        # group 0 runs 3 requests, group 1 two (its dummy never decodes): both pad to the bucket of 3, i.e. 4
        assert c["padding"] == ({3: 4} if rank < 2 else {2: 4}), f"{scheme} rank {rank}: {c}"
