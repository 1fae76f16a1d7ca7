"""No module imports from a test module: shared test helpers live in equivalence/support/ (a test module's helpers
imported elsewhere make one proof's file the dependency of others, and pytest may collect its tests twice)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("equivalence", "tests", "optimized", "reference", "fixtures", "ci", "scripts")


def imported_test_modules(source: str) -> list[str]:
    """The test modules (`test_*`, as a module or a name taken from a package) that `source` imports, anywhere."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.rpartition(".")[2].startswith("test_")]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.rpartition(".")[2].startswith("test_"):
                found.append(module)
            found += [
                f"{module}.{a.name}" for a in node.names if a.name.startswith("test_") and _is_module(module, a.name)
            ]
    return found


def _is_module(package: str, name: str) -> bool:
    """`from package import name` takes a module (not a function such as a helper named test_device)."""
    return (REPO / Path(*package.split(".")) / f"{name}.py").is_file()


def python_files():
    for package in PACKAGES:
        yield from sorted((REPO / package).rglob("*.py"))
    yield from sorted(REPO.glob("*.py"))


def test_no_module_imports_from_a_test_module():
    offenders = {
        str(path.relative_to(REPO)): names
        for path in python_files()
        if (names := imported_test_modules(path.read_text()))
    }
    assert not offenders, f"move the shared helpers into equivalence/support/: {offenders}"


def test_the_check_sees_every_form():
    planted = (
        "from equivalence.parallel.test_e2e_parallel import replayed_routing\n"
        "import equivalence.serving.test_e2e_serving as s\n"
        "def f():\n    from equivalence.quant import test_e2e_w4a8\n"
        "from equivalence.support.logits_runs import replayed_routing\n"
    )
    assert imported_test_modules(planted) == [
        "equivalence.parallel.test_e2e_parallel",
        "equivalence.serving.test_e2e_serving",
        "equivalence.quant.test_e2e_w4a8",
    ]
