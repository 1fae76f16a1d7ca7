"""The W4A8 model with the recipe's per-token FP8 KV cache computes what the fake-quant reference with the same
FP8 KV cache computes, and its cache holds exactly what that reference's cache rule makes of its K/V.

Checkpoint: the tiny fixture converted with `--kv-cache fp8` (the recipe's `kv_cache_scheme`), or the BF16 tiny
fixture. Optimized: real gloo ranks, TP at world 1 / 2 / 4 (KV heads replicated at 4) and the sequence-parallel
prefill at world 2 and 4 (its attention goes through the same cache write), prefill then teacher-forced decode
steps over the FP8 paged cache, and the same run over a 16-bit cache on the same model. Oracle:
`reference.fake_quant` with `fake_quantize_kv_cache`, one scale per token over the KV heads one rank holds, run
with its own cache (prefill attends its 16-bit K/V, decode reads the quantized cache), replaying the optimized
routing.

- decode logits within the weights' tolerance of the FP8-KV oracle (prefill logits too);
- the cache itself: every layer's prompt-token K and V, dequantized from the FP8 cache (E4M3 x its fp32 scale),
  equal bitwise, in float64, the reference's per-token quantization (`fake_quant_kv`) of the K / V the same
  model wrote into the 16-bit cache; and every decode step's K and V, at its token's own slot, equal bitwise the
  per-token quantization of the K / V that step handed its cache write (a planted write to the wrong slot fails
  it: `test_fp8_kv_decode_write_check_fails_on_a_planted_wrong_slot`);
- prefill reads no cache: its logits are bitwise those of the 16-bit-cache run (the recipe's
  `Qwen3MoeAttention.exec_qkv` runs prefill FIA v2 on the fresh K/V and writes the cache after it, spec
  npu_ops_attention_norm.md §5.12; quantized reads, key/value_quant_mode 4, are decode's);
- separation. BF16 weights: the decode logits are `model.fp8_kv.bfloat16` `min_separation` times farther from the
  oracle with a 16-bit cache than from the FP8-KV one. W4A8 weights: that ratio is not measurable on the tiny
  model (W4A8's own noise, the optimized 16-bit-cache run vs the 16-bit-cache oracle, is as large as the KV
  quantization's effect; `model.fp8_kv.w4a8` records the figures), so the run is held instead to its cache
  contents above and to moving its decode logits away from its own 16-bit-cache run by at least
  `model.fp8_kv.w4a8` `min_separation` times the two oracles' distance (a cache that silently stays 16-bit
  moves them by exactly 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch

from equivalence.support.compare import assert_close, describe, rel_l2, tolerance
from equivalence.support.dist import get_pool
from equivalence.support.logits_runs import _draw_forced, _rows, replayed_routing, teacher_forced_run
from equivalence.support.parallel_support import (
    RoutingStats,
    on_host,
    paged_cache,
    rank_model,
    reference_model,
    runner_of,
    same_on_all_ranks,
)
from equivalence.support.strategies import BLOCK_SIZE, describe_layout, layout, sp_layout
from fixtures.checkpoints import checkpoint, w4a8_checkpoint
from fixtures.tiny import tiny_config
from reference.fake_quant import fake_quant_kv, fake_quantize_kv_cache, load_fake_quant_model

pytestmark = pytest.mark.distributed

CONFIG = tiny_config("tiny")
CASES = {
    "tp1": (1, layout(1)),
    "tp2": (2, layout(2, attn_tp_size=2, embed_tp_size=2, lmhead_tp_size=2)),
    "tp4": (4, layout(4, attn_tp_size=4, embed_tp_size=4, lmhead_tp_size=4)),
    "sp2": (2, sp_layout(2, "alltoall", embed_tp_size=2, lmhead_tp_size=2)),
    "sp4": (4, sp_layout(4, "allgather")),
}


def _prompt_slots(prompts, table) -> torch.Tensor:
    """The cache slots of every prompt token (request by request), through the block table."""
    return torch.cat(
        [
            table[b, torch.arange(len(p)) // BLOCK_SIZE].long() * BLOCK_SIZE + torch.arange(len(p)) % BLOCK_SIZE
            for b, p in enumerate(prompts)
        ]
    )


def _decode_slots(prompts, steps: int, table) -> torch.Tensor:
    """The cache slots of every decode step's token, step by step, request by request (the step's batch order)."""
    pos = torch.tensor([len(p) + s for s in range(steps) for p in prompts])
    req = torch.tensor([b for _ in range(steps) for b in range(len(prompts))])
    return table[req, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE


@contextlib.contextmanager
def _recording_decode_writes(model, written: dict, plant_layer: int | None = None):
    """Record the K / V [B, Nkv_r, D] each layer hands its cache write at every decode step (`written[i]`, step by
    step). plant_layer: that layer's decode writes go one slot too early (a planted bug the cache check must see)."""
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn

        def update(k, v, meta, kv_cache, _update=attn.kv_cache_update, _i=i):
            if not meta.is_prefill:
                written.setdefault(_i, []).append((k.clone(), v.clone()))
                if _i == plant_layer:
                    meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping - 1)
            return _update(k, v, meta, kv_cache)

        attn.kv_cache_update = update
    try:
        yield
    finally:
        for layer in model.layers:
            del layer.self_attn.kv_cache_update


