"""Repository-wide pytest setup: hypothesis profiles, backend detection, marker skips."""
from __future__ import annotations

import os

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
settings.register_profile("dev", max_examples=50, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=1000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# Tiny models: one thread per test process avoids oversubscribing the cores under xdist.
torch.set_num_threads(int(os.environ.get("TORCH_NUM_THREADS", "1")))

BACKEND = backend_name()


def pytest_collection_modifyitems(config, items):
    skip_npu = pytest.mark.skip(reason=f"needs an Ascend NPU with torch_npu; this host's backend is {BACKEND}")
    skip_latency = pytest.mark.skip(
        reason=f"latency budgets are enforced on real NPU hardware only; this host's backend is {BACKEND}")
    for item in items:
        if BACKEND != "npu":
            if "npu" in item.keywords:
                item.add_marker(skip_npu)
            if "latency" in item.keywords:
                item.add_marker(skip_latency)


@pytest.fixture(scope="session")
def backend() -> str:
    return BACKEND
