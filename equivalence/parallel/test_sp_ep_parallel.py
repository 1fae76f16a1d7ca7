"""The sequence-parallel prefill (Attention SP+TP) and its MoE expert-parallel schemes (AllGather /
ReduceScatter, double-routing AlltoAll) over real gloo ranks equal the reference; decode continues on the TP
path from the KV cache the SP prefill wrote.

Layouts (`strategies.sp_layout`): attention TP = MoE EP = world (2, 4, 8; top_k 4 of the tiny models is
above, equal to and below the EP degree), prefill_opt on, each EP scheme; in the whole-model fp32 tests
embedding and lm_head either vocab-parallel over all ranks or replicated (drawn).

- EP schemes at block level: the `moe_infer_ag` and `moe_infer_double_routing` exchanges on drawn adversarial routings
  (`strategies.expert_routing`: every token on one expert set, one EP rank receiving nothing, one rank
  overloaded, uniform; empty experts in all but the last) equal the textbook sum over the reference's
  experts and each other (fp32), and the bytes each rank's collectives send equal the formulas of
  `optimized.distributed.prefill_plan` with the slot counts of the drawn routing;
- SP attention: the KV cache written by the SP step's attention is bitwise the TP path's (no padding row reaches it,
  nothing else is written) and the output equals the TP path's; the SP decoder layer equals the reference;
- whole model, fp32: prefill logits over token counts that are not multiples of P (1 token, S < P,
  S = kP + 1, packed requests) then TP decode steps from the SP-written cache equal the reference; greedy
  16 tokens are identical to the reference's;
- whole model, bf16: logits within `model.parallel.bfloat16` of the reference replaying the optimized
  routing (flips allowed on near-ties only, rate reported).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from equivalence.support.compare import assert_bitwise_equal, assert_close
from equivalence.support.dist import get_pool
from equivalence.support.logits_runs import (
    GEN_TOKENS,
    _draw_forced,
    _generate_task,
    _logits_task,
    _model_logits,
    _reference_logits,
    assert_bf16_logits_match_replayed_reference,
)
from equivalence.support.parallel_support import (
    paged_cache,
    rank_model,
    reference_model,
    run_property,
    runner_of,
    same_on_all_ranks,
)
from equivalence.support.sp_ep_runs import (
    CONFIG,
    VOCAB,
    E,
    H,
    K,
    _mine,
    _slots,
    sp_prompt_lengths,
)
from equivalence.support.strategies import (
    describe_layout,
    expert_routing,
    hidden_states,
    routing_kinds,
    seeds,
    sp_layout,
)
from fixtures.checkpoints import checkpoint
from reference.generate import greedy_generate
from reference.model import LayerCache, rope_cos_sin

pytestmark = pytest.mark.distributed

SCHEMES = ("allgather", "alltoall")
WORLDS = (2, 4, 8)
FIXTURES = ("tiny", "tiny-nonorm", "tiny-dense")


def cases(examples: dict[int, int]):
    return [pytest.param(w, s, examples[w], id=f"w{w}-{s}") for w in WORLDS for s in SCHEMES if examples[w]]


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


# ------------------------------------------------------------------------------------------ worker tasks


@torch.no_grad()
def _ep_schemes_task(rank, world, path, lay, layer_idx, x, ids, weights):
    from optimized import distributed as comm
    from optimized.layers.exchange import build_exchange

    model = rank_model(path, lay, torch.float32)
    mlp = model.layers[layer_idx].mlp
    ep = model.groups.moe_ep
    mine = [_mine(t, ep.rank, ep.size) for t in (x, ids, weights)]
    out = {}
    for name in ("allgather", "alltoall"):
        scheme = build_exchange(name, model.config, model.groups)
        with comm.count_bytes() as counter:
            y = scheme(mlp.experts, *mine)
        out[name] = comm.all_gather(y, ep.group)
        out[f"{name}_bytes"] = dict(counter.bytes)
    return out


@torch.no_grad()
def _sp_attention_task(rank, world, path, lay, layer_idx, lengths, x, residual):
    """SP attention vs the TP path of the same rank (outputs and KV caches), and the SP decoder layer."""
    from optimized import distributed as comm

    model = rank_model(path, lay, torch.float32)
    layer, runner, sp = model.layers[layer_idx], runner_of(model), model.groups.attn_tp
    out = {}
    caches = {}
    for path_name in ("sp", "tp"):
        cache, table = paged_cache(model, lengths, num_layers=1)
        _, meta, _ = runner.prefill_inputs([[0] * n for n in lengths], table)
        cos, sin = model.rotary(meta.positions)
        if path_name == "sp":
            y = model.prefill.step.attention(
                layer.self_attn, _mine(x, sp.rank, sp.size), cos, sin, meta, cache.layers[0], model.atten_mask
            )
            out["sp"] = comm.all_gather(y, sp.group)[: x.shape[0]]
        else:
            out["tp"] = layer.self_attn(x, cos, sin, meta, cache.layers[0], model.atten_mask)
        caches[path_name] = cache.layers[0]
    out["caches"] = caches
    cache, table = paged_cache(model, lengths, num_layers=1)
    _, meta, _ = runner.prefill_inputs([[0] * n for n in lengths], table)
    cos, sin = model.rotary(meta.positions)
    mlp_out, new_residual = layer(
        _mine(x, sp.rank, sp.size),
        _mine(residual, sp.rank, sp.size),
        cos,
        sin,
        meta,
        cache.layers[0],
        model.atten_mask,
        model.prefill.step,
    )
    out["layer"] = [comm.all_gather(t, sp.group)[: x.shape[0]] for t in (mlp_out, new_residual)]
    return out


# ----------------------------------------------------------------------------------------------- oracles


@torch.no_grad()
def _textbook_moe(block, x, ids, weights):
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) over the reference block's experts (fp32)."""
    out = torch.zeros_like(x)
    for e, expert in enumerate(block.experts):
        token, slot = torch.where(ids.long() == e)
        if token.numel():
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
    return out


