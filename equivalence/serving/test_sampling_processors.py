"""Logits processors (logit_bias, min_tokens, repetition / frequency / presence penalties): the engine's batched,
device-resident form (optimized/executor/sampling.py `apply_penalties` over `DeviceBatch` state) equals the plain
per-row reference (reference/sampling.py) bit for bit on the processed float32 logits, and an engine run with them
equals the reference model's greedy loop with the reference processors, preemptions and recomputes included.

Hypothesis draws the batch: rows with and without processors, their prompts, their generated tokens (some written
at admission, as a recompute rebuilds them, the rest recorded step by step as the engine does), stop ids, logits
with ties and zeros, and a row removed from the middle (the rows close up).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from equivalence.support.engine_runs import BLOCK, _models, run_engine
from reference.generate import greedy_generate
from reference.sampling import greedy_generate_processed, process_with

pytestmark = pytest.mark.equivalence

V = 40

params_st = st.one_of(
    st.none(),
    st.builds(
        dict,
        presence_penalty=st.sampled_from([0.0, 0.5, -1.3, 2.0]),
        frequency_penalty=st.sampled_from([0.0, 0.7, -2.0, 1.1]),
        repetition_penalty=st.sampled_from([1.0, 1.3, 0.6, 2.5]),
        logit_bias=st.dictionaries(
            st.integers(0, V - 1), st.sampled_from([-100.0, -3.7, 0.0, 0.25, 100.0]), max_size=5
        ),
        min_tokens=st.integers(0, 4),
    ),
)
row_st = st.tuples(
    params_st,
    st.lists(st.integers(0, V - 1), min_size=1, max_size=12),  # prompt
    st.lists(st.integers(0, V - 1), max_size=8),  # generated
    st.integers(0, 8),  # of which at admission
    st.frozensets(st.integers(0, V - 1), max_size=3),
)  # stop ids


def _batch(rows):
    from optimized.executor.device_batch import DeviceBatch
    from optimized.executor.sampling import GREEDY, SamplingParams
    from optimized.executor.scheduler import Request

    batch = DeviceBatch(len(rows), 2, torch.device("cpu"), V)
    requests = []
    for i, (params, prompt, generated, admitted, stops) in enumerate(rows):
        q = GREEDY if params is None else SamplingParams(**params)
        r = Request(f"r{i}", prompt, 16, q, stop_ids=stops, blocks=[1])
        r.tokens = generated[:admitted]  # what a recompute after a preemption admits with
        requests.append(r)
    batch.admit(requests)
    return batch, requests


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(row_st, min_size=1, max_size=6), data=st.data())
def test_batched_processors_equal_the_reference_bit_for_bit(rows, data):
    from optimized.executor.sampling import apply_penalties, choose

    batch, requests = _batch(rows)
    # the rest of each row's generated tokens, recorded step by step (all rows step together; a finished one pads)
    steps = max(len(g) - min(a, len(g)) for _, _, g, a, _ in rows)
    for s in range(steps):
        chosen = torch.tensor([g[min(a, len(g)) + s] if min(a, len(g)) + s < len(g) else 0 for _, _, g, a, _ in rows])
        before = batch.sampling.draws.clone()
        batch.record(0, len(rows), chosen, decoded=True)
        for i, (_, _, g, a, _) in enumerate(rows):
            if min(a, len(g)) + s < len(g):
                requests[i].tokens.append(int(chosen[i]))
            else:  # undo the pad's count and draw: this row has no token this step
                if batch.penalties is not None:
                    batch.penalties.counts[i, 0] -= 1
                batch.sampling.draws[i] = before[i]
    if data.draw(st.booleans(), "remove a row") and len(rows) > 1:
        gone = data.draw(st.integers(0, len(rows) - 2), "removed row")
        batch.remove(gone)
        requests.pop(gone)
    n = batch.n
    logits = data.draw(
        st.lists(
            st.lists(st.sampled_from([0.0, -0.0, 1.5, -2.25, 3.0, 7.125, -11.0, 0.1]), min_size=V, max_size=V),
            min_size=n,
            max_size=n,
        ),
        "logits",
    )
    logits = torch.tensor(logits, dtype=torch.float32) + torch.randn(n, V) * data.draw(st.sampled_from([0.0, 1.0]))
    penalties = batch.penalty_rows(0, n)
    if not any(r.sampling.penalized for r in requests):
        assert penalties is None, "a batch without processors kept their state"
        got = logits
    else:
        got = apply_penalties(logits, penalties, batch.sampling.draws[:n])
    want = torch.stack(
        [process_with(logits[i], r.sampling, r.prompt, r.tokens, r.stop_ids) for i, r in enumerate(requests)]
    )
    assert torch.equal(got, want), (got - want).abs().max()
    if penalties is not None:  # the greedy choice is the argmax of the processed logits
        assert torch.equal(choose(logits, None, penalties, batch.sampling.draws[:n]), want.argmax(-1))


def test_penalty_state_is_allocated_only_while_a_row_uses_it():
    from optimized.executor.sampling import SamplingParams

    rows = [
        (None, [1, 2], [], 0, frozenset()),
        ({"repetition_penalty": 1.2}, [3], [], 0, frozenset()),
        (None, [4], [], 0, frozenset()),
    ]
    batch, _ = _batch(rows)
    assert batch.penalties is not None and batch.penalty_rows(0, 1) is None and batch.penalty_rows(0, 2) is not None
    batch.remove(1)
    assert batch.penalties is None
    assert not SamplingParams().penalized and SamplingParams(min_tokens=1).penalized


# ---------------------------------------------------------------------------------------------- end to end

# 12 to 15 tokens: every request starts its second KV block while it decodes (a small pool preempts)
PROMPTS = [[5, 9, 200, 17, 3] * 3, [44, 1, 2] * 4, list(range(30, 44)), [3, 3, 3, 7] * 3, [1, 2, 3, 4, 5, 6] * 2 + [9]]


def _cases(plain):
    """Processor settings per prompt, each with an effect on the tiny model's greedy tokens `plain`."""
    return [
        ({"repetition_penalty": 1.8}, frozenset()),
        ({"frequency_penalty": 2.0, "presence_penalty": 0.5}, frozenset()),
        ({"logit_bias": {plain[2][0]: -100.0, 7: 3.0}}, frozenset()),
        ({"min_tokens": 4}, frozenset({plain[3][0], plain[3][1]})),  # its first tokens are its stop ids
        ({"presence_penalty": -2.0, "repetition_penalty": 0.7, "logit_bias": {11: 2.5}}, frozenset({0})),
    ]


