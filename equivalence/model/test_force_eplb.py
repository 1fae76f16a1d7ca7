"""model_config.force_eplb (the recipe's forced balanced routing): every MoE layer routes to the balanced expert ids of
optimized/layers/force_eplb.py, paired with the gate's own top-k weights, and otherwise computes what the reference
computes.

- The rule, restated here independently (per slot: which EP rank, which of its experts), equals `BalancedRouting` for
  a grid of sizes and rows (top_k above and below the EP degree, the small- and large-batch decode branches), and
  gives valid ids: in range, distinct within a row; the start-up checks refuse what it cannot route.
- Over real gloo ranks, for TP (world 2), EP (world 2 with the SP prefill, world 4 with the TP prefill; MC2 decode)
  and attention DP (world 4: attn TP 2 x DP 2, EP 4), prefill and decode of `generate`:
  (1) the expert ids every MoE layer hands its token exchange on every rank are the rule's for that rank's rows;
  (2) the slots each rank dispatches are balanced: per expert within one (max - min <= 1) for the prefill rule and
      the moe_tp > 1 / one-step decode rules, per EP rank within one for the small-batch MC2 decode rule; over the job
      per expert within one where one copy of the rows is routed (TP);
  (3) the fp32 logits (every prompt position and every generated token's) equal the reference's replaying those ids
      with its own top-k weights (the recipe's pairing), within `model.float32`.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from equivalence.support.attn_dp_runs import _request_routes, dp_layout
from equivalence.support.compare import assert_close
from equivalence.support.dist import get_pool
from equivalence.support.parallel_support import generation_with_phase_log, on_host, reference_model, same_on_all_ranks
from equivalence.support.parallel_support import test_device as model_device
from equivalence.support.strategies import BLOCK_SIZE
from fixtures.checkpoints import checkpoint
from fixtures.tiny import tiny_config
from reference.model import SparseMoeBlock

CONFIG = tiny_config("tiny")
E, K = CONFIG.num_experts, CONFIG.num_experts_per_tok
GEN_TOKENS = 4
PROMPTS = [[3, 1, 4, 1, 5], list(range(20, 31)), [9, 2, 6]]  # 19 tokens: uneven over 2 and 4 ranks; B = 3


def _layout(world, attn_tp, moe_tp, prefill_opt):
    return dict(
        world_size=world,
        attn_tp_size=attn_tp,
        moe_tp_size=moe_tp,
        moe_ep_size=world // moe_tp,
        embed_tp_size=1,
        lmhead_tp_size=1,
        prefill_opt=prefill_opt,
        moe_ep_scheme="auto",
        attn_dp=False,
    )


CASES = [
    pytest.param(_layout(2, 2, 2, False), id="w2-tp2"),  # TP prefill and decode (moe_tp > 1)
    pytest.param(_layout(2, 2, 1, True), id="w2-sp-ep2"),  # SP prefill (own rows), MC2 decode
    pytest.param(_layout(4, 4, 1, False), id="w4-tpprefill-ep4"),  # TP prefill (every rank's rows), MC2 decode
    pytest.param(dp_layout(4, 2), id="w4-tp2xdp2-ep4"),  # attention DP: own rows, prefill and decode
]


# ------------------------------------------------------------------------------------ the rule, restated


def rule_prefill(rows: int, g: int) -> list[list[int]]:
    """The recipe's prefill list: slot j of the rank's rows gets expert (j + g) % E."""
    return [[(r * K + k + g) % E for k in range(K)] for r in range(rows)]


def rule_decode(rows: int, g: int, moe_tp: int, ep: int) -> list[list[int]]:
    """Decode: moe_tp > 1 deals slots round-robin over the EP ranks (bottom experts first); moe_tp 1 with few slots
    (rows*K < E, ep > 1) sends slot j to EP rank (j + g//L*L) % ep, its expert (g + k // ep) % L (k: the slot in its
    row); otherwise the prefill list."""
    L = E // ep
    out = []
    for r in range(rows):
        row = []
        for k in range(K):
            j = r * K + k
            if moe_tp > 1:
                row.append((j % ep) * L + j // ep)
            elif rows * K < E and ep > 1:
                row.append(((j + g // L * L) % ep) * L + (g + k // ep) % L)
            else:
                row.append((j + g) % E)
        out.append(row)
    return out


def _routing(moe_tp, ep, rank):
    from optimized.layers.force_eplb import BalancedRouting

    ranks = tuple(range(rank % moe_tp, moe_tp * ep, moe_tp))  # the strided moe_ep group of `rank`
    return BalancedRouting(E, K, moe_tp, SimpleNamespace(size=ep, ranks=ranks, rank=ranks.index(rank)))


@pytest.mark.parametrize("moe_tp, ep", [(1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (2, 1), (2, 2), (4, 4)])
def test_balanced_ids_follow_the_rule_and_are_valid(moe_tp, ep):
    from optimized.layers.force_eplb import EP_SPLIT, JOB, OWN, EplbRows

    world = moe_tp * ep
    for rank in range(world):
        bal = _routing(moe_tp, ep, rank)
        for rows in range(1, 2 * E // K + 3):
            cases = {
                "prefill own": (EplbRows(False, OWN), rule_prefill(rows, rank)),
                "prefill job": (EplbRows(False, JOB), rule_prefill(rows, 0)),
            }
            if moe_tp == 1:
                cases["decode own"] = (EplbRows(True, OWN), rule_decode(rows, rank, moe_tp, ep))
                n = -(-rows // ep)  # EP split: rows [e*n, (e+1)*n) are EP rank e's (global rank e*moe_tp + offset)
                split = [rule_decode(n, rank % moe_tp + (t // n) * moe_tp, moe_tp, ep)[t % n] for t in range(rows)]
                cases["decode ep split"] = (EplbRows(True, EP_SPLIT), split)
            elif rows * K <= E:
                cases["decode job"] = (EplbRows(True, JOB), rule_decode(rows, rank, moe_tp, ep))
            for what, (where, want) in cases.items():
                got = bal(rows, where, torch.device("cpu"))
                label = f"moe_tp {moe_tp} ep {ep} rank {rank} rows {rows} {what}"
                assert got.dtype == torch.int32 and tuple(got.shape) == (rows, K), label
                assert got.tolist() == want, f"{label}: {got.tolist()} != {want}"
                assert all(len(set(r)) == K and all(0 <= e < E for e in r) for r in want), f"{label}: invalid {want}"


def test_moe_tp_decode_batch_beyond_the_rule_is_refused():
    from optimized.layers.force_eplb import EplbRows

    bal = _routing(2, 1, 0)
    with pytest.raises(
        ValueError,
        match=r"force_eplb: with moe_tp_size > 1 .* B \* num_experts_per_tok must be <= "
        r"num_experts: B = 5",
    ):
        bal(E // K + 1, EplbRows(decode=True), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"force_eplb: needs num_experts_per_tok \(17\) <= num_experts \(16\)"):
        from optimized.layers.force_eplb import BalancedRouting

        BalancedRouting(E, E + 1, 1, SimpleNamespace(size=1, ranks=(0,), rank=0))


# ------------------------------------------------------------------------------------ the model, over gloo ranks

_MODELS: dict = {}


def _forced_model(path, lay):
    """This rank's fp32 model with force_eplb (one per layout and checkpoint in each worker)."""
    key = (path, tuple(sorted(lay.items())))
    if key not in _MODELS:
        from optimized.distributed import ParallelState
        from optimized.model_loader.build import load_model

        _MODELS.clear()
        _MODELS[key] = load_model(
            path, parallel=ParallelState.build(**lay), dtype=torch.float32, device=str(model_device()), force_eplb=True
        )
    return _MODELS[key]


