"""The JSON report of `pytest -m latency` (`--latency-report PATH`), written once by the controlling
process (also under xdist): every latency test records its result as the user property "latency" (see
equivalence/latency/test_latency.py), measured or skipped with its reason, and this plugin gathers them."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

_RESULTS: list[dict] = []


def pytest_runtest_logreport(report):
    if report.when != "call":
        return
    for key, value in report.user_properties:
        if key == "latency":
            _RESULTS.append(dict(value, outcome=report.outcome))


def pytest_sessionfinish(session):
    path = session.config.getoption("latency_report", None)
    if not path or hasattr(session.config, "workerinput"):  # xdist workers report to the controller
        return
    from optimized.benchmarks.budgets import this_host

    host = this_host()
    report = {
        "host": {
            "backend": host.backend,
            "soc": host.soc,
            "devices": host.devices,
            "machine": platform.machine(),
            "torch": torch.__version__,
        },
        "results": sorted(_RESULTS, key=lambda r: (r["budget"], r["phase"])),
    }
    Path(path).write_text(json.dumps(report, indent=1) + "\n")
