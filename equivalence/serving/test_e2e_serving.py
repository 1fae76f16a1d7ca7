"""Continuous batching computes, per request, what the reference computes for that prompt alone.

Requests arrive at different engine steps (hypothesis draws prompts, arrival steps, batch size, the prefill token
budget and the KV pool size, so admission waits for blocks to free up); every request's fp32 greedy tokens must
equal the reference's greedy generation of its prompt alone, and the logits each token was chosen from must be
within `model.float32` of the reference's logits along the same tokens. The logprobs the engine reports are the
reference's log-softmax within the same tolerance.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from equivalence.support.compare import assert_close
from equivalence.support.engine_runs import (
    BLOCK,
    _models,
    reference_logits,
    run_engine,
)
from fixtures.checkpoints import checkpoint
from reference.generate import greedy_generate

pytestmark = pytest.mark.equivalence


prompt_st = st.lists(st.integers(0, 255), min_size=1, max_size=24)


@settings(max_examples=6)
@given(
    prompts=st.lists(prompt_st, min_size=1, max_size=4),
    data=st.data(),
    batch_size=st.integers(1, 3),
    budget=st.sampled_from([0, 24, 40]),
    spare_blocks=st.integers(0, 3),
)
def test_continuous_batching_greedy_equals_reference_per_request_fp32(prompts, data, batch_size, budget, spare_blocks):
    from optimized.executor.engine import Engine
    from optimized.executor.scheduler import Request

    runner, ref = _models()
    max_tokens = data.draw(st.lists(st.integers(1, 6), min_size=len(prompts), max_size=len(prompts)), "max_tokens")
    steps = data.draw(st.lists(st.integers(0, 5), min_size=len(prompts), max_size=len(prompts)), "arrival steps")
    requests = [
        Request(f"r{i}", p, n, record_logits=True, logprobs=2) for i, (p, n) in enumerate(zip(prompts, max_tokens))
    ]
    # A pool that holds the largest request plus a few blocks: admission has to wait for blocks to free up.
    largest = max(-(-r.budget // BLOCK) for r in requests)
    engine = Engine(runner, batch_size=batch_size, max_prefill_tokens=budget, num_blocks=1 + largest + spare_blocks)
    done = run_engine(engine, list(zip(steps, requests)))
    assert engine.cache.free_blocks == engine.cache.num_blocks - 1, "a finished request kept its KV blocks"
    for r in done:
        want = greedy_generate(ref, torch.tensor([r.prompt]), r.max_tokens)[0].tolist()
        assert r.tokens == want, f"{r.request_id} (arrived at step {r.arrival_step}): {r.tokens} != reference {want}"
        assert r.finish_reason == "length"
        expected = reference_logits(ref, r.prompt, r.tokens)
        assert_close(torch.stack(r.logits), expected, "model.float32", f"{r.request_id} logits")


def test_engine_logprobs_equal_reference_log_softmax():
    from optimized.executor.engine import Engine
    from optimized.executor.scheduler import Request

    runner, ref = _models()
    prompts = [[5, 9, 200, 17, 3], [44, 1, 2], list(range(30, 52))]
    requests = [Request(f"r{i}", p, 4, logprobs=3, prompt_logprobs=True) for i, p in enumerate(prompts)]
    engine = Engine(runner, batch_size=2, num_blocks=8)
    logprobs = {r.request_id: [] for r in requests}
    for i, r in enumerate(requests):
        engine.add(r)
    while not engine.idle:
        for event in engine.step()[1]:
            logprobs[event.request.request_id].append((event.token, event.logprob, event.top_logprobs))
    for r in requests:
        full = torch.log_softmax(ref(torch.tensor([r.prompt + r.tokens[:-1]]), None)[0].float(), dim=-1)
        gen = full[len(r.prompt) - 1 :]
        got = torch.tensor([lp for _, lp, _ in logprobs[r.request_id]])
        assert_close(
            got,
            gen[torch.arange(len(r.tokens)), torch.tensor(r.tokens)],
            "model.float32",
            f"{r.request_id} token logprobs",
        )
        top = torch.tensor([[v for _, v in t] for _, _, t in logprobs[r.request_id]])
        assert_close(top, torch.topk(gen, 3, dim=-1).values, "model.float32", f"{r.request_id} top-3 logprobs")
        assert [[t for t, _ in row] for _, _, row in logprobs[r.request_id]] == torch.topk(
            gen, 3, dim=-1
        ).indices.tolist()
        prompt_lp = torch.tensor([v for v, _ in r.prompt_logprob_values])
        want = full[torch.arange(len(r.prompt) - 1), torch.tensor(r.prompt[1:])]
        assert_close(prompt_lp, want, "model.float32", f"{r.request_id} prompt logprobs")


def _engine_run(runner, sampling):
    from optimized.executor.engine import Engine
    from optimized.executor.scheduler import Request

    prompts = [[5, 9, 200, 17, 3], [44, 1, 2], list(range(30, 52))]
    requests = [
        Request(f"r{i}", p, 4, sampling=sampling, logprobs=2, prompt_logprobs=True, record_logits=True)
        for i, p in enumerate(prompts)
    ]
    engine = Engine(runner, batch_size=2, max_prefill_tokens=24, num_blocks=5)
    events = []
    for step, request in enumerate(requests):  # one arrival per step
        engine.add(request)
        events += [(e.request.request_id, e.token, e.logprob, e.top_logprobs) for e in engine.step()[1]]
    while not engine.idle:
        events += [(e.request.request_id, e.token, e.logprob, e.top_logprobs) for e in engine.step()[1]]
    return events, [torch.stack(r.logits) for r in requests], [r.prompt_logprob_values for r in requests]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_engine_on_a_non_cpu_device_equals_the_cpu_engine(sampling):
    """The engine's own tensors (block tables, ids, chosen tokens, logprobs) live on the model's device: on the fake
    npu:0 (every operator refuses tensors of two devices) the engine gives bitwise the CPU engine's results."""
    from equivalence.support.fake_device import on_fake_device, register, to_host
    from optimized import ModelRunner, load_model
    from optimized.executor.sampling import GREEDY, SamplingParams

    params = GREEDY if sampling == "greedy" else SamplingParams(0.8, 20, 0.9, seed=3)
    with on_fake_device():
        model = load_model(checkpoint("tiny"), dtype=torch.float32, device=register())
        events, logits, prompt_lp = _engine_run(ModelRunner(model, block_size=BLOCK), params)
        logits = [to_host(t) for t in logits]
    want_events, want_logits, want_prompt_lp = _engine_run(_models()[0], params)
    assert events == want_events
    assert prompt_lp == want_prompt_lp
    for got, want in zip(logits, want_logits):
        assert torch.equal(got, want)