@pytest.mark.parametrize("pool", ["whole", "preempting"])
def test_engine_with_processors_equals_the_reference_greedy_loop(pool):
    from optimized.executor.engine import Engine
    from optimized.executor.sampling import SamplingParams
    from optimized.executor.scheduler import Request

    runner, ref = _models()
    n = 8
    plain = [greedy_generate(ref, torch.tensor([p]), n)[0].tolist() for p in PROMPTS]
    cases = _cases(plain) + [(None, frozenset())]
    prompts = PROMPTS + [[9, 8, 7] * 4]  # a row without processors
    requests = [
        Request(f"r{i}", p, n, SamplingParams(**q) if q else SamplingParams(), stop_ids=stops)
        for i, (p, (q, stops)) in enumerate(zip(prompts, cases))
    ]
    largest = max(-(-r.budget // BLOCK) for r in requests)
    blocks = 1 + (largest + 1 if pool == "preempting" else sum(-(-r.budget // BLOCK) for r in requests))
    engine = Engine(runner, batch_size=4, num_blocks=blocks)
    run_engine(engine, [(i % 3, r) for i, r in enumerate(requests)])
    if pool == "preempting":
        assert any(r.preemptions for r in requests), "the small pool preempted nothing"
    for i, r in enumerate(requests):
        want = greedy_generate_processed(ref, r.prompt, n, r.sampling, r.stop_ids)
        assert r.tokens == want, f"{r.request_id} {r.sampling}: engine {r.tokens} != reference {want}"
        if i < len(PROMPTS):
            assert r.tokens != plain[i], f"{r.request_id}: the processors changed nothing, the case proves nothing"
    assert engine.batch.penalties is None, "the penalty state outlived its rows"


def test_logit_bias_forces_a_token_and_min_tokens_holds_back_eos():
    from optimized.executor.engine import Engine
    from optimized.executor.sampling import SamplingParams
    from optimized.executor.scheduler import Request

    runner, _ = _models()
    forced = Request("f", [5, 9, 200], 5, SamplingParams(logit_bias={123: 100}))
    sampled = Request("s", [5, 9, 200], 5, SamplingParams(1.0, seed=3, logit_bias={77: 100}))
    plain = Request("p", [44, 1, 2], 6)
    engine = Engine(runner, batch_size=3, num_blocks=8)
    run_engine(engine, [(0, forced), (0, sampled), (0, plain)])
    eos = plain.tokens[0]
    held = Request("m", [44, 1, 2], 6, SamplingParams(min_tokens=3), stop_ids=frozenset({eos}))
    free = Request("e", [44, 1, 2], 6, stop_ids=frozenset({eos}))
    run_engine(engine, [(0, held), (0, free)])
    assert forced.tokens == [123] * 5 and sampled.tokens == [77] * 5
    assert free.tokens == [eos] and free.finish_reason == "stop"
    assert eos not in held.tokens[:3] and len(held.tokens) >= 3
