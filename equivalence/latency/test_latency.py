"""`pytest -m latency`: the budgets of optimized/benchmarks/budgets.yaml, measured. Collected only when `-m`
names `latency` (conftest.py): the default run asserts no timing.

- NPU budgets (kind absolute): on matching hardware, `torchrun ... -m optimized latency` measures the budget
  (one process per rank, device sync, warm-up, repeats; once per budget and session, shared by its phases
  and by xdist workers through a lock file); p50 must not exceed the limit; the physical floor
  (optimized.benchmarks.floor) is reported beside it, with the table's and the measured collective latency.
  Elsewhere the test skips naming the hardware; on it, a budget naming a checkpoint kind fails when none is given.
- CPU budgets (kind relative): optimized vs reference in this process, interleaved rounds; the ratios of p50s
  are reported, and fail only beyond a limit no load seen here reaches (budgets.yaml says what was measured).
Both fail a broken measurement: a p50 below the physical floor, or fewer samples than the rounds make.
Every result, skipped ones with their reasons, goes to the JSON report of `--latency-report PATH`, with the
weights measured (a checkpoint, or random weights and their routing skew).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess

import pytest

from optimized.benchmarks.budget_run import launch_command, run_relative
from optimized.benchmarks.budgets import CHECKPOINT_ENV, budget_floor, load_budgets, phase_report, this_host

pytestmark = pytest.mark.latency

BUDGETS = load_budgets()
HOST = this_host()
LAUNCH_TIMEOUT_S = 3600  # a 235B checkpoint load on 16 ranks plus the timed rounds


def _absolute_cases():
    return [
        pytest.param(name, phase, id=f"{name}-{phase}")
        for name, b in BUDGETS.items()
        if b.kind == "absolute"
        for phase in b.phases
    ]


def _skip(record_property, budget, phase, reason):
    record_property(
        "latency",
        {
            "budget": budget.name,
            "phase": phase,
            "kind": budget.kind,
            "description": budget.description,
            "skipped": reason,
        },
    )
    pytest.skip(reason)


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    """A directory only this session uses, shared by its xdist workers (their temp dirs' common parent)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _measure_absolute(budget, shared_dir, checkpoint):
    """The budget's raw samples, launched once per session whichever worker asks first."""
    raw = shared_dir / f"latency-{budget.name}.raw.json"
    with open(shared_dir / f"latency-{budget.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not raw.exists():
            cmd = launch_command(budget, raw, model_path=checkpoint)
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
            if done.returncode != 0 or not raw.exists():
                pytest.fail(
                    f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
                )
    return json.loads(raw.read_text())


@pytest.mark.parametrize("name, phase", _absolute_cases())
def test_npu_budget(name, phase, record_property, shared_dir, request):
    budget = BUDGETS[name]
    reason = budget.skip_reason(phase, HOST)
    if reason:
        _skip(record_property, budget, phase, reason)
    checkpoint = request.config.getoption("latency_checkpoint") or os.environ.get(CHECKPOINT_ENV)
    missing = budget.missing_checkpoint(checkpoint)
    if missing:  # the hardware is here: not measuring is a failure, not a skip
        pytest.fail(missing)
    raw = _measure_absolute(budget, shared_dir, checkpoint)
    floor = budget_floor(budget, phase)
    report = phase_report(budget, phase, raw["samples_s"][phase], floor["floor_s"])
    report.update(
        host_soc=raw["soc"],
        model=raw["model"],
        weights=raw["weights"],
        routing_skew=raw.get("routing_skew"),
        floor={k: v for k, v in floor.items() if k.endswith("_s")},
    )
    if phase == "decode" and raw.get("collective_latency_s"):
        measured = budget_floor(budget, phase, collective_latency=raw["collective_latency_s"])
        report["floor_ms_measured_collective_latency"] = 1000 * measured["floor_s"]
    record_property("latency", report)
    ms = report["ms"]
    line = (
        f"{name} {phase} ({report['weights']}): p50 {ms['p50']:.2f} ms, budget {report['limit_ms']} ms (p90 "
        f"{ms['p90']:.2f}, p99 {ms['p99']:.2f}; floor {report['floor_ms']:.2f} ms)"
    )
    print(line)
    assert report["broken"] is None, f"{line}: {report['broken']}"
    assert report["passed"], f"{line}: p50 over the budget"


@pytest.mark.parametrize("name", [n for n, b in BUDGETS.items() if b.kind == "relative"])
def test_cpu_relative_budget(name, record_property):
    budget = BUDGETS[name]
    reasons = [r for r in (budget.skip_reason(p, HOST) for p in budget.phases) if r]
    if reasons:
        _skip(record_property, budget, "all", reasons[0])
    reports = run_relative(budget)
    failed = []
    for phase, report in reports.items():
        record_property("latency", report)
        opt, ref = report["ms"], report["reference_ms"]
        line = (
            f"{name} {phase} ({budget.clock} time): optimized p50 {opt['p50']:.2f} ms (p90 {opt['p90']:.2f}, "
            f"p99 {opt['p99']:.2f}), reference p50 {ref['p50']:.2f} ms: ratio {report['ratio_p50']:.3f}, "
            f"limit {report['max_ratio']}; floor {report['floor_ms']:.3f} ms at "
            f"{report['copy_bandwidth_gb_s']:.1f} GB/s; {report['weights']}"
        )
        print(line)
        if not report["passed"]:
            failed.append(f"{line}: {report['broken'] or 'ratio over the limit'}")
    assert not failed, "\n".join(failed)
