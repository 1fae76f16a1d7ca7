"""Overlapped scheduling (scheduler_config.async_scheduling): a decode step is scheduled and launched before the
previous one is read back, and the engine shows exactly the tokens of the synchronous engine.

Hypothesis draws the arrival pattern: prompts, the step each request arrives at, max_tokens, greedy or seeded
sampling, logprobs, a stop token (one the request generates) and an abort after a given number of shown tokens.
The same requests run through the synchronous and the overlapped engine: every request shows the same tokens, the
same logprobs (bitwise: the batch-invariant mode, since the overlapped engine sees an arrival one step later and
batches differ) and ends the same way, and both pools return to full. An instrumented runner shows the overlap
itself: step N + 1's forward runs before step N's host read. Two gloo ranks serving through the driver and
`ranks.follow` take the same steps with the items broadcast only when there are some.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures.checkpoints import checkpoint

pytestmark = pytest.mark.equivalence

BLOCK = 16


@functools.lru_cache(maxsize=None)
def _runner():
    from optimized import ModelRunner, load_model

    model = load_model(checkpoint("tiny"), dtype=torch.float32)
    return ModelRunner(model, block_size=BLOCK, batch_invariant=True)


def _requests(specs, stops=None):
    from optimized.executor.sampling import GREEDY, SamplingParams
    from optimized.executor.scheduler import Request

    return [
        Request(
            f"r{i}",
            list(prompt),
            n,
            GREEDY if s is None else SamplingParams(*s),
            frozenset() if stops is None or stops[i] is None else frozenset({stops[i]}),
            logprobs=lp,
            stream=i,
        )
        for i, (prompt, n, s, lp) in enumerate(specs)
    ]


def _drive(requests, arrivals, aborts, overlapped: bool, batch_size: int):
    """Each request added at its arrival step, aborted once it has shown `aborts[i]` tokens; every shown event."""
    from optimized.executor.engine import Engine

    blocks = 1 + sum(-(-r.budget // BLOCK) for r in requests)  # every request's whole budget: no preemption
    engine = Engine(_runner(), batch_size=batch_size, num_blocks=blocks, async_scheduling=overlapped)
    shown = {r.request_id: [] for r in requests}
    pending, step = sorted(zip(arrivals, range(len(requests)))), 0
    while pending or not engine.idle:
        while pending and pending[0][0] <= step:
            engine.add(requests[pending.pop(0)[1]])
        for e in engine.step()[1]:
            got = shown[e.request.request_id]
            got.append((e.token, e.logprob, e.top_logprobs, e.finished))
            if len(got) == aborts[int(e.request.request_id[1:])] and not e.finished:
                engine.abort(e.request.request_id)
        step += 1
        assert step < 300, "the engine did not finish its requests"
    assert engine.cache.free_blocks == blocks - 1, "the pool did not return to full"
    assert all(r.in_flight == 0 for r in requests)
    return shown, [r.finish_reason for r in requests], engine


sampling_st = st.one_of(
    st.none(),
    st.tuples(st.sampled_from([0.8, 1.0]), st.sampled_from([0, 20]), st.sampled_from([1.0, 0.9]), st.integers(0, 99)),
)
request_st = st.tuples(
    st.lists(st.integers(0, 255), min_size=1, max_size=20),
    st.integers(1, 8),
    sampling_st,
    st.sampled_from([None, 0, 2]),
)


@settings(max_examples=12, deadline=None)
@given(specs=st.lists(request_st, min_size=1, max_size=5), batch_size=st.integers(1, 4), data=st.data())
def test_overlapped_scheduling_shows_the_synchronous_tokens(specs, batch_size, data):
    n = len(specs)
    arrivals = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n), "arrival steps")
    # a stop token the request generates (its k-th token without stops), or none; an abort after j shown tokens
    stop_at = data.draw(st.lists(st.one_of(st.none(), st.integers(0, 7)), min_size=n, max_size=n), "stop at")
    aborts = data.draw(st.lists(st.one_of(st.none(), st.integers(1, 7)), min_size=n, max_size=n), "abort after")
    free, _, _ = _drive(_requests(specs), arrivals, [None] * n, False, batch_size)
    stops = [None if k is None or k >= len(free[f"r{i}"]) else free[f"r{i}"][k][0] for i, k in enumerate(stop_at)]
    sync = _drive(_requests(specs, stops), arrivals, aborts, False, batch_size)
    overlapped = _drive(_requests(specs, stops), arrivals, aborts, True, batch_size)
    for i in range(n):
        rid = f"r{i}"
        assert overlapped[0][rid] == sync[0][rid], f"{rid}: overlapped {overlapped[0][rid]} != sync {sync[0][rid]}"
    assert overlapped[1] == sync[1], "finish reasons"


def _fixed(n_tokens: int = 6):
    return [
        ([5, 6, 7, 8], n_tokens, None, None),
        ([9] * 20, n_tokens, (1.0, 20, 0.9, 3), 2),
        ([1, 2], n_tokens, None, 0),
    ]


def test_decode_after_decode_overlaps_its_forward_before_the_previous_read(monkeypatch):
    """Every decode step after the first is launched while the previous one is still unread: the instrumented
    runner logs each forward and the engine each host read of a launched step."""
    from optimized.executor.engine import Engine

    runner, log = _runner(), []
    forward = runner.decode_forward
    monkeypatch.setattr(runner, "decode_forward", lambda *a: (log.append("forward"), forward(*a))[1])
    complete = Engine._complete
    monkeypatch.setattr(Engine, "_complete", lambda self, launched: (log.append("read"), complete(self, launched))[1])
    shown, _, engine = _drive(_requests(_fixed()), [0, 0, 0], [None] * 3, True, 3)
    decodes = 6 - 1  # after the prefill's first token
    assert log.count("forward") == decodes, log  # no step after the last (every row's last token in flight)
    assert engine.overlapped_steps == decodes - 1, log
    # forward N + 1 before read N: each read but the last comes after two unread forwards
    assert log == ["forward"] + ["forward", "read"] * (decodes - 1) + ["read"], log
    assert all(len(v) == 6 for v in shown.values())

    log.clear()
    _, _, engine = _drive(_requests(_fixed()), [0, 0, 0], [None] * 3, False, 3)
    assert log == ["forward"] * decodes and engine.overlapped_steps == 0, log


def test_an_arrival_reads_the_launched_step_back_before_its_prefill(monkeypatch):
    """A request arriving while decodes are launched: the launched step is read back first, and the prefill runs
    with nothing unread (an admission needs every token on the host)."""
    from optimized.executor.engine import Engine

    log = []
    for name in ("_prefill", "_launch", "_complete"):
        real = getattr(Engine, name)
        monkeypatch.setattr(Engine, name, lambda self, *a, _n=name, _f=real: (log.append(_n), _f(self, *a))[1])
    shown, _, engine = _drive(_requests(_fixed()), [0, 0, 3], [None] * 3, True, 3)
    at = [i for i, name in enumerate(log) if name == "_prefill"]
    assert len(at) == 2, log
    for i in at:  # every launched step read back before the prefill
        assert log[:i].count("_launch") == log[:i].count("_complete"), log
    assert log[at[1] - 1] == "_complete" and engine.overlapped_steps > 0, log
    assert all(len(v) == 6 for v in shown.values())


def _spy_launches(monkeypatch, what) -> list:
    """(launched steps not yet read, what(engine, step)) at each launch: 1 unread means step N + 1 launched before
    step N's read."""
    from optimized.executor.engine import Engine

    launches, unread = [], [0]
    launch, complete = Engine._launch, Engine._complete

    def spy_launch(self, step):
        launches.append((unread[0], what(self, step)))
        unread[0] += 1
        return launch(self, step)

    def spy_complete(self, launched):
        unread[0] -= 1
        return complete(self, launched)

    monkeypatch.setattr(Engine, "_launch", spy_launch)
    monkeypatch.setattr(Engine, "_complete", spy_complete)
    return launches


