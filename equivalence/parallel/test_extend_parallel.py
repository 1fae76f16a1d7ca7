"""Prefill over cached KV ("extend"): a prompt prefilled in two pieces, the second reading the first's KV from the
paged cache, computes what one prefill of the whole prompt computes. Real gloo ranks, TP at world 1 and attention
TP 2 (KV heads split over the ranks).

- 16-bit cache, fp32: per prompt, the logits of the first piece and of the rest (one extend step over rows with
  different cached lengths, a row with none among them) equal the one-shot prefill's within `model.float32`, greedy
  tokens equal; the decode steps after it (teacher-forced) equal those after the one-shot prefill (the extend wrote
  the new tokens' K/V at their slots);
- FP8 cache, bf16: an extend reads its whole context quantized, as a decode step does (the reference's FP8 cache
  rule: a prompt attends to its own 16-bit K/V, every later step reads the cache), so its logits equal the
  reference with that cache rule fed the same two pieces, replaying the optimized expert ids, within
  `model.parallel.bfloat16`, and are nearer to it than to the reference with a 16-bit cache. (Against the 16-bit
  one-shot prefill the tiny model's FP8 KV error alone is rel_l2 2e-2..9e-2 and moves greedy tokens, so that is
  not the oracle);
- the sequence-parallel prefill cannot take cached KV: the runner refuses `cached_lens` by name (UsageError), and
  the layer refuses an extend step that reaches the SP attention anyway.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import strategies as st

from equivalence.support.compare import assert_close, tolerance
from equivalence.support.dist import get_pool
from equivalence.support.parallel_support import (
    RoutingStats,
    decode_metadata,
    on_host,
    paged_cache,
    rank_model,
    reference_model,
    run_property,
    runner_of,
    same_on_all_ranks,
)
from equivalence.support.strategies import describe_layout, layout, sp_layout
from fixtures.checkpoints import checkpoint
from fixtures.tiny import tiny_config

pytestmark = pytest.mark.distributed

CONFIG = tiny_config("tiny")
CASES = {
    "tp1": (1, layout(1)),
    "tp2": (2, layout(2, attn_tp_size=2, embed_tp_size=2, lmhead_tp_size=2)),
}


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _split_task(rank, world, path, lay, prompts, cuts, forced):
    """fp32, 16-bit cache: one-shot prefill + decode steps, and the same prompts prefilled as [:cut] then [cut:]
    over the cached KV + the same decode steps. -> per request its logits both ways."""
    model = rank_model(path, lay, torch.float32)
    runner = runner_of(model)
    budgets = [len(p) + len(forced) for p in prompts]

    def decode(cache, table):
        lengths, steps = [len(p) for p in prompts], []
        for tokens in forced:
            steps.append(model(torch.tensor(tokens), decode_metadata(lengths, table), cache.layers))
            lengths = [n + 1 for n in lengths]
        return torch.stack(steps, dim=1)  # [B, steps, V]

    with torch.no_grad():
        cache, table = paged_cache(model, budgets)
        ids, meta, _ = runner.prefill_inputs(prompts, table)
        whole = model(ids, meta, cache.layers)
        whole_decode = decode(cache, table)

        cache, table = paged_cache(model, budgets)
        first = [b for b, c in enumerate(cuts) if c]
        ids, meta, _ = runner.prefill_inputs([prompts[b][: cuts[b]] for b in first], table[first])
        head = model(ids, meta, cache.layers)
        ids, meta, _ = runner.prefill_inputs([p[c:] for p, c in zip(prompts, cuts)], table, cached_lens=list(cuts))
        assert meta.is_extend and meta.actual_seq_lengths_kv == [len(p) for p in prompts]
        rest = model(ids, meta, cache.layers)
        split_decode = decode(cache, table)

    heads = dict(zip(first, head.split([cuts[b] for b in first])))
    rests = rest.split([len(p) - c for p, c in zip(prompts, cuts)])
    split = [torch.cat([heads[b], rests[b]]) if b in heads else rests[b] for b in range(len(prompts))]
    return {
        "whole": list(whole.split([len(p) for p in prompts])),
        "split": split,
        "whole_decode": whole_decode,
        "split_decode": split_decode,
    }


def _check_split(world, lay, prompts, cuts, forced):
    results = get_pool(world).run(_split_task, str(checkpoint("tiny")), lay, prompts, cuts, forced, timeout=180)
    got = same_on_all_ranks(results, "extend logits")
    what = f"{describe_layout(lay)}, prompts of {[len(p) for p in prompts]} split at {cuts}"
    for b in range(len(prompts)):
        assert_close(got["split"][b], got["whole"][b], "model.float32", f"{what}: request {b}")
        assert torch.equal(got["split"][b].argmax(-1), got["whole"][b].argmax(-1)), f"{what}: request {b} greedy"
    assert_close(got["split_decode"], got["whole_decode"], "model.float32", f"{what}: decode after the extend")


@st.composite
def split_prompts(draw):
    """1-3 prompts (lengths around the 16-token blocks) and a cut per prompt (0: the row has nothing cached)."""
    lengths = draw(st.lists(st.integers(2, 40), min_size=1, max_size=3))
    cuts = [draw(st.integers(0, n - 1)) for n in lengths]
    if not any(cuts):
        cuts[0] = lengths[0] - 1
    return _prompts(draw(st.integers(0, 2**16)), lengths), cuts


def test_extend_equals_one_prefill_single_process():
    def check(case):
        prompts, cuts = case
        _check_split(1, CASES["tp1"][1], prompts, cuts, [[1] * len(prompts), [7] * len(prompts)])

    run_property(check, max_examples=4, case=split_prompts())


def test_extend_equals_one_prefill_attention_tp2():
    world, lay = CASES["tp2"]
    prompts = _prompts(3, [37, 9, 20])
    _check_split(world, lay, prompts, [17, 0, 16], [[5, 6, 7], [8, 9, 10]])


def _fp8_task(rank, world, path, lay, prompt, cut):
    """bf16, per-token FP8 cache: prompt[:cut] prefilled, then the rest as one extend step (logits, and the expert ids
    of every token: the first piece's rows, then the rest's), and the same over a 16-bit cache."""
    from equivalence.support.logits_runs import _recording_routes

    model = rank_model(path, lay, torch.bfloat16)
    runner = runner_of(model)
    out = {"kv_heads": model.layers[0].self_attn.num_kv_heads}
    with torch.no_grad():
        for name, dtype in (("fp8", torch.float8_e4m3fn), ("16", None)):
            cache, table = paged_cache(model, [len(prompt)], dtype=dtype)
            routes: dict = {}
            with _recording_routes(model, routes, {}):
                ids, meta, _ = runner.prefill_inputs([prompt[:cut]], table)
                model(ids, meta, cache.layers)
                ids, meta, _ = runner.prefill_inputs([prompt[cut:]], table, cached_lens=[cut])
                out[f"extend{name}"] = model(ids, meta, cache.layers).float()
            out[f"routes{name}"] = {i: torch.cat(r) for i, r in routes.items()}
    return on_host(out)


def _reference_extend(prompt, cut, routes, kv_heads, stats):
    """The bf16 reference through its own cache, prompt[:cut] then the rest in one forward, replaying the optimized
    expert ids; kv_heads: the FP8 cache rule (one scale per token over a rank's KV heads), None: a 16-bit cache."""
    from equivalence.support.logits_runs import replayed_routing
    from reference.fake_quant import fake_quantize_kv_cache

    ref = reference_model("tiny", "bfloat16")
    model = ref if kv_heads is None else fake_quantize_kv_cache(ref, kv_heads)
    try:
        cache, logits = model.new_cache(), None
        tie = tolerance("router_tie.model.bfloat16").rtol
        for rows, ids in ((slice(0, cut), prompt[:cut]), (slice(cut, len(prompt)), prompt[cut:])):
            with torch.no_grad(), replayed_routing(ref, {i: r[rows] for i, r in routes.items()}, tie, stats):
                logits = model(torch.tensor([ids]), cache)[0].float()
        return logits
    finally:
        if kv_heads is not None:
            del ref.new_cache  # back to the class's 16-bit cache


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_kv_extend_equals_the_reference_with_fp8_kv(case):
    """The extend over an FP8 cache equals the reference with the FP8 cache rule fed in the same two pieces (its
    second piece reads its whole context quantized) within `model.fp8_kv.extend.bfloat16`; the same extend over a
    16-bit cache equals the 16-bit reference within `model.parallel.bfloat16`."""
    world, lay = CASES[case]
    (prompt,) = _prompts(11, [37])
    cut = 17
    results = get_pool(world).run(_fp8_task, str(checkpoint("tiny")), lay, prompt, cut, timeout=180)
    got = same_on_all_ranks(results, "fp8 extend logits")
    what = f"{describe_layout(lay)} FP8 KV, 37 tokens split at {cut}"
    stats: list[RoutingStats] = []
    with_fp8 = _reference_extend(prompt, cut, got["routesfp8"], got["kv_heads"], stats)
    total = sum(stats, RoutingStats())
    assert total.clear_flips == 0, f"{what}: {total}"
    assert_close(got["extendfp8"], with_fp8, "model.fp8_kv.extend.bfloat16", f"{what}: vs the FP8-KV reference")
    with_16 = _reference_extend(prompt, cut, got["routes16"], None, [])
    assert_close(got["extend16"], with_16, "model.parallel.bfloat16", f"{what}: 16-bit cache vs the reference")


def _layer_task(rank, world, path, lay, cached, new, fp8):
    """Layer 0's attention over one row whose cache holds `cached` + `new` tokens of random K/V (written by the
    layer's own cache write): the extend of the `new` queries, and each query alone as a decode step at its
    position (the paged kernel reading the same cache: key/value_quant_mode 4 on the FP8 cache)."""
    model = rank_model(path, lay, torch.bfloat16)
    runner, attn = runner_of(model), model.layers[0].self_attn
    g = torch.Generator().manual_seed(cached * 31 + new)
    total = cached + new
    k, v = (torch.randn(total, attn.num_kv_heads, attn.head_dim, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(new, attn.num_heads, attn.head_dim, generator=g).bfloat16()
    cache, table = paged_cache(model, [total], num_layers=1, dtype=torch.float8_e4m3fn if fp8 else None)
    _, write, _ = runner.prefill_inputs([[0] * total], table)
    attn.kv_cache_update(k, v, write, cache.layers[0])
    _, meta, _ = runner.prefill_inputs([[0] * new], table, cached_lens=[cached])
    with torch.no_grad():
        extend = attn.attention_extend(q, meta, cache.layers[0], model.atten_mask)
        decode = torch.cat(
            [
                attn.attention_decode(
                    q[i : i + 1], decode_metadata([cached + i], table), cache.layers[0], model.atten_mask
                )
                for i in range(new)
            ]
        )
    return {"extend": extend.float(), "decode": decode.float()}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16_kv", "fp8_kv"])
def test_extend_attention_equals_decode_at_each_position(fp8):
    """The extend reads what a decode step at the same position reads, every key (the new ones included) through
    the cache: each of its query rows equals that decode step's attention within `op.bfloat16` (FP8: the extend
    de-quantizes into bf16 before the kernel, decode inside it in fp32)."""
    for cached, new in ((1, 5), (17, 9), (32, 16), (5, 1)):
        (got,) = get_pool(1).run(_layer_task, str(checkpoint("tiny")), CASES["tp1"][1], cached, new, fp8, timeout=180)
        assert_close(got["extend"], got["decode"], "op.bfloat16", f"cached {cached}, new {new}, fp8 {fp8}")


def _sp_refusal_task(rank, world, path, lay):
    from optimized.errors import UsageError

    model = rank_model(path, lay, torch.float32)
    runner = runner_of(model)
    prompt = _prompts(5, [20])[0]
    cache, table = paged_cache(model, [len(prompt)])
    refused = []
    try:
        runner.prefill_inputs([prompt[8:]], table, cached_lens=[8])
    except UsageError as e:
        refused.append(str(e))
    ids, meta, _ = runner.prefill_inputs([prompt[8:]], table)
    meta = dataclasses.replace(meta, cached_lens=[8], actual_seq_lengths_kv=[len(prompt)])
    try:
        with torch.no_grad():
            model(ids, meta, cache.layers)
    except UsageError as e:
        refused.append(str(e))
    return refused


def test_sequence_parallel_prefill_refuses_cached_kv_by_name():
    results = get_pool(2).run(_sp_refusal_task, str(checkpoint("tiny")), sp_layout(2, "alltoall"), timeout=180)
    for refused in results:
        assert len(refused) == 2, refused
        assert all("cached KV" in m and "prefill_opt" in m for m in refused), refused


def _bad_cached_lens_task(rank, world, path, lay):
    from optimized.errors import UsageError

    model = rank_model(path, lay, torch.float32)
    runner = runner_of(model)
    _, table = paged_cache(model, [20, 20])  # two columns of 16-token blocks per row
    messages = []
    for cached_lens in ([3], [-1, 0], [2.0, 0], [30, 0]):
        try:
            runner.prefill_inputs([[1, 2, 3], [4]], table, cached_lens=cached_lens)
        except UsageError as e:
            messages.append(str(e))
    _, meta, _ = runner.prefill_inputs([[1, 2, 3], [4]], table, cached_lens=[0, 0])
    messages.append(f"all zeros: extend {meta.is_extend}")
    return messages


def test_runner_refuses_bad_cached_lens_by_name():
    (messages,) = get_pool(1).run(_bad_cached_lens_task, str(checkpoint("tiny")), CASES["tp1"][1], timeout=180)
    assert "cached_lens has 1 entries for 2 prefill rows" in messages[0]
    assert "cached_lens[0] = -1 must be an int >= 0" in messages[1]
    assert "cached_lens[0] = 2.0 must be an int >= 0" in messages[2]
    assert "row 0: 30 cached + 3 new tokens need 3 blocks of 16; its block table row has 2 columns" in messages[3]
    assert messages[4] == "all zeros: extend False", messages  # no row has cached KV: a plain prefill


def _dp_task(rank, world, path, lay, prompts, cuts):
    """Attention DP: DP group d prefills prompts[d] at once, and as [:cuts[d]] then the rest over its cached KV,
    every group stepping together (the MoE exchanges span the groups)."""
    from optimized.forward_metadata import DataParallelBatch

    model = rank_model(path, lay, torch.float32)
    runner, group = runner_of(model), model.groups.dp_rank
    tp = model.groups.attn_tp.size
    prompt, cut = prompts[group], cuts[group]

    def step(tokens, table, cache, sizes, cached=None):
        ids, meta, _ = runner.prefill_inputs([tokens], table, cached_lens=cached)
        meta.dp = DataParallelBatch(tuple(sizes), tp)
        return model(ids, meta, cache.layers)

    with torch.no_grad():
        cache, table = paged_cache(model, [len(prompt)])
        whole = step(prompt, table, cache, [len(p) for p in prompts])
        cache, table = paged_cache(model, [len(prompt)])
        head = step(prompt[:cut], table, cache, cuts)
        rest = step(prompt[cut:], table, cache, [len(p) - c for p, c in zip(prompts, cuts)], cached=[cut])
    return {"group": group, "whole": whole, "split": torch.cat([head, rest])}


def test_extend_equals_one_prefill_under_attention_dp():
    from equivalence.support.attn_dp_runs import dp_layout

    lay = dp_layout(2, 1)
    prompts, cuts = _prompts(7, [37, 21]), [17, 5]
    for got in get_pool(2).run(_dp_task, str(checkpoint("tiny")), lay, prompts, cuts, timeout=180):
        what = (
            f"attention DP 2, group {got['group']}: {len(prompts[got['group']])} tokens split at {cuts[got['group']]}"
        )
        assert_close(got["split"], got["whole"], "model.float32", what)
        assert torch.equal(got["split"].argmax(-1), got["whole"].argmax(-1)), what