# ----------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", WORLDS)
def test_ep_schemes_equal_reference_and_each_other_on_adversarial_routings(world):
    path = str(checkpoint("tiny"))
    ref = reference_model("tiny")
    examples = {2: 6, 4: 5, 8: 3}[world]

    def check(kind, per_rank, layer_idx, seed):
        lay = sp_layout(world, "allgather")
        tokens = per_rank * world
        x = hidden_states("random", seed, tokens, H)
        ids, weights = expert_routing(kind, seed, tokens, E, K, world)
        results = get_pool(world).run(_ep_schemes_task, path, lay, layer_idx, x, ids, weights, timeout=120)
        got = same_on_all_ranks([{s: r[s] for s in SCHEMES} for r in results], "EP schemes")  # bytes differ
        want = _textbook_moe(ref.model.layers[layer_idx].mlp, x, ids, weights)
        what = f"W={world} top_k={K} routing {kind} x{tokens} layer {layer_idx}"
        for scheme in SCHEMES:
            assert_close(got[scheme], want, "layer.float32", f"{what}: {scheme} vs reference experts")
        assert_close(got["allgather"], got["alltoall"], "layer.float32", f"{what}: allgather vs alltoall")

    run_property(
        check,
        examples,
        kind=routing_kinds,
        per_rank=st.integers(1, 6),
        layer_idx=st.integers(0, CONFIG.num_hidden_layers - 1),
        seed=seeds,
    )


@pytest.mark.parametrize("world", (2, 4))
def test_ep_scheme_bytes_moved_equal_the_formula(world):
    from optimized.distributed.prefill_plan import allgather_volume, alltoall_volume

    path = str(checkpoint("tiny"))

    def check(kind, per_rank, seed):
        tokens = per_rank * world
        x = hidden_states("random", seed, tokens, H)
        ids, weights = expert_routing(kind, seed, tokens, E, K, world)
        results = get_pool(world).run(
            _ep_schemes_task, path, sp_layout(world, "alltoall"), 0, x, ids, weights, timeout=120
        )
        for rank, got in enumerate(results):
            slots_out, slots_in = _slots(ids, world, rank)
            want_ag = allgather_volume(per_rank, H, K, world, 4).parts
            want_a2a = alltoall_volume(per_rank, H, K, world, E, 4, slots_out, slots_in).parts
            what = f"W={world} routing {kind} x{tokens} rank {rank} (slots out {slots_out}, in {slots_in})"
            for scheme, want in (("allgather", want_ag), ("alltoall", want_a2a)):
                sent = got[f"{scheme}_bytes"]
                assert sent == want, f"{what}: {scheme} sent {sent}, formula {want}"

    run_property(check, 3, kind=routing_kinds, per_rank=st.integers(1, 5), seed=seeds)