def test_decodes_overlap_while_requests_wait_for_room_in_the_batch(monkeypatch):
    """Batch 2, four requests at once: the later two wait while the first two decode, and those decodes still
    overlap (nothing can be admitted until a read frees a row); each admission comes after a read."""
    launches = _spy_launches(monkeypatch, lambda engine, step: engine.scheduler.num_waiting())
    specs = _fixed() + [([4, 4, 4], 6, None, None)]
    sync = _drive(_requests(specs), [0] * 4, [None] * 4, False, 2)
    overlapped = _drive(_requests(specs), [0] * 4, [None] * 4, True, 2)
    assert overlapped[0] == sync[0]
    assert any(unread == 1 and waiting for unread, waiting in launches), launches


def test_a_decode_that_preempts_overlaps_and_shows_the_same_tokens(monkeypatch):
    """Three requests whose growth empties a pool of 3 blocks: a decode launched while the previous one is unread
    preempts (the preempted request leaves with its token in flight; it is read before the request is admitted
    again and recomputed); the tokens are the synchronous engine's."""
    from optimized.executor.engine import Engine
    from optimized.executor.scheduler import Request

    launches = _spy_launches(monkeypatch, lambda engine, step: len(step.preempted))

    def run(overlapped: bool):
        prompts = [list(range(40, 55)), list(range(100, 114)), list(range(7, 22))]
        requests = [Request(f"r{i}", p, 12, stream=i) for i, p in enumerate(prompts)]
        engine = Engine(_runner(), batch_size=3, num_blocks=4, async_scheduling=overlapped)
        for r in requests:
            engine.add(r)
        preempted = 0
        while not engine.idle:
            step, _ = engine.step()
            preempted += len(step.preempted)
        assert engine.cache.free_blocks == 3
        return [r.tokens for r in requests], preempted, engine.overlapped_steps

    sync, overlapped = run(False), run(True)
    assert overlapped[0] == sync[0]
    assert overlapped[1] > 0 and overlapped[2] > 0, overlapped[1:]
    assert any(before == 1 and preempted for before, preempted in launches), launches


