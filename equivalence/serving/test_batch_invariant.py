"""Batch-invariant mode (model_config.batch_invariant): a request's logits, logprobs, prompt logprobs and tokens
are bitwise the same whatever it is batched with.

Hypothesis draws requests (prompts, some repeated as the `n` choices of one prompt are; greedy or seeded sampling),
their arrival steps, the batch size and the prefill token budget; each request is run alone in a fresh engine and
all together, in eager and in graph decode (prefill is eager in both). fp32, where the default mode differs: the CPU
GEMM rounds a row differently with the number of rows it is called with (MKL's fp32 path), so a prompt beside
another one had logits one ulp away from its own alone.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from equivalence.support.engine_runs import run_engine
from fixtures.checkpoints import checkpoint

pytestmark = pytest.mark.equivalence

BLOCK = 16


@functools.lru_cache(maxsize=None)
def _runner(exe_mode: str):
    from optimized import ModelRunner, load_model

    model = load_model(checkpoint("tiny"), dtype=torch.float32)
    return ModelRunner(model, block_size=BLOCK, exe_mode=exe_mode, batch_invariant=True)


def _request(i: int, prompt, max_tokens: int, params):
    from optimized.executor.scheduler import Request

    return Request(
        f"r{i}",
        list(prompt),
        max_tokens,
        params,
        logprobs=3,
        prompt_logprobs=True,
        record_logits=True,
    )


def _run(runner, specs, batch_size: int, arrivals: list[int], budget: int = 0):
    """The requests of `specs` run together, each with the (logprob, top-k) of its generated tokens."""
    from optimized.executor.engine import Engine

    requests = [_request(i, *spec) for i, spec in enumerate(specs)]
    blocks = 1 + sum(-(-r.budget // BLOCK) for r in requests)
    engine = Engine(runner, batch_size=batch_size, max_prefill_tokens=budget, num_blocks=blocks)
    step, pending = engine.step, {}

    def recording_step():
        kind, events = step()
        for e in events:
            pending.setdefault(e.request.request_id, []).append((e.logprob, e.top_logprobs))
        return kind, events

    engine.step = recording_step
    done = run_engine(engine, list(zip(arrivals, requests)))
    for r in done:
        r.logprob_values = pending.get(r.request_id, [])
    return done


def _assert_same(alone, together, what: str):
    assert together.tokens == alone.tokens, f"{what}: tokens {together.tokens} != alone {alone.tokens}"
    assert torch.equal(torch.stack(together.logits), torch.stack(alone.logits)), f"{what}: generated-token logits"
    assert together.logprob_values == alone.logprob_values, f"{what}: logprobs"
    assert together.prompt_logprob_values == alone.prompt_logprob_values, f"{what}: prompt logprobs"


sampling_st = st.one_of(
    st.just(None),
    st.builds(
        lambda t, k, p, s: (t, k, p, s),
        st.sampled_from([0.7, 1.0]),
        st.sampled_from([0, 5]),
        st.sampled_from([1.0, 0.9]),
        st.integers(0, 2**64 - 1),
    ),
)
mix_st = dict(
    prompts=st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=20), min_size=1, max_size=3),
    picks=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4), sampling_st), min_size=2, max_size=5),
    batch_size=st.integers(2, 4),
    budget=st.sampled_from([0, 16, 40]),
    data=st.data(),
)


def _check_mix(exe_mode, prompts, picks, batch_size, budget, data):
    from optimized.executor.sampling import GREEDY, SamplingParams

    runner = _runner(exe_mode)
    # requests as (prompt, max_tokens, params); a prompt picked twice is what `n` choices of one prompt are
    specs = [(prompts[p % len(prompts)], n, GREEDY if s is None else SamplingParams(*s)) for p, n, s in picks]
    arrivals = data.draw(st.lists(st.integers(0, 3), min_size=len(specs), max_size=len(specs)), "arrivals")
    together = _run(runner, specs, batch_size, arrivals, budget)
    for i, spec in enumerate(specs):
        alone = _run(runner, [spec], 1, [0])[0]
        _assert_same(alone, together[i], f"request {i} of {len(specs)} ({exe_mode})")


@settings(max_examples=10, deadline=None)
@given(**mix_st)
def test_a_request_is_bitwise_the_same_alone_and_in_any_batch_eager(prompts, picks, batch_size, budget, data):
    _check_mix("eager", prompts, picks, batch_size, budget, data)


@pytest.mark.slow
@settings(max_examples=4, deadline=None)
@given(**mix_st)
def test_a_request_is_bitwise_the_same_alone_and_in_any_batch_graph(prompts, picks, batch_size, budget, data):
    _check_mix("ge_graph", prompts, picks, batch_size, budget, data)


def test_loglikelihoods_are_identical_at_batch_sizes_1_and_4():
    """What an evaluation harness asks (echo, prompt logprobs, one token): every context + continuation's
    loglikelihood is the same float whether the requests come one at a time or four to a batch."""
    from optimized.executor.sampling import GREEDY

    runner = _runner("eager")
    gen = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in torch.randint(4, 30, (8,), generator=gen)
    ]

    def loglikelihoods(batch_size: int) -> list[float]:
        out = []
        for start in range(0, len(prompts), batch_size):
            group = [(p, 1, GREEDY) for p in prompts[start : start + batch_size]]
            for r in _run(runner, group, batch_size, [0] * len(group)):
                out.append(sum(lp for lp, _ in r.prompt_logprob_values[len(r.prompt) // 2 :]))  # the continuation's
        return out

    assert loglikelihoods(1) == loglikelihoods(4)