@torch.no_grad()
def _forced_task(rank, world, path, lay, prompts, n):
    """`generate` with force_eplb; every sparse layer's expert ids as handed to its token exchange, per forward, and
    each forward's (is_prefill, DP sizes)."""
    from optimized.executor.model_runner import ModelRunner
    from optimized.layers.moe import Qwen3MoeSparseMoeBlock

    model = _forced_model(path, lay)
    ids_log, steps = {}, []
    blocks = [(i, layer.mlp) for i, layer in enumerate(model.layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)]
    for i, block in blocks:

        def forward(hidden, exchange=None, router_in=None, eplb_rows=None, _b=block, _i=i):
            ex = exchange or _b.moe_infer_tp

            def recording(experts, x, idx, w):
                ids_log.setdefault(_i, []).append(idx.clone())
                return ex(experts, x, idx, w)

            return Qwen3MoeSparseMoeBlock.forward(_b, hidden, recording, router_in, eplb_rows)

        block.forward = forward
    try:
        with generation_with_phase_log(model, lambda meta, ids: steps.append((meta.is_prefill, meta.dp, ids.shape[0]))):
            res = ModelRunner(model, BLOCK_SIZE).generate(
                prompts, n, return_logits=True, prompt_logits_positions=[list(range(len(p))) for p in prompts]
            )
    finally:
        for _, block in blocks:
            del block.forward
    return on_host(
        {
            "tokens": res.tokens,
            "logits": res.logits,
            "prompt_logits": res.prompt_logits,
            "ids": ids_log,
            "steps": steps,
            "dp_rank": model.groups.dp_rank,
            "tp_rank": model.groups.attn_tp.rank,
        }
    )


