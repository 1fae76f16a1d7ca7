"""Plain unit tests of serving's host logic: the scheduler's admission rules, stop strings, percentiles."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from optimized.benchmarks.serve_bench import percentile
from optimized.executor.kv_cache import BlockPool
from optimized.executor.scheduler import Request, Scheduler
from optimized.serving.text import TextStream


@given(
    lens=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20)), min_size=1, max_size=8),
    batch=st.integers(1, 4),
    budget=st.sampled_from([0, 16, 48]),
    blocks=st.integers(4, 12),
)
def test_scheduler_admits_fifo_within_batch_budget_and_blocks(lens, batch, budget, blocks):
    s = Scheduler(batch, budget, 16, blocks)
    requests = []
    for i, (p, n) in enumerate(lens):
        r = Request(f"r{i}", [1] * p, n)
        try:
            s.add(r)
            requests.append(r)
        except ValueError:  # can never fit: refused at once, never queued
            assert (budget and p > budget) or s.blocks_needed(r) > blocks
    pool, order, steps = BlockPool(blocks + 1, 16), [], 0
    while not s.idle:
        free = pool.free_blocks
        step = s.schedule([pool])
        steps += 1
        assert steps < 1000
        if step.kind == "prefill":
            assert s.num_running() <= batch
            assert not budget or sum(len(r.prompt) for r in step.requests) <= budget
            # the prompt's blocks and the first decode token's, never the whole budget
            assert [len(r.blocks) for r in step.requests] == [
                math.ceil(min(len(r.prompt) + 1, r.budget - 1) / 16) for r in step.requests
            ]
            assert free - pool.free_blocks == sum(len(r.blocks) for r in step.requests)
            order += [r.request_id for r in step.requests]
        else:
            assert step.kind == "decode" and step.requests  # nothing admissible: decode, then finish one
            done = step.requests[0]
            s.remove(done)
            pool.release(done.blocks)
    assert order == [r.request_id for r in requests]  # first come, first served
    assert pool.free_blocks == blocks


@given(n=st.integers(1, 9), dp=st.integers(1, 4), batch=st.integers(1, 8))
def test_scheduler_deals_requests_of_equal_budgets_round_robin(n, dp, batch):
    """Under attention DP each request joins the group with the least load in tokens (lowest on a tie): a batch of
    equal budgets added together is dealt round robin, and a group never runs more than its share ceil(batch / D)
    at once."""
    s = Scheduler(batch, 0, 16, 100, dp_groups=dp)
    requests = [Request(f"r{i}", [1, 2], 3) for i in range(n)]
    for r in requests:
        s.add(r)
    assert [r.dp_group for r in requests] == [i % dp for i in range(n)]
    step = s.schedule([BlockPool(101, 16) for _ in range(dp)])
    assert step.kind == "prefill"
    assert all(len(g) <= -(-batch // dp) for g in s.running)
    assert [r.dp_group for r in step.requests] == sorted(r.dp_group for r in step.requests)  # group by group


def test_text_stream_stops_and_holds_back_partial_stops():
    class Chars:  # one character per id
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    t = TextStream(Chars(), ["XY"])
    out = [t.add(ord(c), False) for c in "abX"]
    assert out == ["a", "b", ""] and not t.stopped  # "X" may start the stop string: held back
    assert t.add(ord("Y"), False) == "" and t.stopped  # the stop string itself is never sent
    t = TextStream(Chars(), ["XY"])
    assert "".join(t.add(ord(c), i == 3) for i, c in enumerate("abXc")) == "abXc" and not t.stopped


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_max_prefill_tokens_is_a_non_negative_int():
    import pytest
    from optimized.config import ConfigError, InferenceConfig

    assert InferenceConfig.from_dict({}).scheduler_config.max_prefill_tokens == 0
    assert (
        InferenceConfig.from_dict({"scheduler_config": {"max_prefill_tokens": 512}}).scheduler_config.max_prefill_tokens
        == 512
    )
    for bad in (-1, 1.5, "x"):
        with pytest.raises(ConfigError) as e:
            InferenceConfig.from_dict({"scheduler_config": {"max_prefill_tokens": bad}})
        assert [k for k, _ in e.value.errors] == ["scheduler_config.max_prefill_tokens"]


def _serve_error(argv, capsys) -> str:
    import pytest
    from optimized.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    assert e.value.code == 2
    return capsys.readouterr().err


def test_serve_user_errors_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert "not found" in _serve_error(["--config", str(tmp_path / "none.yaml")], capsys)
    cfg = tmp_path / "dp.yaml"
    cfg.write_text(
        "model_config: {model_path: 'fixture:tiny'}\nparallel_config: {world_size: 2, attn_tp_size: 2, "
        "moe_ep_size: 2, embed_tp_size: 2, lmhead_tp_size: 2}\n"
    )
    err = _serve_error(["--config", str(cfg)], capsys)
    assert "parallel_config.world_size is 2" in err and "torchrun" in err
    assert "--port=70000" in _serve_error(["--config", str(cfg), "--port", "70000"], capsys)


def _load(s: Scheduler, g: int) -> int:
    """A group's load as the rule states it: its running and waiting requests' prompt + max_tokens."""
    return sum(len(r.prompt) + r.max_tokens for r in [*s.waiting[g], *s.running[g]])


@given(
    dp=st.integers(1, 5),
    sizes=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 24)), min_size=1, max_size=14),
    data=st.data(),
)
def test_a_new_request_joins_the_dp_group_of_least_load_in_tokens(dp, sizes, data):
    """Requests of drawn sizes arrive between steps (some admitted, some finished): each one joins a group whose
    load (the budgets of its running and waiting requests) is the least when it is added, the lowest-numbered of
    those on a tie; a batch added together to an idle scheduler is dealt as `deal` says (the plan's pool sizing)."""
    from optimized.executor.scheduler import deal

    s = Scheduler(8, 0, 16, 400, dp_groups=dp)
    pools = [BlockPool(401, 16) for _ in range(dp)]
    for i, (prompt, max_tokens) in enumerate(sizes):
        r = Request(f"r{i}", [1] * prompt, max_tokens)
        loads = [_load(s, g) for g in range(dp)]
        s.add(r)
        assert loads[r.dp_group] == min(loads), f"{r.request_id} joined load {loads[r.dp_group]} of {loads}"
        assert r.dp_group == loads.index(min(loads)), f"a tie goes to the lowest group: {loads}"
        if data.draw(st.booleans(), label="step"):
            step = s.schedule(pools)
            for done in data.draw(st.sets(st.sampled_from(step.requests)), label="finished") if step.requests else ():
                s.remove(done)
                pools[done.dp_group].release(done.blocks)
    budgets = [p + m for p, m in sizes]
    idle = Scheduler(8, 0, 16, 400, dp_groups=dp)
    requests = [Request(f"b{i}", [1] * p, m) for i, (p, m) in enumerate(sizes)]
    for r in requests:
        idle.add(r)
    assert [r.dp_group for r in requests] == deal(budgets, dp)


def test_a_long_request_outweighs_two_short_ones():
    """By tokens, not by count: a group holding one 500-token request is heavier than one holding two of 20."""
    s = Scheduler(8, 0, 16, 100, dp_groups=2)
    big, small_a, small_b, new = (Request(n, [1] * p, 4) for n, p in (("big", 496), ("a", 16), ("b", 16), ("n", 8)))
    for r in (big, small_a, small_b, new):
        s.add(r)
    assert [r.dp_group for r in (big, small_a, small_b, new)] == [0, 1, 1, 1]
    s.remove(small_a)
    s.remove(small_b)
    s.remove(new)
    later = Request("later", [1] * 8, 4)
    s.add(later)
    assert later.dp_group == 1, "finished requests no longer weigh on their group"
