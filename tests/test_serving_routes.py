"""The server's shape: route modules over one application state, each handler callable alone, and no function in
optimized/serving longer than MAX_FUNCTION_LINES (a handler that grows past it is split, not extended)."""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from optimized.serving.protocol import ApiError  # noqa: E402
from optimized.serving.routes import health, models  # noqa: E402
from optimized.serving.state import ServerState  # noqa: E402

SERVING = Path(__file__).resolve().parents[1] / "optimized" / "serving"
MAX_FUNCTION_LINES = 60


def function_lengths():
    for path in sorted(SERVING.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield (
                    f"{path.relative_to(SERVING.parents[1])}:{node.lineno} {node.name}",
                    node.end_lineno - node.lineno + 1,
                )


def test_no_function_in_serving_is_longer_than_the_bound():
    long = {name: n for name, n in function_lengths() if n > MAX_FUNCTION_LINES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"


def test_the_bound_sees_nested_functions():
    lengths = dict(function_lengths())
    assert any(name.endswith(" build_app") for name in lengths)
    assert any(name.endswith(" chunks") for name in lengths)  # the streams' inner generators are measured too


def request_for(state):
    """What a handler reads of its request: the application's state."""
    return SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(server=state)))


def state_over(driver):
    return ServerState(driver, None, "tiny")


def test_health_and_metrics_handlers_alone():
    driver = SimpleNamespace(error=None, metrics=SimpleNamespace(render=lambda: "x 1\n"))
    http = request_for(state_over(driver))
    assert asyncio.run(health.health(http)) == {"status": "ok"}
    assert asyncio.run(health.metrics(http)).body == b"x 1\n"
    driver.error = RuntimeError("gone")
    r = asyncio.run(health.health(http))
    assert r.status_code == 503 and json.loads(r.body) == {"status": "error", "error": "RuntimeError: gone"}


def test_models_handlers_alone():
    state = state_over(SimpleNamespace())
    http = request_for(state)
    listed = asyncio.run(models.models(http))
    assert [m["id"] for m in listed["data"]] == ["tiny"]
    assert asyncio.run(models.model("tiny", http)) == listed["data"][0]
    with pytest.raises(ApiError) as e:
        asyncio.run(models.model("other", http))
    assert e.value.status == 404 and e.value.param == "model"
