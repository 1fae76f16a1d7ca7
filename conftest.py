"""Repository-wide pytest setup: hypothesis profiles, backend detection, marker skips."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from optimized.platform import backend_name

# Profiles: `ci` is derandomized and bounded so CI is repeatable and fast; `dev` explores a little more
# with fresh randomness; `thorough` is for deep runs (HYPOTHESIS_PROFILE=thorough bash ci/test.sh).
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=20,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", max_examples=50, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# preset:NAME config.json files go to the repository's cache (beside the fixture checkpoints), not the user's home.
os.environ.setdefault("QWEN3_MOE_PRESET_CACHE", str(Path(__file__).resolve().parent / ".cache" / "presets"))

# Tiny models: one thread per test process avoids oversubscribing the cores under xdist.
torch.set_num_threads(int(os.environ.get("TORCH_NUM_THREADS", "1")))

BACKEND = backend_name()

pytest_plugins = ["equivalence.latency.latency_report", "equivalence.report.plugin"]


def pytest_addoption(parser):
    parser.addoption(
        "--latency-report",
        metavar="PATH",
        help="write every latency budget's result (measured or skipped, with reasons) as JSON here",
    )
    parser.addoption(
        "--latency-checkpoint",
        metavar="DIR",
        help="checkpoint for the NPU latency budgets (else $QWEN3_MOE_LATENCY_CHECKPOINT, else "
        "random weights of the budget's shapes)",
    )


def latency_selected(config) -> bool:
    """Whether this run asked for the latency budgets (`-m latency`, alone or in an expression)."""
    return "latency" in (config.getoption("markexpr", "") or "")


def pytest_collection_modifyitems(config, items):
    # The default run asserts no timing: `latency` tests are collected only when `-m` names the marker.
    # Selected, they decide for themselves: the CPU relative budgets run anywhere with a CPU backend, each
    # NPU budget skips naming the hardware it needs (equivalence/latency/test_latency.py).
    if not latency_selected(config):
        timed = [item for item in items if item.get_closest_marker("latency")]
        if timed:
            config.hook.pytest_deselected(items=timed)
            items[:] = [item for item in items if not item.get_closest_marker("latency")]
    skip_npu = pytest.mark.skip(reason=f"needs an Ascend NPU with torch_npu; this host's backend is {BACKEND}")
    for item in items:
        if BACKEND != "npu":
            if item.get_closest_marker("npu"):
                item.add_marker(skip_npu)


@pytest.fixture(scope="session")
def backend() -> str:
    return BACKEND