def _expected_and_sent(lay, results, layer, f):
    """For forward f of `layer`: per rank (the ids it must have used, the rows it dispatches: [(source, ids)]), and
    the ids of every real token of the forward in packed order (DP: group by group), what the reference replays, and
    the rows one rank's decode rule is built for."""
    world, a, moe_tp = lay["world_size"], lay["attn_tp_size"], lay["moe_tp_size"]
    ep = world // moe_tp
    prefill, dp, tokens = results[0]["steps"][f]
    want, sources, real, rule_rows = [], [], [], tokens
    for g, res in enumerate(results):
        got = res["ids"][layer][f]
        if dp is not None:  # attention DP: own rows
            active = dp.active(res["dp_rank"], res["tp_rank"])
            rows = rule_rows = max(active, 1) if prefill else dp.rows  # prefill: the real rows only reach the MoE
            want.append(rule_prefill(rows, g) if prefill else rule_decode(rows, g, moe_tp, ep))
            sources.append(got[:active].tolist())
            real.append(got[:active])
        elif prefill and lay["prefill_opt"]:  # SP prefill: own n rows, the tail padded
            n = -(-tokens // a)
            want.append(rule_prefill(n, g))
            sources.append(got.tolist())
            real.append(got[: max(0, min(n, tokens - g * n))])
        elif prefill or moe_tp > 1:  # every rank the same rows, summed over ranks
            want.append(rule_prefill(tokens, 0) if prefill else rule_decode(tokens, g, moe_tp, ep))
            if g == 0:
                sources.append(got.tolist())
                real.append(got)
        else:  # MC2 decode: EP rank e dispatches its slice
            n = rule_rows = -(-tokens // ep)
            want.append([rule_decode(n, t // n, moe_tp, ep)[t % n] for t in range(tokens)])
            sources.append(got[g * n : (g + 1) * n].tolist())
            real.append(got[g * n : (g + 1) * n])
    return want, sources, torch.cat(real), rule_rows


def _balanced(counts: list[int]) -> bool:
    return max(counts) - min(counts) <= 1


@contextlib.contextmanager
def _replaying(ref, ids_of_layer: dict):
    """Every reference SparseMoeBlock routes to the given ids [T, K], weighted by its own top-k weights (the recipe's
    pairing: the gate's k-th weight with the k-th forced id). The reference's `expert_ids=` would weight them by
    their own probabilities instead."""
    blocks = [(i, layer.mlp) for i, layer in enumerate(ref.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    for i, block in blocks:

        def route(x, expert_ids=None, _block=block, _i=i):
            weights, _, probs = SparseMoeBlock.route(_block, x)  # own top-k weights, sorted descending
            return weights, ids_of_layer[_i].long(), probs

        block.route = route
    try:
        yield
    finally:
        for _, block in blocks:
            del block.route


@pytest.mark.distributed
@pytest.mark.parametrize("lay", CASES)
def test_force_eplb_ids_balanced_and_logits_equal_reference_fp32(lay):
    world, moe_tp = lay["world_size"], lay["moe_tp_size"]
    ep = world // moe_tp
    results = get_pool(world).run(_forced_task, str(checkpoint("tiny")), lay, PROMPTS, GEN_TOKENS, timeout=180)
    got = same_on_all_ranks([{k: r[k] for k in ("tokens", "logits", "prompt_logits")} for r in results], "generation")
    layers = sorted(results[0]["ids"])
    forwards = len(results[0]["steps"])
    assert layers and forwards == GEN_TOKENS and all(len(r["ids"][i]) == forwards for r in results for i in layers)
    routes = {}
    for i in layers:
        for f in range(forwards):
            want, sources, real, rule_rows = _expected_and_sent(lay, results, i, f)
            prefill = results[0]["steps"][f][0]
            what = f"{lay} layer {i} {'prefill' if prefill else f'decode step {f - 1}'}"
            for g, res in enumerate(results):  # (1) the rule's ids on every rank
                assert res["ids"][i][f].tolist() == want[g], (
                    f"{what} rank {g}: {res['ids'][i][f].tolist()} != {want[g]}"
                )
            # (2) balance of what each rank dispatches, and of the job where one copy of the rows is routed
            small_mc2 = not prefill and moe_tp == 1 and ep > 1 and rule_rows * K < E
            for g, rows in enumerate(sources):
                slots = [e for row in rows for e in row]
                if small_mc2:
                    per_rank = [sum(e // (E // ep) == r for e in slots) for r in range(ep)]
                    assert _balanced(per_rank), f"{what} rank {g}: slots per EP rank {per_rank}"
                else:
                    per_expert = [slots.count(e) for e in range(E)]
                    assert _balanced(per_expert), f"{what} rank {g}: slots per expert {per_expert}"
            if len(sources) == 1:
                job = [e for row in sources[0] for e in row]
                assert _balanced([job.count(e) for e in range(E)]), f"{what}: job slots per expert unbalanced"
            routes.setdefault(i, []).append(real)
    # (3) the reference replays each token's ids with its own top-k weights
    ref = reference_model("tiny")
    per_request = _request_routes(routes, PROMPTS, got["tokens"], world, lay, GEN_TOKENS)
    for b, prompt in enumerate(PROMPTS):
        seq = prompt + got["tokens"][b][:-1]
        with torch.no_grad(), _replaying(ref, per_request[b]):
            want = ref(torch.tensor([seq]))[0]
        assert_close(got["prompt_logits"][b], want[: len(prompt)], "model.float32", f"{lay} request {b} prompt logits")
        assert_close(got["logits"][b], want[len(prompt) - 1 :], "model.float32", f"{lay} request {b} generated logits")