def _fp8_logits_task(rank, world, path, lay, prompts, forced, plant_layer=None):
    """`_logits_task` over a float8_e4m3fn paged cache (prefill logits, forced decode logits, the routing), the
    same run over a 16-bit cache (its logits), both caches' prompt-token entries of every layer, and the FP8
    cache's decode-step entries with the K / V each decode step wrote there (plant_layer: see
    `_recording_decode_writes`)."""
    model = rank_model(path, lay, torch.bfloat16)
    runner = runner_of(model)
    budgets = [len(p) + len(forced) for p in prompts]
    cache, table = paged_cache(model, budgets, dtype=torch.float8_e4m3fn)
    assert len(cache.layers[0]) == 4 and cache.layers[0][0].dtype == torch.float8_e4m3fn
    written: dict = {}
    with _recording_decode_writes(model, written, plant_layer):
        out = teacher_forced_run(model, runner, prompts, forced, cache, table)
    cache16, table16 = paged_cache(model, budgets)
    assert len(cache16.layers[0]) == 2 and torch.equal(table16, table)
    run16 = teacher_forced_run(model, runner, prompts, forced, cache16, table16)
    out["prefill16"] = run16["prefill"]
    for s in range(len(forced)):
        out[f"decode16_{s}"] = run16[f"decode{s}"]
    slots = _prompt_slots(prompts, table.cpu()).to(table.device)
    flat = lambda t: t.reshape(-1, *t.shape[2:])[slots]  # noqa: E731  [slots, (Nkv_r, D)]
    out["cache8"] = [tuple(flat(t) for t in layer) for layer in cache.layers]  # k, v, k_scale, v_scale
    out["cache16"] = [tuple(flat(t) for t in layer) for layer in cache16.layers]  # k, v
    decode_slots = _decode_slots(prompts, len(forced), table.cpu()).to(table.device)
    at_decode = lambda t: t.reshape(-1, *t.shape[2:])[decode_slots]  # noqa: E731
    out["decode8"] = [tuple(at_decode(t) for t in layer) for layer in cache.layers]
    out["decode_written"] = [
        tuple(torch.cat([w[j] for w in written[i]]) if forced else layer[j][:0].float() for j in range(2))
        for i, layer in enumerate(cache.layers)
    ]
    out["kv_heads"] = model.layers[0].self_attn.num_kv_heads
    return on_host(out)


def assert_cache_is_the_reference_quantization(got, what: str) -> None:
    """Every layer's FP8 K / V entries, dequantized in float64, equal `fake_quant_kv` of the 16-bit run's
    entries (one scale per token over this rank's KV heads) bitwise."""
    heads = got["kv_heads"]
    for i, ((k8, v8, ks, vs), (k16, v16)) in enumerate(zip(got["cache8"], got["cache16"])):
        for name, q, scale, x in (("K", k8, ks, k16), ("V", v8, vs, v16)):
            deq = q.double() * scale.double()[:, None, None]  # [T, Nkv_r, D]
            want = fake_quant_kv(x.double().transpose(0, 1)[None], heads)[0].transpose(0, 1)
            assert torch.equal(deq, want), (
                f"{what}: layer {i} {name} cache is not the per-token FP8 quantization "
                f"of the K/V written: {describe(deq, want)}"
            )
            assert (deq != x.double()).any(), f"{what}: layer {i} {name} cache equals its 16-bit values"


