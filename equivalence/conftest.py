"""Equivalence-suite setup: the `equivalence` marker, and the NPU route caps enforced on every model-level test.

Model-level tests (every module here but the per-operator `test_ops_*`, which choose their own strictness) run
the portable kernels with QWEN3_MOE_STRICT_NPU_LIMITS=route: a model call that a real kernel rejects by its
dtypes, modes or layouts fails the test, at any fixture size and in the fp32 proofs too (the dims and fp32 caps
stay off: the tiny fixtures' head dims and the fp32 exact path are deliberate). Every task of the multi-rank
worker pool runs under its calling test's setting (`equivalence.support.dist` sends it with the task).
"""

import pytest

from optimized.ops.validation import STRICT_ENV

MODEL_LEVEL_STRICTNESS = "route"


def is_model_level(item) -> bool:
    return not item.module.__name__.rpartition(".")[2].startswith("test_ops_")


def pytest_addoption(parser):
    group = parser.getgroup("endpoint", "equivalence of an OpenAI-compatible endpoint (equivalence/endpoint/)")
    group.addoption(
        "--endpoint",
        metavar="URL",
        help="check this server's /v1 against the reference "
        "(equivalence/serving/test_endpoint.py::test_a_given_endpoint_agrees)",
    )
    group.addoption("--endpoint-model-path", metavar="CKPT", help="the checkpoint directory the endpoint serves")
    group.addoption(
        "--endpoint-precision", default="fp32", help="the endpoint's precision (fp32, bf16, w8a8, w4a8, fp8kv)"
    )


def pytest_collection_modifyitems(config, items):
    # Everything under equivalence/ is part of `pytest -m equivalence`.
    for item in items:
        if "/equivalence/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.equivalence)


@pytest.fixture(autouse=True)
def npu_route_caps(request, monkeypatch):
    if is_model_level(request.node):
        monkeypatch.setenv(STRICT_ENV, MODEL_LEVEL_STRICTNESS)
