"""`bench --host-overhead`: the engine's host time per decode step is the step's wall time minus its forward's, both
on the engine's clock. A fake clock makes it exact: every forward takes 5 units, the engine's read back 2 more, so
each decode step is 7 units of which 2 are the host's (no timing of real work is asserted)."""

from __future__ import annotations

import pytest
import torch

from fixtures.checkpoints import checkpoint


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture(scope="module")
def runner():
    from optimized import ModelRunner, load_model

    return ModelRunner(load_model(checkpoint("tiny"), dtype=torch.float32), block_size=16)


def _slow_steps(runner, monkeypatch, engine_class, read_method: str):
    """A fake clock on the runner: each decode forward takes 5 units, each call of the engine's `read_method` (its
    host read) 2. Returns the slowed forward."""
    clock = FakeClock()
    monkeypatch.setattr(runner, "clock", clock)
    forward, read = runner.decode_forward, getattr(engine_class, read_method)

    def slow_forward(*a):
        clock.now += 5.0
        return forward(*a)

    def slow_read(self, *a):
        clock.now += 2.0
        return read(self, *a)

    monkeypatch.setattr(runner, "decode_forward", slow_forward)
    monkeypatch.setattr(engine_class, read_method, slow_read)
    return slow_forward


def test_host_overhead_is_the_step_minus_its_forward(runner, monkeypatch):
    from optimized.benchmarks.host_overhead import format_report, measure
    from optimized.executor.engine import Engine

    slow_forward = _slow_steps(runner, monkeypatch, Engine, "_read")
    row = measure(runner, [[1, 2, 3], [4, 5, 6, 7]], decode_steps=3, rounds=2)
    assert row["batch"] == 2 and row["steps"] == 3
    assert row["step_ms"] == 7000.0 and row["forward_ms"] == 5000.0 and row["host_ms"] == 2000.0
    assert row["host_share"] == pytest.approx(2 / 7)
    assert "28.57%" in format_report([row], "tiny")
    assert runner.decode_forward is slow_forward  # measure put the runner's decode back


def test_overlapped_host_overhead_is_the_cycle_minus_the_synchronous_forward(runner, monkeypatch):
    """Overlapped, a call launches the next decode before it reads the last: with a forward of 5 units and a read of
    2, the decode calls of 3 steps take 5 + 5 + 2 (two launches, one read), 5 + 2 and 2 (the last read alone)."""
    from optimized.benchmarks.host_overhead import format_report, measure_overlapped
    from optimized.executor.engine import Engine

    slow_forward = _slow_steps(runner, monkeypatch, Engine, "_complete")
    row = measure_overlapped(runner, [[1, 2, 3], [4, 5, 6, 7]], decode_steps=3, forward_ms=5000.0, rounds=2)
    assert row["overlap"] and row["batch"] == 2 and row["steps"] == 3
    assert row["step_ms"] == 7000.0 and row["forward_ms"] == 5000.0 and row["host_ms"] == 2000.0
    assert runner.async_scheduling is False and runner.decode_forward is slow_forward  # measure put them back
    assert "      on" in format_report([row], "tiny")


def test_bench_host_overhead_command_reports_both_batches(tmp_path, capsys):
    import json
    from optimized.__main__ import main

    out = tmp_path / "h.json"
    assert (
        main(
            [
                "bench",
                "--preset",
                "tiny",
                "--layers",
                "1",
                "--host-overhead",
                "--host-overhead-batches",
                "1,3",
                "--host-overhead-overlap",
                "--decode-steps",
                "2",
                "--repeats",
                "1",
                "--prompt-len",
                "8",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["host_overhead"]
    assert [(r["batch"], r["overlap"]) for r in rows] == [(1, False), (1, True), (3, False), (3, True)]
    assert all(r["steps"] == 2 for r in rows)
    assert all(r["step_ms"] >= r["forward_ms"] > 0 for r in rows if not r["overlap"]), rows
    assert "engine host overhead per decode step" in capsys.readouterr().out