@pytest.mark.parametrize("world, scheme, n", cases({2: 2, 4: 2, 8: 1}))
def test_sp_attention_writes_the_tp_cache_and_sp_layer_equals_reference(world, scheme, n):
    def check(name, lengths, layer_idx, seed):
        path = str(checkpoint(name))
        ref = reference_model(name)
        config = ref.config
        layer_idx %= config.num_hidden_layers
        lay = sp_layout(world, scheme)
        x = hidden_states("random", seed, sum(lengths), H)
        residual = hidden_states("random", seed + 1, sum(lengths), H)
        results = get_pool(world).run(_sp_attention_task, path, lay, layer_idx, lengths, x, residual, timeout=120)
        what = f"{describe_layout(lay)} {name} lengths={lengths} layer {layer_idx}"
        for rank, res in enumerate(results):  # each rank caches its own KV heads
            (k_sp, v_sp), (k_tp, v_tp) = res.pop("caches").values()
            assert_bitwise_equal(k_sp, k_tp, f"{what}: rank {rank} SP-written K cache vs TP-written")
            assert_bitwise_equal(v_sp, v_tp, f"{what}: rank {rank} SP-written V cache vs TP-written")
        got = same_on_all_ranks(results, "SP attention")
        assert_close(got["sp"], got["tp"], "layer.float32", f"{what}: SP attention vs TP attention")
        layer = ref.model.layers[layer_idx]
        want, want_residual = [], []
        off = 0
        with torch.no_grad():
            for length in lengths:
                cos, sin = rope_cos_sin(config, torch.arange(length), torch.float32)
                xb = (x + residual)[off : off + length][None]
                want.append(layer(xb, cos, sin, LayerCache())[0])
                want_residual.append((xb + layer.self_attn(layer.input_layernorm(xb), cos, sin))[0])
                off += length
        mlp_out, new_residual = got["layer"]
        assert_close(new_residual, torch.cat(want_residual), "layer.float32", f"{what}: SP residual = x + attn")
        assert_close(mlp_out + new_residual, torch.cat(want), "layer.float32", f"{what}: SP layer(x)")

    run_property(
        check,
        n,
        name=st.sampled_from(["tiny", "tiny-dense"]),
        lengths=sp_prompt_lengths(world),
        layer_idx=st.integers(0, 2),
        seed=seeds,
    )


@pytest.mark.parametrize("world, scheme, n", cases({2: 3, 4: 2, 8: 2}))
def test_sp_prefill_then_tp_decode_logits_equal_reference_fp32(world, scheme, n):
    def check(name, lengths, steps, vocab_tp, seed):
        lay = sp_layout(world, scheme, embed_tp_size=vocab_tp, lmhead_tp_size=vocab_tp)
        path = str(checkpoint(name))
        prompts = _prompts(lengths, seed)
        forced = _draw_forced(seed, len(prompts), steps)
        got = same_on_all_ranks(
            get_pool(world).run(_logits_task, path, lay, "float32", prompts, forced, timeout=120), "SP logits"
        )
        assert got["ep_scheme"] == lay["moe_ep_scheme"], (got["ep_scheme"], lay)
        want = _reference_logits(reference_model(name), prompts, forced)
        for b, ((gp, gd), (wp, wd)) in enumerate(zip(_model_logits(got, prompts, forced), want)):
            what = f"{describe_layout(lay)} {name} lengths={lengths} request {b}"
            assert_close(gp, wp, "model.float32", f"{what}: SP prefill logits")
            assert_close(gd, wd, "model.float32", f"{what}: TP decode logits from the SP-written cache ({steps} steps)")

    run_property(
        check,
        n,
        name=st.sampled_from(FIXTURES),
        lengths=sp_prompt_lengths(world),
        steps=st.integers(1, 3),
        vocab_tp=st.sampled_from([world, 1]),
        seed=seeds,
    )


@pytest.mark.parametrize("world, scheme, n", cases({2: 2, 4: 2, 8: 1}))
def test_sp_greedy_generation_identical_to_reference_fp32(world, scheme, n):
    def check(name, lengths, vocab_tp, seed):
        lay = sp_layout(world, scheme, embed_tp_size=vocab_tp, lmhead_tp_size=vocab_tp)
        path = str(checkpoint(name))
        prompts = _prompts(lengths, seed)
        got = same_on_all_ranks(
            get_pool(world).run(_generate_task, path, lay, "float32", prompts, GEN_TOKENS, timeout=120), "SP generation"
        )
        ref = reference_model(name)
        for b, (g, p) in enumerate(zip(got, prompts)):
            w = greedy_generate(ref, torch.tensor([p]), GEN_TOKENS)[0].tolist()
            assert g == w, f"{describe_layout(lay)} {name} request {b} (len {len(p)}): optimized {g} != reference {w}"

    run_property(
        check,
        n,
        name=st.sampled_from(FIXTURES),
        lengths=sp_prompt_lengths(world),
        vocab_tp=st.sampled_from([world, 1]),
        seed=seeds,
    )


@pytest.mark.parametrize("world, scheme, n", cases({2: 2, 4: 2, 8: 1}))
def test_sp_logits_bf16_within_tolerance_routing_flip_aware(world, scheme, n):
    lay = sp_layout(world, scheme)

    def check(name, lengths, steps, seed):
        prompts = _prompts(lengths, seed)
        forced = _draw_forced(seed, len(prompts), steps)
        got = same_on_all_ranks(
            get_pool(world).run(_logits_task, str(checkpoint(name)), lay, "bfloat16", prompts, forced, timeout=120),
            "SP bf16 logits",
        )
        assert got["ep_scheme"] == lay["moe_ep_scheme"], (got["ep_scheme"], lay)
        assert_bf16_logits_match_replayed_reference(
            got, name, prompts, forced, f"{describe_layout(lay)} {name} lengths={lengths}"
        )

    run_property(
        check, n, name=st.sampled_from(FIXTURES), lengths=sp_prompt_lengths(world), steps=st.integers(1, 2), seed=seeds
    )