def assert_decode_writes_are_the_quantization(got, what: str) -> None:
    """Every layer's FP8 entries at the decode steps' slots, dequantized in float64, equal `fake_quant_kv` of the
    K / V that decode step wrote (one scale per token over this rank's KV heads) bitwise: the cache holds each
    decode token's quantized K/V in its own slot."""
    heads = got["kv_heads"]
    for i, ((k8, v8, ks, vs), (k, v)) in enumerate(zip(got["decode8"], got["decode_written"])):
        for name, q, scale, x in (("K", k8, ks, k), ("V", v8, vs, v)):
            deq = q.double() * scale.double()[:, None, None]  # [steps*B, Nkv_r, D]
            want = fake_quant_kv(x.double().transpose(0, 1)[None], heads)[0].transpose(0, 1)
            assert torch.equal(deq, want), (
                f"{what}: layer {i} {name} cache at the decode slots is not the per-token "
                f"FP8 quantization of the decode steps' K/V: {describe(deq, want)}"
            )
            assert (deq != x.double()).any(), f"{what}: layer {i} {name} decode entries equal their 16-bit values"


@functools.lru_cache(maxsize=None)
def oracle(weights: str):
    """The reference of the tiny fixture: fake-quantized (W4A8) or plain, bf16, fp32 router."""
    if weights == "w4a8":
        return load_fake_quant_model(checkpoint("tiny"), torch.bfloat16, router_dtype="float32")
    return reference_model("tiny", "bfloat16")


def cached_reference_logits(ref, prompts, forced, routes, near_tie, stats, kv_heads_per_scale, inputs=None):
    """Per request, through the reference's own cache: the prompt in one forward, then one forward per forced
    token, each replaying the optimized routing of its rows. kv_heads_per_scale None: a 16-bit cache. With the
    optimized router inputs, each token's near-tie bound is derived from them (`input_tie_margins`)."""
    steps, batch, total = len(forced), len(prompts), sum(len(p) for p in prompts)
    out = []
    for b, (p, rows) in enumerate(zip(prompts, _rows(prompts))):
        model = ref if kv_heads_per_scale is None else fake_quantize_kv_cache(ref, kv_heads_per_scale)
        cache = model.new_cache()

        def pick(per_layer, index):
            return None if per_layer is None else {i: r[index] for i, r in per_layer.items()}

        chunks = [(torch.tensor([p]), rows)]
        chunks += [
            (torch.tensor([[forced[s][b]]]), slice(total + s * batch + b, total + s * batch + b + 1))
            for s in range(steps)
        ]
        logits = []
        for ids, index in chunks:
            with torch.no_grad(), replayed_routing(ref, pick(routes, index), near_tie, stats, pick(inputs, index)):
                logits.append(model(ids, cache)[0])
        out.append((logits[0], torch.cat(logits[1:])))
        if kv_heads_per_scale is not None:
            del ref.new_cache  # back to the class's 16-bit cache
    return out


