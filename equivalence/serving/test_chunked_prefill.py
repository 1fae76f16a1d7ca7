"""Chunked prefill (`enable_chunked_prefill`, `max_num_batched_tokens`): a prompt prefilled in chunks over several
steps, each an extend over the blocks its earlier chunks wrote, in steps that also carry the running requests'
decode rows (one-token extends), generates what it generates unchunked, which is what the reference generates.

- chunked = unchunked = reference (hypothesis over prompt lengths, step budgets, arrival steps and pools small
  enough to preempt, so recomputes go in chunks too): fp32 greedy tokens equal the reference's, logits within
  `model.float32` of the reference's and of the unchunked run's, and the chunk counters prove the pieces happened;
- a decode row advances in every step in which a long prompt is prefilled beside it (a "mixed" step);
- seeded sampling (temperature, top-k, penalties) draws the same tokens chunked and unchunked;
- attention DP (2 gloo ranks): one group's decode row advances in each step in which the other group admits and
  prefills in chunks, the same on every rank, with the reference's tokens;
- echo (prompt logprobs) is prefilled whole in a plain prefill step of its own, its values the unchunked ones;
- the keys: the config refuses a budget under batch_size and max_prefill_tokens beside it, the engine a budget
  under its batch, and the sequence-parallel prefill (which cannot extend) the key by name.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from equivalence.support.compare import assert_close
from equivalence.support.attn_dp_runs import dp_layout
from equivalence.support.engine_runs import BLOCK, _models, reference_logits, run_engine
from reference.generate import greedy_generate

pytestmark = pytest.mark.equivalence


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * i + 3) % 251 for i in range(n)]


def _engine(runner, num_blocks: int, batch_size: int, budget: int):
    from optimized.executor.engine import Engine

    return Engine(runner, batch_size=batch_size, num_blocks=num_blocks, chunked_prefill_tokens=budget)


def _request(name, prompt, max_tokens, **kw):
    from optimized.executor.scheduler import Request

    return Request(name, list(prompt), max_tokens, record_logits=True, **kw)


@functools.lru_cache(maxsize=None)
def _greedy(prompt: tuple[int, ...], n: int) -> list[int]:
    return greedy_generate(_models()[1], torch.tensor([list(prompt)]), n)[0].tolist()


def _check_tables(engine) -> None:
    from optimized.executor.kv_cache import NULL_BLOCK

    running = engine.scheduler.running[engine.dp_rank]
    assert engine.batch.n == len(running)
    for row, r in enumerate(running):
        assert engine.batch.table[row].tolist() == r.blocks + [NULL_BLOCK] * (engine.batch.width - len(r.blocks))


def _run(engine, arrivals, max_steps: int = 800) -> list:
    pending, step = sorted(arrivals, key=lambda a: a[0]), 0
    while pending or not engine.idle:
        while pending and pending[0][0] <= step:
            engine.add(pending.pop(0)[1])
        engine.step()
        _check_tables(engine)
        step += 1
        assert step < max_steps, "the engine did not finish its requests"
    assert engine.cache.free_blocks == engine.cache.num_blocks - 1, "a block is still held"
    return [r for _, r in arrivals]


@settings(max_examples=6, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(1, 56), st.integers(1, 10), st.integers(0, 5)), min_size=1, max_size=3),
    budget=st.integers(3, 20),
    spare_blocks=st.integers(0, 3),
)
def test_chunked_equals_unchunked_equals_the_reference(specs, budget, spare_blocks):
    """Each request: a prompt of its own length, max_tokens, arrival step; batch 3 in a pool of the largest
    budget and a few spare blocks (requests are preempted and recomputed, in chunks when chunked)."""
    runner, ref = _models()

    def requests():
        return [(at, _request(f"r{i}", _prompt(i, n), m)) for i, (n, m, at) in enumerate(specs)]

    num_blocks = 1 + max(-(-(n + m) // BLOCK) for n, m, _ in specs) + spare_blocks
    chunked_engine = _engine(runner, num_blocks, 3, budget)
    chunked = _run(chunked_engine, requests())
    unchunked = _run(_engine(runner, num_blocks, 3, 0), requests())
    for c, u in zip(chunked, unchunked):
        assert c.tokens == u.tokens == _greedy(tuple(c.prompt), c.max_tokens), c.request_id
        got = torch.stack(c.logits)
        assert_close(got, reference_logits(ref, c.prompt, c.tokens), "model.float32", f"{c.request_id} vs reference")
        assert_close(got, torch.stack(u.logits), "model.float32", f"{c.request_id} chunked vs unchunked")
    for c in chunked:  # its first token only after its last chunk: at most `budget` of its tokens a step
        assert c.first_token_step - c.arrival_step >= -(-len(c.prompt) // budget), c.request_id
    s = chunked_engine.scheduler
    # every first prefill ran as pieces of at most `budget` tokens (recomputes add theirs)
    assert s.prefill_chunks >= sum(-(-len(r.prompt) // budget) for r in chunked)
    if any(len(r.prompt) > budget for r in chunked):
        assert s.partial_chunks > 0, "a prompt longer than the budget was not chunked"


def test_a_decode_row_advances_in_every_step_a_long_prompt_is_prefilled_beside_it():
    runner, _ = _models()
    engine = _engine(runner, num_blocks=12, batch_size=2, budget=8)
    running = _request("running", _prompt(1, 5), 20)
    engine.add(running)
    engine.step()
    long = _request("long", _prompt(2, 50), 3)
    engine.add(long)
    kinds = []
    while not long.tokens:
        before = len(running.tokens)
        step, _ = engine.step()
        kinds.append(step.kind)
        assert len(running.tokens) == before + 1, "the decode row stalled while the long prompt was prefilled"
    # 50 tokens at 7 a step (the decode row takes one of the 8): 8 chunks, the first token after the last
    assert kinds == ["mixed"] * 8 and engine.scheduler.partial_chunks == 7 and engine.scheduler.mixed_steps == 8
    while not engine.idle:
        engine.step()
    for r in (running, long):
        assert r.tokens == _greedy(tuple(r.prompt), r.max_tokens), r.request_id


def test_a_request_preempted_mid_prefill_is_recomputed_in_chunks():
    """A pool of 4 blocks: the decode row's growth takes the block of the request whose prompt is half
    prefilled; that request goes back to the queue (its chunks' blocks freed) and is prefilled again, in chunks."""
    runner, _ = _models()
    engine = _engine(runner, num_blocks=5, batch_size=2, budget=2)
    first, second = _request("first", _prompt(1, 5), 40), _request("second", _prompt(2, 40), 2)
    preempted_left = []
    engine.add(first)
    engine.step()
    engine.add(second)
    while not engine.idle:
        left = second.prefill_left
        step, _ = engine.step()
        preempted_left += [left for r, _ in step.preempted if r is second]
        _check_tables(engine)
    assert second.preemptions == 1 and len(preempted_left) == 1 and 0 < preempted_left[0] < 40, preempted_left
    # the first's 5 tokens in pieces of 2 (2 short of the end); the second's one token a piece beside the decode
    # row until preempted, then alone: 20 pieces of 2, 19 short of the end
    assert engine.scheduler.partial_chunks == 2 + (40 - preempted_left[0]) + 19, "the recompute was not chunked"
    for r in (first, second):
        assert r.tokens == _greedy(tuple(r.prompt), r.max_tokens), r.request_id
    assert engine.cache.free_blocks == engine.cache.num_blocks - 1


def test_with_prefix_caching_a_request_reuses_only_the_blocks_earlier_chunks_computed():
    """A's 48 tokens in chunks of 20: B (A's prompt and 10 more) is admitted in the step of A's last chunk, so it
    reuses the 2 full blocks A's first two chunks wrote, not the one A writes in that step; then C, after both,
    reuses all 3."""
    from optimized.executor.engine import Engine

    runner, _ = _models()
    engine = Engine(runner, batch_size=3, num_blocks=16, enable_prefix_caching=True, chunked_prefill_tokens=20)
    a = _request("a", _prompt(3, 48), 4)
    b = _request("b", _prompt(3, 48) + [9] * 10, 4)
    c = _request("c", _prompt(3, 48) + [8] * 3, 4)
    _run(engine, [(0, a), (2, b), (30, c)])
    assert [r.cached_tokens for r in (a, b, c)] == [0, 32, 48]
    assert engine.scheduler.partial_chunks >= 2
    for r in (a, b, c):
        assert r.tokens == _greedy(tuple(r.prompt), r.max_tokens), r.request_id


def test_seeded_sampling_draws_the_same_tokens_chunked_and_unchunked():
    from optimized.executor.sampling import SamplingParams

    runner, _ = _models()
    params = [
        SamplingParams(temperature=0.8, top_k=20, seed=5),
        SamplingParams(temperature=1.0, top_p=0.9, seed=9, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.7, seed=3, presence_penalty=0.4, min_tokens=3),
    ]

    def arrivals():
        lengths, at = (37, 12, 45), (0, 1, 3)
        return [(at[i], _request(f"s{i}", _prompt(i, lengths[i]), 16, sampling=p)) for i, p in enumerate(params)]

    chunked = run_engine(_engine(runner, 16, 3, 6), arrivals())
    unchunked = run_engine(_engine(runner, 16, 3, 0), arrivals())
    for c, u in zip(chunked, unchunked):
        assert c.tokens == u.tokens, c.request_id


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
    engine = Engine(runner, batch_size=2, num_blocks=8, chunked_prefill_tokens=6)
    running = Request("running", _prompt(1, 5), 12)
    engine.add(running)  # group 0
    engine.step()
    long = Request("long", _prompt(2, 40), 3)
    engine.add(long)  # group 1 (the least loaded)
    advanced = []
    while not long.tokens:
        before = len(running.tokens)
        step, _ = engine.step()
        advanced.append((step.kind, len(running.tokens) - before))
    while not engine.idle:
        engine.step()
    return {
        "groups": [running.dp_group, long.dp_group],
        "advanced": advanced,
        "tokens": [running.tokens, long.tokens],
        "chunks": engine.scheduler.partial_chunks,
    }


@pytest.mark.distributed
def test_attn_dp_a_decode_row_advances_while_the_other_group_admits_in_chunks():
    from equivalence.support.dist import get_pool
    from equivalence.support.parallel_support import same_on_all_ranks
    from fixtures.checkpoints import checkpoint

    got = same_on_all_ranks(
        get_pool(2).run(_dp_task, str(checkpoint("tiny")), DP_LAYOUT, timeout=180), "attn DP chunked prefill"
    )
    assert got["groups"] == [0, 1]
    # 40 prompt tokens at 6 a step in group 1: 7 mixed steps, group 0's decode row one token in each
    assert got["advanced"] == [("mixed", 1)] * 7 and got["chunks"] == 6
    assert got["tokens"] == [_greedy(tuple(_prompt(1, 5)), 12), _greedy(tuple(_prompt(2, 40)), 3)]


# ---------------------------------------------------------------------------------------------- the keys


def test_the_config_refuses_a_budget_under_the_batch_and_max_prefill_tokens_beside_it():
    from optimized.config import ConfigError, SchedulerConfig, _Checker

    def errors(**kw):
        found = []
        SchedulerConfig(**kw)._check(_Checker("scheduler_config", found))
        return dict(found)

    assert not errors(enable_chunked_prefill=True, batch_size=4, max_num_batched_tokens=4)
    assert not errors(batch_size=8, max_num_batched_tokens=4)  # off: the budget is not used
    assert "scheduler_config.max_num_batched_tokens" in errors(
        enable_chunked_prefill=True, batch_size=8, max_num_batched_tokens=4
    )
    assert "scheduler_config.max_prefill_tokens" in errors(enable_chunked_prefill=True, max_prefill_tokens=64)
    assert "scheduler_config.enable_chunked_prefill" in errors(enable_chunked_prefill="yes")
    assert issubclass(ConfigError, Exception)


def test_the_engine_refuses_a_budget_under_its_batch_by_name():
    from optimized.errors import UsageError

    runner, _ = _models()
    with pytest.raises(UsageError, match="max_num_batched_tokens=2"):
        _engine(runner, 8, 3, 2)


def test_echo_is_prefilled_whole_in_a_step_of_its_own_with_the_unchunked_prompt_logprobs():
    """A request asking for prompt logprobs waits for the group's prefill under way, then runs alone in a plain
    prefill step (its 30 tokens past the budget of 4); its prompt logprobs and tokens are the unchunked engine's."""
    runner, _ = _models()

    def arrivals():
        return [
            (0, _request("long", _prompt(1, 21), 12)),
            (1, _request("echo", _prompt(2, 30), 3, logprobs=1, prompt_logprobs=True)),
        ]

    engine = _engine(runner, 12, 2, 4)
    long, echo = (r for _, r in arrivals())
    engine.add(long)
    kinds = [engine.step()[0].kind]
    engine.add(echo)
    while not engine.idle:
        kinds.append(engine.step()[0].kind)
    # long's 21 tokens in 6 steps of 4 (the echo waits), then the echo alone, then both decode
    assert kinds[:7] == ["mixed"] * 6 + ["prefill"] and echo.first_token_step == 7, kinds
    _, cold = run_engine(_engine(runner, 12, 2, 0), arrivals())
    assert echo.prompt_logprob_values == cold.prompt_logprob_values and echo.tokens == cold.tokens
    assert long.tokens == _greedy(tuple(long.prompt), 12)


@pytest.mark.distributed
def test_the_sequence_parallel_prefill_refuses_chunked_prefill_by_name():
    from equivalence.support.dist import get_pool
    from equivalence.support.engine_runs import engine_refusal_task
    from equivalence.support.strategies import sp_layout
    from fixtures.checkpoints import checkpoint

    options = dict(batch_size=1, num_blocks=4, chunked_prefill_tokens=8)
    for refused in get_pool(2).run(
        engine_refusal_task, str(checkpoint("tiny")), sp_layout(2, "alltoall"), options, timeout=180
    ):
        assert refused and "enable_chunked_prefill" in refused and "prefill_opt" in refused, refused
