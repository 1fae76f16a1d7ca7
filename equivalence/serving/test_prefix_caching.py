"""Automatic prefix caching (`enable_prefix_caching`): a request admitted over KV blocks another request computed
generates what it generates cold, which is what the reference generates.

- cold = warm = reference: fp32 greedy tokens equal the reference's, logits within `model.float32` of the
  reference's and of the cold run's, with the hit counter above zero (a prompt equal to a cached one reuses all its
  full blocks short of its last token; one sharing part of a block reuses the blocks before it);
- after eviction (a pool that holds one request's budget: the next unrelated request evicts the cached blocks) and
  after preemption (hypothesis: prompts sharing prefixes, arrivals and a pool too small for them all), tokens equal
  the reference's, every table row is its request's blocks and the pool ends full with no block held;
- echo: a request asking for prompt logprobs is computed whole, its prompt logprobs those of a cold engine;
- /metrics counts the queried and hit tokens;
- FP8 KV (bf16): a warm request's logits equal the same two pieces run through the runner's extend directly (the
  path `equivalence/parallel/test_extend_parallel.py` proves against the reference's FP8 cache rule), within
  `model.fp8_kv.extend.bfloat16`, and its identity keys differ from a 16-bit cache's;
- attention DP (2 gloo ranks): each group's pool hits on its own requests (an extend in one group beside a plain
  prefill in the other too), every rank takes the same decisions and the tokens are the reference's;
- the sequence-parallel prefill cannot run the extend a hit needs: the engine refuses the combination by name.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from equivalence.support.compare import assert_close
from equivalence.support.attn_dp_runs import dp_layout
from equivalence.support.engine_runs import BLOCK, _models, reference_logits, run_engine
from reference.generate import greedy_generate

pytestmark = pytest.mark.equivalence

BASE = [(7 * i + 3) % 251 for i in range(48)]


def _engine(runner, num_blocks: int, batch_size: int = 2):
    from optimized.executor.engine import Engine

    return Engine(runner, batch_size=batch_size, num_blocks=num_blocks, enable_prefix_caching=True)


def _request(name, prompt, max_tokens=6, **kw):
    from optimized.executor.scheduler import Request

    return Request(name, list(prompt), max_tokens, record_logits=True, **kw)


@functools.lru_cache(maxsize=None)
def _greedy(prompt: tuple[int, ...], n: int) -> list[int]:
    return greedy_generate(_models()[1], torch.tensor([list(prompt)]), n)[0].tolist()


def _check_reference(r) -> None:
    assert r.tokens == _greedy(tuple(r.prompt), r.max_tokens), f"{r.request_id} (cached {r.cached_tokens})"
    got = torch.stack(r.logits)
    assert_close(got, reference_logits(_models()[1], r.prompt, r.tokens), "model.float32", f"{r.request_id} logits")


def check_tables(engine) -> None:
    """The device batch's table rows are the running requests' blocks (cached ones included), the rest null."""
    from optimized.executor.kv_cache import NULL_BLOCK

    running = engine.scheduler.running[engine.dp_rank]
    assert engine.batch.n == len(running)
    for row, r in enumerate(running):
        want = r.blocks + [NULL_BLOCK] * (engine.batch.width - len(r.blocks))
        assert engine.batch.table[row].tolist() == want, f"{r.request_id}'s table row is not its blocks {r.blocks}"


def run_checked(engine, arrivals, max_steps: int = 500) -> None:
    """`run_engine` with the table rows checked after every step."""
    pending, step = sorted(arrivals, key=lambda a: a[0]), 0
    while pending or not engine.idle:
        while pending and pending[0][0] <= step:
            engine.add(pending.pop(0)[1])
        engine.step()
        check_tables(engine)
        step += 1
        assert step < max_steps, "the engine did not finish its requests"


def _pool_is_back(engine) -> None:
    assert engine.cache.free_blocks == engine.cache.num_blocks - 1 and not engine.cache._refs, "a block is still held"


def test_cold_equals_warm_equals_the_reference_with_hits():
    runner, _ = _models()
    engine = _engine(runner, num_blocks=12)
    cold = _request("cold", BASE[:40])
    run_engine(engine, [(0, cold)])
    warm = _request("warm", BASE[:40])  # the same prompt: 2 full blocks reused, its last 8 tokens computed
    part = _request("part", BASE[:35] + [1, 2, 3])  # shares 35 tokens: the 2 full blocks before
    whole = _request("whole", BASE[:32])  # exactly 2 blocks: 1 reused, its last block computed
    run_engine(engine, [(0, warm), (1, part), (2, whole)])
    assert [r.cached_tokens for r in (cold, warm, part, whole)] == [0, 32, 32, 16]
    s = engine.scheduler
    assert s.prefix_hits == 80 and s.prefix_queries == 40 + 40 + 38 + 32
    for r in (cold, warm, part, whole):
        _check_reference(r)
    assert_close(torch.stack(warm.logits), torch.stack(cold.logits), "model.float32", "warm vs cold logits")
    _pool_is_back(engine)


def test_after_eviction_the_tokens_are_the_references():
    """A pool of 4 blocks (one request's budget): the unrelated request after the cold one evicts its cached
    blocks, so the third (the cold one's prompt again) finds fewer or none, and is still right."""
    runner, _ = _models()
    engine = _engine(runner, num_blocks=5, batch_size=1)
    first = _request("first", BASE[:40], max_tokens=8)
    run_engine(engine, [(0, first)])
    assert engine.cache.cached_blocks == 2
    other = _request("other", [9] * 40, max_tokens=8)
    again = _request("again", BASE[:40], max_tokens=8)
    run_engine(engine, [(0, other), (1, again)])
    assert again.cached_tokens < 32, "nothing was evicted: the case no longer tests eviction"
    for r in (first, other, again):
        _check_reference(r)
    _pool_is_back(engine)


@settings(max_examples=5, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12), st.integers(4, 14)), min_size=2, max_size=4),
    arrivals=st.lists(st.integers(0, 6), min_size=4, max_size=4),
    spare_blocks=st.integers(0, 2),
)
def test_prefix_sharing_requests_with_eviction_and_preemption_end_with_the_references_tokens(
    specs, arrivals, spare_blocks
):
    """Each request: BASE's first `shared` tokens, then `tail` tokens of its own, `max_tokens`; the pool holds the
    largest budget and a spare block or two, so requests are preempted and cached blocks evicted."""
    runner, _ = _models()
    requests = [
        _request(f"r{i}", BASE[:shared] + [200 + i] * tail, max_tokens=n) for i, (shared, tail, n) in enumerate(specs)
    ]
    num_blocks = 1 + max(-(-r.budget // BLOCK) for r in requests) + spare_blocks
    engine = _engine(runner, num_blocks=num_blocks, batch_size=3)
    run_checked(engine, list(zip(arrivals, requests)))
    for r in requests:
        _check_reference(r)
    _pool_is_back(engine)


def test_a_preempted_request_is_recomputed_over_its_cached_blocks():
    """Three requests sharing 32 tokens in a pool of 6 blocks: the later ones are preempted as the first grows,
    their blocks go back cached, and their recompute hits them."""
    runner, _ = _models()
    requests = [_request(f"r{i}", BASE[:32] + [100 + i] * 3, max_tokens=24) for i in range(3)]
    engine = _engine(runner, num_blocks=7, batch_size=3)
    hits_at = []
    for r in requests:
        engine.add(r)
    while not engine.idle:
        step, _ = engine.step()
        hits_at += [r.cached_tokens for r in step.requests if step.kind == "prefill" and r.preemptions]
        check_tables(engine)
    assert sum(r.preemptions for r in requests) and any(hits_at), f"no recompute over cached blocks: {hits_at}"
    for r in requests:
        _check_reference(r)
    _pool_is_back(engine)


def test_echo_of_a_cached_prompt_equals_a_cold_engines():
    from optimized.executor.engine import Engine

    runner, ref = _models()
    engine = _engine(runner, num_blocks=12)
    run_engine(engine, [(0, _request("seed", BASE[:40]))])
    warm = _request("echo", BASE[:40], logprobs=2, prompt_logprobs=True)
    run_engine(engine, [(0, warm)])
    cold = _request("echo", BASE[:40], logprobs=2, prompt_logprobs=True)
    run_engine(Engine(runner, batch_size=2, num_blocks=12), [(0, cold)])
    assert warm.cached_tokens == 0 and engine.scheduler.prefix_queries == 40
    assert warm.prompt_logprob_values == cold.prompt_logprob_values and warm.tokens == cold.tokens
    full = torch.log_softmax(ref(torch.tensor([warm.prompt]), None)[0].float(), dim=-1)
    want = full[torch.arange(len(warm.prompt) - 1), torch.tensor(warm.prompt[1:])]
    assert_close(torch.tensor([v for v, _ in warm.prompt_logprob_values]), want, "model.float32", "echo")


def test_metrics_count_the_queried_and_hit_tokens():
    from optimized.serving.driver import Driver

    runner, _ = _models()
    driver = Driver(_engine(runner, num_blocks=12)).start()
    try:
        for name in ("a", "b"):
            done = threading.Event()
            driver.submit(
                _request(name, BASE[:40]),
                lambda e, done=done: (isinstance(e, BaseException) or e.finished) and done.set(),
            )
            assert done.wait(timeout=60), f"request {name} did not finish"
    finally:
        driver.stop()
    text = driver.metrics.render()
    assert "qwen3_moe_prefix_cache_queries_total 80\n" in text
    assert "qwen3_moe_prefix_cache_hits_total 32\n" in text


# ---------------------------------------------------------------------------------------------- FP8 KV


@torch.no_grad()
def test_fp8_kv_warm_logits_equal_the_extend_over_the_same_prefix():
    from optimized import ModelRunner, load_model
    from optimized.executor.engine import Engine
    from optimized.executor.kv_cache import PagedKVCache, block_table
    from optimized.executor.prefix_cache import cache_identity
    from fixtures.checkpoints import checkpoint

    model = load_model(checkpoint("tiny"), dtype=torch.bfloat16)
    runner = ModelRunner(model, block_size=BLOCK, kv_cache_dtype="float8")
    assert runner.kv_cache_dtype == torch.float8_e4m3fn
    assert cache_identity(runner) != cache_identity(ModelRunner(model, block_size=BLOCK))
    engine = Engine(runner, batch_size=1, num_blocks=12, enable_prefix_caching=True)
    prompt = BASE[:40]
    run_engine(engine, [(0, _request("cold", prompt, max_tokens=2))])
    warm = _request("warm", prompt, max_tokens=2)
    run_engine(engine, [(0, warm)])
    assert warm.cached_tokens == 32 and engine.scheduler.prefix_hits == 32

    cache = PagedKVCache(
        runner.num_layers, 4, BLOCK, runner.kv_heads, runner.head_dim, runner.kv_cache_dtype, runner.device
    )
    table = block_table([cache.take(3)], runner.device)
    ids, meta, _ = runner.prefill_inputs([prompt[:32]], table[:, :2].contiguous())
    model(ids, meta, cache.layers)
    ids, meta, indices = runner.prefill_inputs([prompt[32:]], table, cached_lens=[32])
    want = model(ids, meta, cache.layers, logits_indices=indices)[0].float()
    assert_close(warm.logits[0], want, "model.fp8_kv.extend.bfloat16", "warm FP8 logits vs the direct extend")


# ---------------------------------------------------------------------------------------------- attention DP


# TP 1 x attention DP 2 (EP 2): each rank one DP group
DP_LAYOUT = dp_layout(2, 1)


@torch.no_grad()
def _dp_task(rank, world, path, lay):
    from equivalence.support.parallel_support import dtype_of, rank_model
    from equivalence.support.strategies import BLOCK_SIZE
    from optimized.executor.engine import Engine
    from optimized.executor.model_runner import ModelRunner
    from optimized.executor.scheduler import Request

    runner = ModelRunner(rank_model(path, lay, dtype_of("float32")), BLOCK_SIZE)
    engine = Engine(runner, batch_size=2, num_blocks=8, enable_prefix_caching=True)
    cold = [Request("c0", BASE[:36], 4), Request("c1", BASE[8:44], 4)]
    warm = [Request("w0", BASE[:36], 4), Request("w1", BASE[8:40] + [5, 6], 4)]
    mixed = [Request("w2", BASE[:36] + [1], 4), Request("n3", [3] * 20, 4)]  # an extend beside a plain prefill
    # each phase comes once the one before is done: each group hits its own pool
    for phase in (cold, warm, mixed):
        for r in phase:
            engine.add(r)
        while not engine.idle:
            engine.step()
    requests = cold + warm + mixed
    return {
        "tokens": [r.tokens for r in requests],
        "groups": [r.dp_group for r in requests],
        "cached": [r.cached_tokens for r in requests],
        "free": [p.free_blocks for p in engine.pools],
        "hits": engine.scheduler.prefix_hits,
    }


@pytest.mark.distributed
def test_attn_dp_each_group_hits_its_own_pool_the_same_on_every_rank():
    from equivalence.support.dist import get_pool
    from equivalence.support.parallel_support import same_on_all_ranks
    from fixtures.checkpoints import checkpoint

    got = same_on_all_ranks(
        get_pool(2).run(_dp_task, str(checkpoint("tiny")), DP_LAYOUT, timeout=180), "attn DP prefix caching"
    )
    assert got["groups"] == [0, 1, 0, 1, 0, 1] and got["cached"] == [0, 0, 32, 32, 32, 0] and got["hits"] == 96
    assert got["free"] == [7, 7]
    prompts = [BASE[:36], BASE[8:44], BASE[:36], BASE[8:40] + [5, 6], BASE[:36] + [1], [3] * 20]
    for prompt, tokens in zip(prompts, got["tokens"]):
        assert tokens == _greedy(tuple(prompt), 4)


@pytest.mark.distributed
def test_the_sequence_parallel_prefill_refuses_prefix_caching_by_name():
    from equivalence.support.dist import get_pool
    from equivalence.support.engine_runs import engine_refusal_task
    from equivalence.support.strategies import sp_layout
    from fixtures.checkpoints import checkpoint

    options = dict(batch_size=2, num_blocks=4, enable_prefix_caching=True)
    for refused in get_pool(2).run(
        engine_refusal_task, str(checkpoint("tiny")), sp_layout(2, "alltoall"), options, timeout=180
    ):
        assert refused and "enable_prefix_caching" in refused and "prefill_opt" in refused, refused
