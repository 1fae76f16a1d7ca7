"""`pytest -m latency`: the budgets of optimized/benchmarks/budgets.yaml, measured.

- NPU budgets (kind absolute): on matching hardware, `torchrun ... -m optimized latency` measures the budget
  (one process per rank, device sync, warm-up, repeats; once per budget and session, shared by its phases
  and by xdist workers through a lock file); p50 must not exceed the limit; the physical floor
  (optimized.benchmarks.floor) is reported beside it, with the table's and the measured collective latency. Elsewhere,
  or while a feature the phase needs is missing, the test skips naming it.
- CPU budgets (kind relative): optimized vs reference in this process, interleaved rounds; the optimized
  p50 may be at most max_ratio times the reference p50.
Every result, skipped ones with their reasons, goes to the JSON report of `--latency-report PATH`.
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
LAUNCH_TIMEOUT_S = 3600   # a 235B checkpoint load on 16 ranks plus the timed rounds


def _absolute_cases():
    return [pytest.param(name, phase, id=f"{name}-{phase}") for name, b in BUDGETS.items()
            if b.kind == "absolute" for phase in b.phases]


def _skip(record_property, budget, phase, reason):
    record_property("latency", {"budget": budget.name, "phase": phase, "kind": budget.kind,
                                "description": budget.description, "skipped": reason})
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
                pytest.fail(f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stdout[-4000:]}\n"
                            f"{done.stderr[-4000:]}")
    return json.loads(raw.read_text())


@pytest.mark.parametrize("name, phase", _absolute_cases())
def test_npu_budget(name, phase, record_property, shared_dir, request):
    budget = BUDGETS[name]
    reason = budget.skip_reason(phase, HOST)
    if reason:
        _skip(record_property, budget, phase, reason)
    checkpoint = request.config.getoption("latency_checkpoint") or os.environ.get(CHECKPOINT_ENV)
    if budget.precision == "w4a8" and not checkpoint:
        _skip(record_property, budget, phase, f"needs a W4A8 checkpoint (--latency-checkpoint DIR or ${CHECKPOINT_ENV}"
                                              f", from `python -m optimized convert --quant w4a8`)")
    raw = _measure_absolute(budget, shared_dir, checkpoint)
    floor = budget_floor(budget, phase)
    report = phase_report(budget, phase, raw["samples_s"][phase], floor["floor_s"])
    report.update(host_soc=raw["soc"], model=raw["model"], floor={k: v for k, v in floor.items() if k.endswith("_s")})
    if phase == "decode" and raw.get("collective_latency_s"):
        measured = budget_floor(budget, phase, collective_latency=raw["collective_latency_s"])
        report["floor_ms_measured_collective_latency"] = 1000 * measured["floor_s"]
    record_property("latency", report)
    ms = report["ms"]
    assert report["passed"], (f"{name} {phase}: p50 {ms['p50']:.2f} ms > budget {report['limit_ms']} ms "
                              f"(p90 {ms['p90']:.2f}, p99 {ms['p99']:.2f}; floor {report['floor_ms']:.2f} ms)")


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
        line = (f"{name} {phase} ({budget.clock} time): optimized p50 {opt['p50']:.2f} ms (p90 {opt['p90']:.2f}, "
                f"p99 {opt['p99']:.2f}), reference p50 {ref['p50']:.2f} ms: ratio {report['ratio_p50']:.3f}, "
                f"budget <= {report['max_ratio']}"
                + (f"; memory floor {report['floor_ms']:.2f} ms at {report['copy_bandwidth_gb_s']:.1f} GB/s"
                   if "floor_ms" in report else ""))
        print(line)
        if not report["passed"]:
            failed.append(line)
    assert not failed, "\n".join(failed)