# weights -> (checkpoint, tolerance vs the FP8-KV oracle, near-tie rule: W4A8's is derived per token from the
# router inputs, with this slack, as equivalence/quant/test_e2e_w4a8.py does)
WEIGHTS = {
    "bf16": (lambda: checkpoint("tiny"), "model.parallel.bfloat16", "router_tie.model.bfloat16"),
    "w4a8": (lambda: w4a8_checkpoint("tiny", kv_cache="fp8"), "model.w4a8.bfloat16", "router_tie.float32"),
}


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_kv_logits_match_reference_with_fp8_kv(case, weights):
    world, lay = CASES[case]
    make_path, tol, tie = WEIGHTS[weights]
    g = torch.Generator().manual_seed(world + 10)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in (19, 7)]
    forced = _draw_forced(world + 20, len(prompts), 4)
    results = get_pool(world).run(_fp8_logits_task, str(make_path()), lay, prompts, forced, timeout=180)
    caches = [
        {key: r.pop(key) for key in ("cache8", "cache16", "kv_heads", "decode8", "decode_written")} for r in results
    ]  # per rank
    got = same_on_all_ranks(results, "fp8 kv logits")
    ref, near_tie = oracle(weights), tolerance(tie).rtol
    stats: list[RoutingStats] = []
    inputs = got["router_inputs"] if weights == "w4a8" else None
    with_fp8 = cached_reference_logits(
        ref, prompts, forced, got["routes"], near_tie, stats, caches[0]["kv_heads"], inputs
    )
    with_16 = cached_reference_logits(ref, prompts, forced, got["routes"], near_tie, [], None, inputs)
    total = sum(stats, RoutingStats())
    what = f"{describe_layout(lay)} {weights} weights + FP8 KV: {total}"
    assert total.clear_flips == 0, what
    for rank, cache in enumerate(caches):
        assert_cache_is_the_reference_quantization(cache, f"{what}; rank {rank}")
        assert_decode_writes_are_the_quantization(cache, f"{what}; rank {rank}")
    near = far = apart = moved = 0.0
    for b, rows in enumerate(_rows(prompts)):
        decode = torch.stack([got[f"decode{s}"][b] for s in range(len(forced))])
        decode16 = torch.stack([got[f"decode16_{s}"][b] for s in range(len(forced))])
        (ref_prefill, ref_decode), (_, ref16_decode) = with_fp8[b], with_16[b]
        report = f"{what}; request {b}"
        assert_close(got["prefill"][rows], ref_prefill, tol, f"{report} (prefill)")
        assert_close(decode, ref_decode, tol, report)
        near, far = max(near, rel_l2(decode, ref_decode)), max(far, rel_l2(decode, ref16_decode))
        apart = max(apart, rel_l2(ref_decode, ref16_decode))
        moved = (
            min(moved, rel_l2(decode, decode16) / rel_l2(ref_decode, ref16_decode))
            if b
            else rel_l2(decode, decode16) / rel_l2(ref_decode, ref16_decode)
        )
    # prefill attends to its fresh 16-bit K/V (the recipe's exec_qkv; spec §5.12): the cache dtype cannot show
    assert torch.equal(got["prefill"], got["prefill16"]), f"{what}: prefill logits depend on the cache dtype"
    report = (
        f"{what}; decode rel_l2 vs the FP8-KV oracle {near:.3e}, vs the 16-bit-KV oracle {far:.3e} "
        f"(oracles {apart:.3e} apart); FP8 vs 16-bit cache in the optimized run: at least {moved:.2f}x the "
        f"oracles' distance"
    )
    print(report)
    if weights == "bf16":
        assert far >= tolerance("model.fp8_kv.bfloat16").min_separation * near, report
    else:  # W4A8's own noise is as large as the KV quantization's effect on the tiny logits
        assert moved >= tolerance("model.fp8_kv.w4a8").min_separation, report


def test_fp8_kv_decode_write_check_fails_on_a_planted_wrong_slot():
    """The decode-slot cache check can fail: layer 1 writing each decode token's FP8 K/V one slot too early leaves
    that layer's decode slots unwritten, and the check names the layer."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in (19, 7)]
    forced = _draw_forced(23, len(prompts), 2)
    (clean,) = get_pool(1).run(_fp8_logits_task, str(checkpoint("tiny")), layout(1), prompts, forced, timeout=180)
    assert_decode_writes_are_the_quantization(clean, "clean")
    (planted,) = get_pool(1).run(
        _fp8_logits_task, str(checkpoint("tiny")), layout(1), prompts, forced, plant_layer=1, timeout=180
    )
    assert_decode_writes_are_the_quantization(
        {**planted, "decode8": planted["decode8"][:1], "decode_written": planted["decode_written"][:1]}, "layer 0"
    )
    with pytest.raises(AssertionError, match="layer 1 K cache at the decode slots"):
        assert_decode_writes_are_the_quantization(planted, "planted")