# ---- two ranks serving: the driver on rank 0, `ranks.follow` on rank 1


PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7], [2, 7, 1, 8]]


def _serve_two_ranks(rank: int, world_size: int, overlapped: bool):
    import time

    import torch.distributed as dist

    from optimized.executor.engine import Engine
    from optimized.executor.scheduler import Request
    from optimized.serving.driver import Driver
    from optimized.serving.ranks import StepBroadcast, follow

    engine = Engine(_runner(), batch_size=2, num_blocks=16, async_scheduling=overlapped)
    steps, step = [], engine.step

    def logged_step():
        s, events = step()
        steps.append((s.kind, tuple(r.request_id for r in s.requests), tuple(e.token for e in events)))
        return s, events

    engine.step = logged_step
    broadcast = StepBroadcast(dist.new_group(backend="gloo"))
    if rank:
        added, add = [], engine.add
        engine.add = lambda r: (added.append(r), add(r))[1]
        follow(engine, broadcast)
        return steps, {r.request_id: r.tokens for r in added}, broadcast.headers, broadcast.payloads
    driver = Driver(engine, broadcast=broadcast).start()
    tokens, done = {}, threading.Semaphore(0)

    def sink(rid):
        def take(item):
            assert not isinstance(item, BaseException), item
            tokens.setdefault(rid, []).append(item.token)
            if rid == "r1" and len(tokens[rid]) == 2:
                driver.abort(rid)
                done.release()
            elif item.finished:
                done.release()

        return take

    for i, prompt in enumerate(PROMPTS):
        driver.submit(Request(f"r{i}", prompt, 20 if i == 1 else 5), sink(f"r{i}"))
        time.sleep(0.05)
    for _ in PROMPTS:
        assert done.acquire(timeout=60), "a request did not finish"
    driver.stop()
    return steps, tokens, broadcast.headers, broadcast.payloads


@pytest.mark.distributed
@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "overlapped"])
def test_two_ranks_step_together_with_items_sent_only_when_there_are_some(overlapped):
    from equivalence.support.dist import get_pool
    from reference.checkpoint import load_model as load_reference
    from reference.generate import greedy_generate

    (steps0, tokens0, headers, payloads), (steps1, tokens1, _, payloads1) = get_pool(2).run(
        _serve_two_ranks, overlapped, timeout=180
    )
    assert steps0 == steps1, "the ranks took different steps"
    ref = load_reference(checkpoint("tiny"), torch.float32, router_dtype="float32")
    for i, prompt in enumerate(PROMPTS):
        want = greedy_generate(ref, torch.tensor([prompt]), 5)[0].tolist()
        rid = f"r{i}"
        assert tokens0[rid] == want[: len(tokens0[rid])] and tokens1[rid][: len(tokens0[rid])] == tokens0[rid]
        assert len(tokens0[rid]) == (2 if i == 1 else 5)
    assert payloads == payloads1 <= len(PROMPTS) + 1  # the adds and the abort, some perhaps together
    assert headers > payloads + 2, (headers, payloads)  # iterations with an empty inbox sent a header only
