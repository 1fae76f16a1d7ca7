"""Every entry point builds its process groups and its model through optimized/executor/assembly.py: no other
module of the product (nor the first-divergence report) calls the builders itself. Read from the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILDERS = {"init_distributed", "load_model", "model_from_source"}  # and ParallelState.build
# Where the builders are defined, and the assembly that calls them.
OWNERS = {
    "optimized/executor/assembly.py",
    "optimized/model_loader/build.py",  # load_model is model_from_source over a checkpoint
    "optimized/distributed/parallel_state.py",
}
SCOPE = ("optimized", "equivalence/report")


def builder_calls(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name in BUILDERS:
            found.append(f"{name} (line {node.lineno})")
        elif name == "build" and isinstance(f, ast.Attribute) and getattr(f.value, "id", None) == "ParallelState":
            found.append(f"ParallelState.build (line {node.lineno})")
    return found


def test_no_entry_point_builds_groups_or_models_by_hand():
    offenders = {}
    for scope in SCOPE:
        for path in sorted((REPO / scope).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel not in OWNERS and (calls := builder_calls(path.read_text())):
                offenders[rel] = calls
    assert not offenders, f"build through optimized/executor/assembly.py (build_model, join_job): {offenders}"


def test_the_check_sees_each_builder():
    planted = (
        "env = init_distributed()\nstate = ParallelState.build(p, mc2_window_mb=8)\n"
        "m = build.model_from_source(c, s, parallel=state)\nm2 = load_model(d)\nok = build_model(w, p)\n"
    )
    assert [c.split()[0] for c in builder_calls(planted)] == [
        "init_distributed",
        "ParallelState.build",
        "model_from_source",
        "load_model",
    ]
