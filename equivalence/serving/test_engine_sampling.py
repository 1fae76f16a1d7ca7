"""Sampling in the engine: a seeded request gets exactly the tokens it gets alone, whatever else is in the batch.

Greedy and sampled rows are chosen in one batched call (optimized/executor/sampling.py); each sampled row draws
with its own (seed, stream) key and its own draw counter. Hypothesis draws the requests (greedy or seeded with
temperature, top-k, top-p), their arrival steps and the batch size; every request is run alone in a fresh engine
and all together: the tokens must be identical. A batch whose sampled rows drew from another row's logits, or
with another row's key or counter, fails here.
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
def _runner():
    from optimized import ModelRunner, load_model

    return ModelRunner(load_model(checkpoint("tiny"), dtype=torch.float32), block_size=BLOCK)


def _request(i, prompt, max_tokens, params):
    from optimized.executor.scheduler import Request

    return Request(f"r{i}", list(prompt), max_tokens, params)


def _run(requests, batch_size: int, arrivals: list[int]):
    from optimized.executor.engine import Engine

    engine = Engine(_runner(), batch_size=batch_size, num_blocks=1 + sum(-(-r.budget // BLOCK) for r in requests))
    run_engine(engine, list(zip(arrivals, requests)))
    return [r.tokens for r in requests]


sampling_st = st.one_of(
    st.just(None),
    st.builds(
        lambda t, k, p, s: (t, k, p, s),
        st.sampled_from([0.7, 1.0, 1.5]),
        st.sampled_from([0, 5, 40]),
        st.sampled_from([1.0, 0.9, 0.5]),
        st.integers(0, 2**64 - 1),
    ),
)


@settings(max_examples=8, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.lists(st.integers(0, 255), min_size=1, max_size=20), st.integers(1, 6), sampling_st),
        min_size=2,
        max_size=5,
    ),
    batch_size=st.integers(2, 5),
    data=st.data(),
)
def test_a_seeded_request_draws_the_same_tokens_alone_and_batched(requests, batch_size, data):
    from optimized.executor.sampling import GREEDY, SamplingParams

    params = [GREEDY if s is None else SamplingParams(*s) for _, _, s in requests]
    arrivals = data.draw(st.lists(st.integers(0, 4), min_size=len(requests), max_size=len(requests)), "arrivals")
    together = _run(
        [_request(i, p, n, q) for i, ((p, n, _), q) in enumerate(zip(requests, params))], batch_size, arrivals
    )
    for i, ((prompt, n, _), q) in enumerate(zip(requests, params)):
        alone = _run([_request(i, prompt, n, q)], 1, [0])[0]
        assert together[i] == alone, f"request {i} ({q}): batched {together[i]} != alone {alone}"


def test_sampled_rows_draw_from_their_own_logits():
    """Two sampled requests with the same seed and stream but different prompts draw different tokens, and each
    equals its own run alone (a batch that fed every sampled row one row's logits would give them the same)."""
    from optimized.executor.sampling import SamplingParams

    q = SamplingParams(1.0, 0, 1.0, seed=11)
    prompts = [[5, 9, 200, 17], [44, 1, 2, 3, 250, 251]]
    together = _run([_request(0, prompts[0], 8, q), _request(1, prompts[1], 8, q)], 2, [0, 0])
    alone = [_run([_request(0, p, 8, q)], 1, [0])[0] for p in prompts]
    assert together == alone
    assert together[0] != together[1]


def test_the_draw_follows_the_counter_based_uniforms():
    """The sampled token is the inverse CDF of the filtered distribution at u = hash(seed, stream, draw): computed
    here by hand for one row, in vocabulary-sorted order."""
    from optimized.executor.sampling import BatchSampling, SamplingParams, choose, filtered_probs, seed_key, uniforms

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(0.9, 0, 0.8, seed=2**63 + 5)  # a 64-bit seed
    for draw in range(6):
        row = BatchSampling(
            torch.tensor([0.9]),
            torch.tensor([0]),
            torch.tensor([0.8]),
            torch.tensor([seed_key(params.seed, 0)]),
            torch.tensor([draw]),
        )
        got = int(choose(logits, row))
        probs = filtered_probs(logits, params)[0]
        order = torch.sort(logits[0].float() / 0.9, descending=True, stable=True).indices
        cdf = torch.cumsum(probs[order], 0)
        u = float(uniforms(torch.tensor([seed_key(params.seed, 0)]), torch.tensor([draw]))[0]) * float(cdf[-1])
        want = int(order[min(int((cdf <= u).sum()), 49)])
        assert got == want, f"draw {draw}: {got} != {want}"


def test_uniforms_are_uniform_and_distinct_per_stream():
    from optimized.executor.sampling import seed_key, uniforms

    draws = torch.arange(20000)
    u = uniforms(torch.full((20000,), seed_key(1, 0)), draws)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts - 2000).abs().max() < 200, counts  # ~4.5 sigma of a binomial(20000, 0.1)
    other = uniforms(torch.full((20000,), seed_key(1, 1)), draws)
    assert not torch.equal(u, other)
