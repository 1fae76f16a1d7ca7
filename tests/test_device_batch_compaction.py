"""Rows of the requests that leave in one step close up at once (optimized/executor/device_batch.py `remove_rows`):
one gather per tensor gives, bit for bit, the running rows that removing them one by one (each later row shifted up
per removal) gives; rows at the end only shorten the batch; the engine compacts once per step however many of its
requests finished in it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from optimized.executor.device_batch import DeviceBatch
from optimized.executor.sampling import GREEDY, SamplingParams
from optimized.executor.scheduler import Request

V = 11
PENALIZED = SamplingParams(repetition_penalty=1.3, logit_bias={3: 1.0})


class CountGathers(TorchFunctionMode):
    """Counts index_select calls (the compaction's gathers)."""

    def __init__(self):
        super().__init__()
        self.gathers = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.index_select, torch.Tensor.index_select):
            self.gathers += 1
        return func(*args, **(kwargs or {}))


def _batch(flags: list[bool], seed: int) -> DeviceBatch:
    """A batch of len(flags) running rows (penalized where the flag is on) with random contents in every tensor."""
    batch = DeviceBatch(len(flags) + 2, 4, torch.device("cpu"), V)
    requests = [Request(f"r{i}", [1 + i, 2], 3, PENALIZED if f else GREEDY) for i, f in enumerate(flags)]
    for r in requests:
        r.blocks = [1 + r.prompt[0]]
    batch.admit(requests)
    g = torch.Generator().manual_seed(seed)
    for t in batch._tensor_list():
        if t.dtype == torch.bool:
            t.copy_(torch.randint(0, 2, t.shape, generator=g).bool())
        elif t.is_floating_point():
            t.copy_(torch.rand(t.shape, generator=g))
        else:
            t.copy_(torch.randint(0, 1000, t.shape, generator=g))
    return batch


def _one_by_one(batch: DeviceBatch, order: list[int]) -> tuple[list[torch.Tensor], list[bool], int]:
    """The running rows (and the dummy) after removing rows `order` one at a time, as the engine did before: each
    removal shifts every later row of every tensor one place up. Returns (tensors, penalized flags, rows)."""
    tensors = [t.clone() for t in batch._tensor_list()]
    ids, flags, n = list(range(batch.n)), list(batch.penalized), batch.n
    for gone in order:
        row = ids.index(gone)
        for t in tensors:
            t[row : n - 1] = t[row + 1 : n].clone()
        del ids[row], flags[row]
        n -= 1
    return [torch.cat([t[:n], t[batch.dummy :]]) for t in tensors], flags, n


@given(
    flags=st.lists(st.booleans(), min_size=1, max_size=9),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_one_gather_equals_removing_the_rows_one_by_one(flags, seed, data):
    batch = _batch(flags, seed)
    order = data.draw(st.permutations(range(len(flags))).flatmap(lambda p: st.integers(0, len(p)).map(lambda k: p[:k])))
    want, want_flags, n = _one_by_one(batch, order)
    tail = set(order) == set(range(len(flags) - len(order), len(flags)))
    with CountGathers() as count:
        batch.remove_rows(order)
    assert batch.n == n and batch.penalized == want_flags
    assert (batch.penalties is None) == (not any(want_flags)), "the processor state lives while a row uses it"
    got = [torch.cat([t[:n], t[batch.dummy :]]) for t in batch._tensor_list()]
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"tensor {i} after removing rows {order}"
    if tail:
        assert count.gathers == 0, "rows at the end (a preemption) only shorten the batch"
    else:
        assert count.gathers == len(want), f"{count.gathers} gathers for {len(want)} tensors: one each"


def test_bad_rows_are_refused_naming_them():
    batch = _batch([False, True, False], 0)
    for rows in ([3], [1, 1], [-1]):
        with pytest.raises(IndexError, match=r"are not distinct running rows \(0..2\)"):
            batch.remove_rows(rows)
    assert batch.n == 3


@pytest.fixture(scope="module")
def runner():
    from fixtures.checkpoints import checkpoint
    from optimized import ModelRunner, load_model

    return ModelRunner(load_model(checkpoint("tiny"), dtype=torch.float32), block_size=16)


def test_a_step_finishing_several_requests_compacts_once(runner, monkeypatch):
    """Requests 0 and 2 of four finish in the same decode step (max_tokens 3), request 1 two steps later, 3 last:
    each step that finished any calls one compaction of all of them, with one gather per tensor where a row after
    them stays, and the requests left still generate their tokens alone."""
    from optimized.executor.engine import Engine

    calls = []
    remove_rows = DeviceBatch.remove_rows

    def counted(self, rows):
        with CountGathers() as count:
            remove_rows(self, rows)
        calls.append((list(rows), count.gathers, len(self._tensor_list())))

    monkeypatch.setattr(DeviceBatch, "remove_rows", counted)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]
    budgets = [3, 5, 3, 6]
    engine = Engine(runner, batch_size=4, num_blocks=16)
    requests = [Request(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, budgets))]
    for r in requests:
        engine.add(r)
    per_step = []
    while not engine.idle:
        calls.clear()
        step, events = engine.step()
        per_step.append((step.kind, sorted(e.request.request_id for e in events if e.finished), list(calls)))
    finishing = [(kind, done, c) for kind, done, c in per_step if done]
    assert [done for _, done, _ in finishing] == [["r0", "r2"], ["r1"], ["r3"]]
    for _, done, c in per_step:  # (a step with nothing leaving may call it with no rows: a no-op)
        assert len([x for x in c if x[0]]) == (1 if done else 0), per_step
    compactions = [[x for x in c if x[0]][0] for _, _, c in finishing]
    tensors = compactions[0][2]
    assert compactions == [([0, 2], tensors, tensors), ([0], tensors, tensors), ([0], 0, tensors)], (
        "one compaction per step: r0 and r2 together (one gather per tensor), r1 before r3 (r3 moves up), r3 the "
        "last row (no copy)"
    )
    for r, p, n in zip(requests, prompts, budgets):
        alone = Request("alone", p, n)
        solo = Engine(runner, batch_size=1, num_blocks=16)
        solo.add(alone)
        while not solo.idle:
            solo.step()
        assert r.tokens == alone.tokens, f"{r.request_id}: {r.tokens} != alone {alone.tokens}"
