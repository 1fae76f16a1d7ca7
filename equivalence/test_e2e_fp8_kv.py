"""The W4A8 model with the recipe's per-token FP8 KV cache computes what the fake-quant reference with the same
FP8 KV cache computes, and measurably not what it computes with a 16-bit cache.

Checkpoint: the tiny fixture converted with `--kv-cache fp8` (the recipe's `kv_cache_scheme`). Optimized: real
gloo ranks, TP at world 1 / 2 / 4 (KV heads replicated at 4) and the sequence-parallel prefill at world 2 (its
attention goes through the same cache write), prefill then teacher-forced decode steps over the FP8 paged
cache (`_logits_task` with a float8_e4m3fn cache). Oracle: `reference.fake_quant` with
`fake_quantize_kv_cache`, one scale per token over the KV heads one rank holds, run with its own cache (prefill
attends its 16-bit K/V, decode reads the quantized cache), replaying the optimized routing.

- decode logits within `model.w4a8.bfloat16` of the FP8-KV oracle (prefill logits too: the cache is written,
  not read, there);
- separation: the same decode logits are at least `model.w4a8.fp8_kv` `min_separation` times farther from the
  oracle with a 16-bit cache, so the test fails if the cache silently stays 16-bit.
"""
from __future__ import annotations

import functools

import pytest
import torch

from equivalence.compare import assert_close, rel_l2, tolerance
from equivalence.dist import get_pool
from equivalence.parallel_support import (RoutingStats, paged_cache, rank_model, reference_model, runner_of,
                                         same_on_all_ranks)
from equivalence.strategies import describe_layout, layout, sp_layout
from equivalence.test_e2e_parallel import _draw_forced, _rows, replayed_routing, teacher_forced_run
from fixtures.checkpoints import checkpoint, w4a8_checkpoint
from fixtures.tiny import tiny_config
from reference.fake_quant import fake_quantize_kv_cache, load_fake_quant_model

pytestmark = pytest.mark.distributed

CONFIG = tiny_config("tiny")
CASES = {"tp1": (1, layout(1)),
         "tp2": (2, layout(2, attn_tp_size=2, embed_tp_size=2, lmhead_tp_size=2)),
         "tp4": (4, layout(4, attn_tp_size=4, embed_tp_size=4, lmhead_tp_size=4)),
         "sp2": (2, sp_layout(2, "alltoall", embed_tp_size=2, lmhead_tp_size=2))}


def _fp8_logits_task(rank, world, path, lay, prompts, forced):
    """`_logits_task` over a float8_e4m3fn paged cache: prefill logits, forced decode logits, the routing."""
    model = rank_model(path, lay, torch.bfloat16)
    runner = runner_of(model)
    cache, table = paged_cache(model, [len(p) + len(forced) for p in prompts], dtype=torch.float8_e4m3fn)
    assert len(cache.layers[0]) == 4 and cache.layers[0][0].dtype == torch.float8_e4m3fn
    out = teacher_forced_run(model, runner, prompts, forced, cache, table)
    out["kv_heads"] = model.layers[0].self_attn.num_kv_heads
    return out


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
        chunks += [(torch.tensor([[forced[s][b]]]), slice(total + s * batch + b, total + s * batch + b + 1))
                   for s in range(steps)]
        logits = []
        for ids, index in chunks:
            with torch.no_grad(), replayed_routing(ref, pick(routes, index), near_tie, stats, pick(inputs, index)):
                logits.append(model(ids, cache)[0])
        out.append((logits[0], torch.cat(logits[1:])))
        if kv_heads_per_scale is not None:
            del ref.new_cache                  # back to the class's 16-bit cache
    return out


# weights -> (checkpoint, tolerance vs the FP8-KV oracle, near-tie rule: W4A8's is derived per token from the
# router inputs, with this slack, as equivalence/test_e2e_w4a8.py does)
WEIGHTS = {"bf16": (lambda: checkpoint("tiny"), "model.parallel.bfloat16", "router_tie.model.bfloat16"),
           "w4a8": (lambda: w4a8_checkpoint("tiny", kv_cache="fp8"), "model.w4a8.bfloat16", "router_tie.float32")}


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_kv_logits_match_reference_with_fp8_kv(case, weights):
    world, lay = CASES[case]
    make_path, tol, tie = WEIGHTS[weights]
    g = torch.Generator().manual_seed(world + 10)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in (19, 7)]
    forced = _draw_forced(world + 20, len(prompts), 4)
    got = same_on_all_ranks(get_pool(world).run(_fp8_logits_task, str(make_path()), lay, prompts, forced,
                                                timeout=180), "fp8 kv logits")
    ref, near_tie = oracle(weights), tolerance(tie).rtol
    stats: list[RoutingStats] = []
    inputs = got["router_inputs"] if weights == "w4a8" else None
    with_fp8 = cached_reference_logits(ref, prompts, forced, got["routes"], near_tie, stats, got["kv_heads"], inputs)
    with_16 = cached_reference_logits(ref, prompts, forced, got["routes"], near_tie, [], None, inputs)
    total = sum(stats, RoutingStats())
    what = f"{describe_layout(lay)} {weights} weights + FP8 KV: {total}"
    assert total.clear_flips == 0, what
    near = far = apart = 0.0
    for b, rows in enumerate(_rows(prompts)):
        decode = torch.stack([got[f"decode{s}"][b] for s in range(len(forced))])
        (ref_prefill, ref_decode), (_, ref16_decode) = with_fp8[b], with_16[b]
        report = f"{what}; request {b}"
        assert_close(got["prefill"][rows], ref_prefill, tol, f"{report} (prefill)")
        assert_close(decode, ref_decode, tol, report)
        near, far = max(near, rel_l2(decode, ref_decode)), max(far, rel_l2(decode, ref16_decode))
        apart = max(apart, rel_l2(ref_decode, ref16_decode))
    report = (f"{what}; decode rel_l2 vs the FP8-KV oracle {near:.3e}, vs the 16-bit-KV oracle {far:.3e} "
              f"(oracles {apart:.3e} apart)")
    print(report)
    if weights == "bf16":   # W4A8's own noise is as large as the KV quantization's effect on the tiny logits
        assert far >= tolerance("model.fp8_kv.bfloat16").min_separation * near, report
