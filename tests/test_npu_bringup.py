"""`bash ci/npu_bringup.sh` (equivalence/npu/bringup.py): on a host without an NPU every step is reported skipped for
its declared reason; on an NPU host the steps run smallest first and the first failure stops the rest, its output
tail kept as evidence; each step's selection names tests that exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from equivalence.npu import bringup
from equivalence.npu.bringup import STEPS, Host

ROOT = Path(__file__).resolve().parents[1]


def _host(backend="npu", soc="Ascend910_9391", npus=1) -> Host:
    return Host(backend, soc, npus, "2.x", "2.x" if backend == "npu" else "", "3.x", "x86_64", "abc")


def test_the_script_without_an_npu_reports_every_step_skipped_and_writes_both_reports(tmp_path):
    out = tmp_path / "report"
    env = {**os.environ, "PYTHON": sys.executable, "QWEN3_MOE_FORCE_PORTABLE": "1"}
    proc = subprocess.run(
        ["bash", "ci/npu_bringup.sh", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "npu_bringup.json").read_text())
    assert [s["name"] for s in report["steps"]] == [s.name for s in STEPS]
    assert {s["status"] for s in report["steps"]} == {"skipped"}
    assert all(s["reason"].startswith("no NPU: this host computes on cpu") for s in report["steps"])
    assert report["verdict"].startswith("INCOMPLETE: 0 of 8 steps ran")
    text = (out / "npu_bringup.txt").read_text()
    assert text in proc.stdout and "1. operator-replay: skipped - no NPU" in text


def test_dry_run_runs_nothing_even_on_an_npu():
    def runner(step, python):
        raise AssertionError(f"{step.name} ran in a dry run")

    results = bringup.bring_up(_host(), dry_run=True, runner=runner)
    assert {(r.status, r.reason) for r in results} == {("skipped", "dry run: nothing executed")}


def test_the_first_failure_stops_the_rest_with_its_evidence():
    ran = []

    def runner(step, python):
        ran.append(step.name)
        if step.name == "ge-graph-decode":
            return 1, "\n".join(f"line {i}" for i in range(200)) + "\nFAILED test_graph.py::x", 3.0
        return 0, "ok", 1.0

    results = bringup.bring_up(_host(soc="Ascend950DT", npus=2), runner=runner)
    assert ran == ["operator-replay", "layer-per-precision", "ge-graph-decode"]
    status = {r.name: r.status for r in results}
    assert status == {
        "operator-replay": "passed",
        "layer-per-precision": "passed",
        "ge-graph-decode": "failed",
        **{s.name: "not run" for s in STEPS[3:]},
    }
    failed = results[2]
    assert failed.evidence[-1] == "FAILED test_graph.py::x" and len(failed.evidence) == bringup.EVIDENCE_LINES
    assert bringup.verdict(results) == "FAILED: ge-graph-decode"
    assert "   | FAILED test_graph.py::x" in bringup.text_report(_host(), results)
    assert results[4].reason == "stopped after ge-graph-decode failed"


def test_an_a3_with_one_npu_skips_the_950_and_two_rank_steps_for_their_reasons():
    results = bringup.bring_up(_host(), runner=lambda step, python: (0, "", 0.5))
    reasons = {r.name: r.reason for r in results if r.status == "skipped"}
    assert reasons == {
        "w4a4-batch1-decode": "needs an Ascend 950 (MX kernels); this NPU is Ascend910_9391",
        "w4a8-nz-grouped-matmul": "needs an Ascend 950 (MX kernels); this NPU is Ascend910_9391",
        "mc2-replay-2-ranks": "needs 2 NPUs; 1 visible",
    }
    assert bringup.verdict(results).startswith("INCOMPLETE: 5 of 8")


COLLECT = """
import importlib.util, pytest
from equivalence.npu.bringup import STEPS
class Count:
    def pytest_collection_finish(self, session):
        print("COLLECTED", len(session.items), flush=True)
for step in STEPS:
    for run in step.runs:
        print("STEP", step.name, flush=True)
        if run[:2] == ("-m", "pytest"):
            pytest.main([a for a in run[2:] if a != "-x"] + ["--collect-only"], plugins=[Count()])
        else:  # python -m MODULE ...: the module exists
            print("COLLECTED", int(importlib.util.find_spec(run[1]) is not None), flush=True)
"""


def test_each_steps_selection_names_existing_tests():
    """Every pytest run of a step collects at least one test (on this host they would then skip: no NPU), and every
    other run names a module that exists."""
    proc = subprocess.run(
        [sys.executable, "-c", COLLECT],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    counts, step = [], None
    for line in proc.stdout.splitlines():
        if line.startswith("STEP "):
            step = line.split()[1]
        elif line.startswith("COLLECTED"):
            counts.append((step, int(line.split()[-1])))
    assert [name for name, _ in counts] == [s.name for s in STEPS for _ in s.runs], proc.stdout[-3000:] + proc.stderr
    assert all(n for _, n in counts), counts
