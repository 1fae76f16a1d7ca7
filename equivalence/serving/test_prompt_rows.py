"""A prefill's kept prompt rows, batched: a request may ask for echo (the logprob of every prompt token) and for
prompt_positions (raw logits at chosen positions) at once, beside requests asking for one of them or neither. Each
request's echo values and prompt logits equal those of the same request asking for that one thing alone in its own
engine (batch-invariant, so bit for bit): the kept rows of a request are echo's first, then prompt_positions'."""

from __future__ import annotations

import functools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from equivalence.support.engine_runs import run_engine
from fixtures.checkpoints import checkpoint

BLOCK = 16


@functools.lru_cache(maxsize=None)
def _runner():
    from optimized import ModelRunner, load_model

    return ModelRunner(load_model(checkpoint("tiny"), dtype=torch.float32), block_size=BLOCK, batch_invariant=True)


def _run(requests):
    from optimized.executor.engine import Engine

    engine = Engine(_runner(), batch_size=len(requests), max_prefill_tokens=512, num_blocks=64)
    return run_engine(engine, [(0, r) for r in requests])


def _request(i, prompt, echo: bool, positions):
    from optimized.executor.scheduler import Request

    return Request(str(i), list(prompt), 2, logprobs=2, prompt_logprobs=echo, prompt_positions=positions)


asks = st.tuples(st.booleans(), st.booleans())  # (echo, prompt_positions)


@settings(max_examples=6, deadline=None)
@given(
    st.lists(st.tuples(st.lists(st.integers(1, 255), min_size=2, max_size=20), asks), min_size=2, max_size=4),
    st.data(),
)
def test_each_request_gets_its_own_prompt_rows_when_batched(specs, data):
    requests = []
    for i, (prompt, (echo, with_positions)) in enumerate(specs):
        positions = None
        if with_positions:
            positions = data.draw(st.lists(st.integers(0, len(prompt) - 1), min_size=1, max_size=4), label="positions")
        requests.append(_request(i, prompt, echo, positions))
    _run(requests)
    for r in requests:
        if r.prompt_logprobs:
            (alone,) = _run([_request(0, r.prompt, True, None)])
            assert r.prompt_logprob_values == alone.prompt_logprob_values, f"request {r.request_id}: echo"
            assert len(r.prompt_logprob_values) == len(r.prompt) - 1
        if r.prompt_positions is not None:
            (alone,) = _run([_request(0, r.prompt, False, r.prompt_positions)])
            assert torch.equal(r.prompt_logits, alone.prompt_logits), f"request {r.request_id}: prompt logits"
            assert r.prompt_logits.shape[0] == len(r.prompt_positions)


def test_echo_and_prompt_positions_together_in_one_request():
    """The case the layout exists for: both asks in one request, batched with an echo-only one."""
    prompt = [5, 9, 200, 17, 3, 44, 1, 2]
    both, other = _request(0, prompt, True, [7, 0, 3]), _request(1, [30, 31, 32, 33], True, None)
    _run([other, both])
    (echo,) = _run([_request(0, prompt, True, None)])
    (rows,) = _run([_request(0, prompt, False, [7, 0, 3])])
    assert both.prompt_logprob_values == echo.prompt_logprob_values
    assert torch.equal(both.prompt_logits, rows.prompt_logits)
    assert both.tokens == echo.tokens == rows.tokens
