"""KV blocks on demand with preemption: a request recomputed after a preemption ends with the tokens it would have
had without one.

The pool is too small for all the requests at once (it holds the largest request's budget and a block or two), so
running requests take blocks as they grow and the most recently admitted is preempted when none is left, then
admitted again and recomputed by a prefill of its prompt and the tokens it had. Hypothesis draws the prompts,
max_tokens, arrival steps, batch size and greedy or seeded sampling: every greedy request's fp32 tokens equal the
reference's greedy generation of its prompt alone, and every seeded request's tokens equal that request's alone in a
pool that holds it whole (its draw counter goes on where it stopped). A fixed case asserts that preemptions happen,
with logprobs, echo and recorded logits across the recompute, and that /metrics counts them.
"""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from equivalence.compare import assert_close
from equivalence.test_e2e_serving import BLOCK, _models, reference_logits, run_engine
from reference.generate import greedy_generate

pytestmark = pytest.mark.equivalence


def _blocks(r) -> int:
    return -(-r.budget // BLOCK)


def _alone(request) -> list[int]:
    """The request's tokens run alone in a pool that holds its whole budget."""
    from optimized.executor.engine import Engine
    from optimized.executor.scheduler import Request
    copy = Request(request.request_id, list(request.prompt), request.max_tokens, request.sampling,
                   stream=request.stream)
    run_engine(Engine(_models()[0], batch_size=1, num_blocks=1 + _blocks(copy)), [(0, copy)])
    return copy.tokens


def _check(done, ref) -> None:
    for r in done:
        assert r.finish_reason == "length"
        if r.sampling.greedy:
            want = greedy_generate(ref, torch.tensor([r.prompt]), r.max_tokens)[0].tolist()
            assert r.tokens == want, (f"{r.request_id} (preempted {r.preemptions} times): {r.tokens} != reference "
                                      f"{want}")
        else:
            want = _alone(r)
            assert r.tokens == want, f"{r.request_id} (preempted {r.preemptions} times): {r.tokens} != alone {want}"


sampling_st = st.one_of(st.none(), st.tuples(st.sampled_from([0.8, 1.0]), st.sampled_from([0, 20]),
                                             st.sampled_from([1.0, 0.9]), st.integers(0, 2**64 - 1)))


@settings(max_examples=5, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(8, 30), st.integers(4, 20), sampling_st), min_size=2, max_size=4),
       batch_size=st.integers(2, 4), spare_blocks=st.integers(0, 1), data=st.data())
def test_preempted_requests_end_with_the_tokens_they_would_have_had(specs, batch_size, spare_blocks, data):
    from optimized.executor.engine import Engine
    from optimized.executor.sampling import GREEDY, SamplingParams
    from optimized.executor.scheduler import Request
    runner, ref = _models()
    prompts = data.draw(st.tuples(*(st.lists(st.integers(0, 255), min_size=p, max_size=p) for p, _, _ in specs)),
                        "prompts")
    arrivals = data.draw(st.lists(st.integers(0, 4), min_size=len(specs), max_size=len(specs)), "arrival steps")
    requests = [Request(f"r{i}", list(p), n, GREEDY if s is None else SamplingParams(*s), stream=i)
                for i, (p, (_, n, s)) in enumerate(zip(prompts, specs))]
    num_blocks = 1 + max(map(_blocks, requests)) + spare_blocks      # too small for all of them at once
    engine = Engine(runner, batch_size=batch_size, num_blocks=num_blocks)
    done = run_engine(engine, list(zip(arrivals, requests)))
    assert engine.cache.free_blocks == num_blocks - 1, "the pool did not return to full"
    _check(done, ref)


def _fixed_case():
    """Three requests of 14 - 15 prompt tokens (one block each at admission) and 12 tokens each (two blocks of
    budget) in a pool of 3 blocks: all three are admitted, and when the first crosses into its second block the
    later ones are preempted."""
    from optimized.executor.sampling import GREEDY, SamplingParams
    from optimized.executor.scheduler import Request
    prompts = [list(range(40, 55)), list(range(100, 114)), list(range(7, 22))]
    params = [GREEDY, SamplingParams(1.0, 20, 0.9, seed=5), GREEDY]
    return [Request(f"r{i}", p, 12, q, stream=i, logprobs=2, prompt_logprobs=i == 2, record_logits=True)
            for i, (p, q) in enumerate(zip(prompts, params))]


def test_a_pool_too_small_for_all_preempts_and_recomputes_every_request_right():
    from optimized.executor.engine import Engine
    runner, ref = _models()
    requests = _fixed_case()
    engine = Engine(runner, batch_size=3, num_blocks=4)
    events = {r.request_id: [] for r in requests}
    preempted = []
    for r in requests:
        engine.add(r)
    while not engine.idle:
        step, step_events = engine.step()
        preempted += [r.request_id for r, _ in step.preempted]
        for e in step_events:
            events[e.request.request_id].append(e)
    assert preempted and sum(r.preemptions for r in requests) == len(preempted)
    assert engine.cache.free_blocks == 3
    _check(requests, ref)
    for r in requests:
        # one event, one logprob row and one logits row per token, across the recompute
        assert [e.token for e in events[r.request_id]] == r.tokens
        expected = reference_logits(ref, r.prompt, r.tokens)
        assert_close(torch.stack(r.logits), expected, "model.float32", f"{r.request_id} logits")
        lp = torch.log_softmax(expected, dim=-1)
        got = torch.tensor([e.logprob for e in events[r.request_id]])
        assert_close(got, lp[torch.arange(len(r.tokens)), torch.tensor(r.tokens)], "model.float32",
                     f"{r.request_id} logprobs")
    echo = requests[2]
    assert echo.preemptions, "the echo request was not preempted: the case no longer tests its recompute"
    assert len(echo.prompt_logprob_values) == len(echo.prompt) - 1, "the recompute replaced the prompt's logprobs"
    full = torch.log_softmax(ref(torch.tensor([echo.prompt]), None)[0].float(), dim=-1)
    want = full[torch.arange(len(echo.prompt) - 1), torch.tensor(echo.prompt[1:])]
    assert_close(torch.tensor([v for v, _ in echo.prompt_logprob_values]), want, "model.float32", "echo logprobs")


def test_metrics_count_the_preemptions():
    from optimized.executor.engine import Engine
    from optimized.serving.driver import Driver
    runner, _ = _models()
    requests = _fixed_case()
    driver = Driver(Engine(runner, batch_size=3, num_blocks=4)).start()
    done = threading.Semaphore(0)

    def sink(event):
        if isinstance(event, BaseException) or event.finished:
            done.release()
    try:
        for r in requests:
            driver.submit(r, sink)
        for _ in requests:
            assert done.acquire(timeout=60), "a request did not finish"
    finally:
        driver.stop()
    text = driver.metrics.render()
    count = sum(r.preemptions for r in requests)
    assert count > 0 and f"qwen3_moe_preemptions_total {count}\n" in text
    # a recompute is not a new prompt
    assert f"qwen3_moe_prompt_tokens_total {sum(len(r.prompt) for r in requests)}\n" in text
