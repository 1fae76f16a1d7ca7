"""KV blocks on demand (optimized/executor/scheduler.py), host bookkeeping only: a request takes its prompt's blocks
at admission and one more when its next token starts a block; when its group's pool is empty the group's most
recently admitted running request is preempted (blocks back, head of the waiting queue, tokens kept) and later
admitted again with its prompt and generated tokens to recompute."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from optimized.executor.kv_cache import BlockPool
from optimized.executor.scheduler import Request, Scheduler

BLOCK = 16


def _take_tokens(step, scheduler, pools, finished):
    """What the engine does after a step, without a model: every request of the step gets one token (its count),
    and a request at its max_tokens finishes and gives its blocks back."""
    for r in step.requests:
        r.tokens.append(len(r.tokens))
        if len(r.tokens) >= r.max_tokens:
            scheduler.remove(r)
            pools[r.dp_group].release(r.blocks)
            r.blocks = []
            finished.append(r.request_id)


def _four_in_a_full_pool():
    """Four requests of 15 prompt tokens (one block each at admission) in a pool of 4 blocks, after their prefill
    and one decode: the next decode writes position 16, the second block of each."""
    s, pool = Scheduler(4, 0, BLOCK, 4), BlockPool(5, BLOCK)
    a, b, c, d = (Request(name, [1] * 15, 10) for name in "abcd")
    for r in (a, b, c, d):
        s.add(r)
    for kind in ("prefill", "decode"):
        step = s.schedule([pool])
        assert step.kind == kind and not step.preempted and not step.grown
        _take_tokens(step, s, [pool], [])
    assert pool.free_blocks == 0 and [r.blocks for r in (a, b, c, d)] == [[1], [2], [3], [4]]
    return s, pool, (a, b, c, d)


def test_the_most_recently_admitted_running_request_is_preempted_for_a_block():
    s, pool, (a, b, c, d) = _four_in_a_full_pool()
    step = s.schedule([pool])
    assert step.kind == "decode"
    # a's next token needs a block: d (the last admitted) gives its own; then b's: c gives its own
    assert [(r.request_id, row) for r, row in step.preempted] == [("d", 3), ("c", 2)]
    assert [(r.request_id, column) for r, column in step.grown] == [("a", 1), ("b", 1)]
    assert a.blocks == [1, 4] and b.blocks == [2, 3] and c.blocks == [] and d.blocks == []
    assert step.requests == (a, b) and s.running == [[a, b]]
    assert list(s.waiting[0]) == [c, d], "preempted requests go back to the head of the queue, in admission order"
    assert (c.preemptions, d.preemptions, a.preemptions) == (1, 1, 0)
    assert c.tokens == [0, 1] and d.tokens == [0, 1], "a preempted request keeps the tokens it generated"


def test_a_preempted_request_is_admitted_again_with_its_tokens_and_alone_past_the_prefill_budget():
    s, pool, (a, b, c, d) = _four_in_a_full_pool()
    s.max_prefill_tokens = 16  # c's recompute prefill (15 prompt + 2 generated tokens) is past it
    _take_tokens(s.schedule([pool]), s, [pool], [])  # the preempting decode: a and b at 3 tokens
    for r in (a, b):  # they finish: 4 blocks free
        s.remove(r)
        pool.release(r.blocks)
    step = s.schedule([pool])
    assert step.kind == "prefill" and step.requests == (c,), "a recompute past the budget is admitted alone"
    assert c.prefill_ids == [1] * 15 + [0, 1]
    assert len(c.blocks) == 2  # its 17 tokens and the 18th, its first decode token: two blocks
    step = s.schedule([pool])
    assert step.requests == (d,)


def test_the_most_recent_request_preempts_itself():
    """b needs a block and is itself the most recently admitted: it gives its own back (a keeps running)."""
    s, pool = Scheduler(2, 0, BLOCK, 2), BlockPool(3, BLOCK)
    a, b = Request("a", [1] * 4, 10), Request("b", [1] * 15, 10)
    s.add(a)
    s.add(b)
    for _ in range(2):
        _take_tokens(s.schedule([pool]), s, [pool], [])
    step = s.schedule([pool])
    assert [(r.request_id, row) for r, row in step.preempted] == [("b", 1)] and not step.grown
    assert step.requests == (a,) and list(s.waiting[0]) == [b] and pool.free_blocks == 1


def test_admission_leaves_the_block_a_running_request_takes_at_its_next_decode():
    """a's next token starts its second block: x (two blocks at admission) is not admitted into the last two free
    blocks, which would make the next decode preempt it at once; a decodes and takes its block, x waits."""
    s, pool = Scheduler(4, 0, BLOCK, 3), BlockPool(4, BLOCK)
    a = Request("a", [1] * 15, 10)
    s.add(a)
    for _ in range(2):
        _take_tokens(s.schedule([pool]), s, [pool], [])
    x = Request("x", [1] * 20, 4)
    s.add(x)
    step = s.schedule([pool])
    assert step.kind == "decode" and step.requests == (a,) and not step.preempted
    assert [(r.request_id, column) for r, column in step.grown] == [("a", 1)]
    assert list(s.waiting[0]) == [x] and pool.free_blocks == 1


def test_preemption_stays_within_the_dp_group_that_ran_out():
    """Under attention DP each group has its own pool: group 0 running out preempts group 0's most recent request,
    not the last admitted of all (r3, in group 1)."""
    s = Scheduler(4, 0, BLOCK, 2, dp_groups=2)
    pools = [BlockPool(3, BLOCK), BlockPool(3, BLOCK)]
    # budgets of 25 each: dealt round robin (r1, r3 generate more than r0, r2 from shorter prompts)
    r0, r1, r2, r3 = (Request(f"r{i}", [1] * 15, 10) if i % 2 == 0 else Request(f"r{i}", [1] * 3, 22) for i in range(4))
    for r in (r0, r1, r2, r3):
        s.add(r)
    assert [r.dp_group for r in (r0, r1, r2, r3)] == [0, 1, 0, 1]
    for _ in range(2):
        _take_tokens(s.schedule(pools), s, pools, [])
    step = s.schedule(pools)
    assert [(r.request_id, row) for r, row in step.preempted] == [("r2", 1)]
    assert [(r.request_id, column) for r, column in step.grown] == [("r0", 1)]
    assert s.running == [[r0], [r1, r3]]


def test_a_request_whose_budget_cannot_fit_the_pool_alone_is_refused_by_its_sizes():
    s = Scheduler(2, 0, BLOCK, 3)
    try:
        s.add(Request("big", [1] * 40, 9))  # 49 tokens: 4 blocks of 16, the pool has 3
    except ValueError as e:
        assert "40 prompt + 9 max tokens need 4 KV blocks of 16; the pool has 3" in str(e)
    else:
        raise AssertionError("a request that can never fit was queued")
    s.add(Request("fits", [1] * 40, 8))  # 48 tokens: 3 blocks


request_st = st.tuples(st.integers(1, 40), st.integers(1, 30), st.integers(0, 6))  # prompt, max_tokens, arrival


def _simulate(specs, batch, budget, blocks, dp):
    """Run the scheduler over the requests with `_take_tokens` as the engine; checks the block bookkeeping every
    step and returns the log of steps (kinds, request ids, preemptions, growths)."""
    s = Scheduler(batch, budget, BLOCK, blocks, dp_groups=dp)
    pools = [BlockPool(blocks + 1, BLOCK) for _ in range(dp)]
    requests = [Request(f"r{i}", [1] * p, n) for i, (p, n, _) in enumerate(specs)]
    pending = sorted(zip((a for _, _, a in specs), range(len(specs))))
    log, finished, step_no, admitted_groups = [], [], 0, set()
    while pending or not s.idle:
        while pending and pending[0][0] <= step_no:
            s.add(requests[pending.pop(0)[1]])
        step = s.schedule(pools)
        step_no += 1
        assert step_no < 2000, "the scheduler did not finish its requests"
        if step.kind == "decode":  # a group that admitted in the prefill before: its admission left headroom
            assert not [r for r, _ in step.preempted if r.dp_group in admitted_groups], (
                "the decode right after a prefill preempted in a group that admitted"
            )
        for g in range(dp):
            held = [b for r in s.running[g] for b in r.blocks]
            assert len(held) == len(set(held)) and 0 not in held
            assert len(held) + pools[g].free_blocks == blocks, f"group {g} lost blocks"
            assert all(not r.blocks for r in s.waiting[g]), "a waiting request holds blocks"
            for r in s.running[g] if step.kind == "decode" else ():
                assert len(r.blocks) * BLOCK >= r.length + 1, f"{r.request_id} decodes past its blocks"
        if step.kind == "prefill":
            for r in step.requests:
                assert len(r.blocks) * BLOCK >= len(r.prefill_ids), f"{r.request_id}'s prefill past its blocks"
            for g in range(dp):
                admitted = [r for r in step.requests if r.dp_group == g]
                assert not budget or len(admitted) == 1 or sum(len(r.prefill_ids) for r in admitted) <= budget
        log.append(
            (
                step.kind,
                [r.request_id for r in step.requests],
                [(r.request_id, row) for r, row in step.preempted],
                [(r.request_id, c) for r, c in step.grown],
            )
        )
        _take_tokens(step, s, pools, finished)
        admitted_groups = {r.dp_group for r in step.requests} if step.kind == "prefill" else set()
    assert all(len(r.tokens) == r.max_tokens for r in requests)
    assert all(p.free_blocks == blocks for p in pools), "the pool did not return to full"
    return log


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(request_st, min_size=2, max_size=8),
    batch=st.integers(2, 4),
    budget=st.sampled_from([0, 40, 64]),
    spare=st.integers(0, 2),
    dp=st.integers(1, 2),
)
def test_blocks_on_demand_keep_the_books_and_finish_every_request_deterministically(specs, batch, budget, spare, dp):
    largest = max(-(-(p + n) // BLOCK) for p, n, _ in specs)
    blocks = largest + spare  # fits every request alone; often not all of them at once
    specs = [(min(p, budget) if budget else p, n, a) for p, n, a in specs]
    log = _simulate(specs, batch, budget, blocks, dp)
    assert log == _simulate(specs, batch, budget, blocks, dp), "the same requests gave other decisions"
    if blocks >= sum(-(-(p + n) // BLOCK) for p, n, _ in specs):
        assert not any(preempted for _, _, preempted, _ in log), "a pool that holds every budget preempted"
