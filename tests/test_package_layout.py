"""The optimized package's layout holds: wings on floors, no import from a higher floor, no import cycle, and
nothing of the repository's test code (`fixtures`, `equivalence`) or of the oracle (`reference`) on a user's path.

Read from the source with `ast` (every import, module level or inside a function), not by importing it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "optimized"

# Lowest first: a module may import its own floor or lower ones, never a higher one.
FLOORS = [
    ("optimized.errors", "optimized.envs", "optimized.config", "optimized.forward_metadata"),
    ("optimized.platform", "optimized.torchair_standin"),
    ("optimized.ops",),
    ("optimized.distributed",),
    ("optimized.layers",),
    ("optimized.phases", "optimized.path_plan"),
    ("optimized.model",),
    ("optimized.model_loader", "optimized.datasets"),
    ("optimized.executor",),
    ("optimized.pd",),
    ("optimized.llm",),
    ("optimized.serving",),
    ("optimized.benchmarks",),
    ("optimized.cli", "optimized.__main__"),
]
# The oracle as the benchmarks' comparator: one module, reached only by bench and the relative budgets.
REFERENCE_ALLOWED = {"optimized.benchmarks.reference_timing"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports (relative imports resolved; `from pkg import sub` names pkg.sub when sub is a
    module of the package)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = {f"{base}.{alias.name}" for alias in node.names}
            modules = {s for s in subs if s.startswith("optimized") and _exists(s)}
            found |= modules
            if modules != subs:  # some names are attributes of `base` itself
                found.add(base)
    return found


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (ROOT.parent / rel.with_suffix(".py")).is_file() or (ROOT.parent / rel / "__init__.py").is_file()


def floor_of(module: str) -> int:
    for i, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is on no floor of tests/test_package_layout.py: place its wing there")


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
GRAPH = {m: {i for i in imports_of(p) if i.startswith("optimized")} for m, p in MODULES.items()}


def test_every_module_sits_on_a_floor():
    for module in MODULES:
        if module != "optimized":
            floor_of(module)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "optimized"))
def test_no_import_from_a_higher_floor(module):
    mine = floor_of(module)
    for target in GRAPH[module]:
        assert target != "optimized", f"{module} imports the package facade `optimized`; import the module itself"
        assert floor_of(target) <= mine, (
            f"{module} (floor {mine}) imports {target} (floor {floor_of(target)}): "
            f"a lower floor must not depend on a higher one"
        )


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH.get(module, ())):
            if target not in GRAPH:
                continue
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in GRAPH:
        if module not in state:
            visit(module, [module])


def test_no_test_code_or_oracle_on_the_users_path():
    for module, path in MODULES.items():
        for target in imports_of(path):
            top = target.split(".")[0]
            assert top not in ("fixtures", "equivalence"), (
                f"{module} imports {target}: test code is reached only through optimized.model_loader.model_path"
            )
            if top == "reference":
                assert module in REFERENCE_ALLOWED, f"{module} imports the oracle {target}"


def test_the_layout_check_can_fail(tmp_path):
    # The checker itself: a planted upward import and a planted fixtures import are both seen.
    planted = ROOT / "layers" / "_planted_for_test.py"
    assert not planted.exists()
    planted.write_text("from optimized.executor import model_runner\nimport fixtures.tiny\n")
    try:
        found = imports_of(planted)
        assert "optimized.executor.model_runner" in found and "fixtures.tiny" in found
        assert floor_of("optimized.executor.model_runner") > floor_of(module_name(planted))
    finally:
        planted.unlink()


# The proof suite by subsystem: proofs sit in these packages with their helpers beside them; the harness's own
# tests and plain unit tests live in tests/ (their marker says what they prove, not where they sit).
PROOF_PACKAGES = {"support", "ops", "model", "parallel", "graph", "quant", "serving", "npu", "latency"}
TOOL_PACKAGES = {"endpoint", "report"}  # user-facing tools: the endpoint checker, the first-divergence report


def test_equivalence_holds_proofs_by_subsystem():
    equivalence = ROOT.parent / "equivalence"
    loose = sorted(p.name for p in equivalence.glob("*.py") if p.name not in ("__init__.py", "conftest.py"))
    assert not loose, f"equivalence/ keeps only subsystem packages; move {loose} into one of {sorted(PROOF_PACKAGES)}"
    packages = {p.name for p in equivalence.iterdir() if (p / "__init__.py").is_file()}
    assert packages == PROOF_PACKAGES | TOOL_PACKAGES, packages ^ (PROOF_PACKAGES | TOOL_PACKAGES)
    for name in ("support", *TOOL_PACKAGES):
        tests = sorted(p.name for p in (equivalence / name).glob("test_*.py"))
        assert not tests, f"equivalence/{name}/ holds helpers or a tool, not proofs: {tests}"


# Quantization as a package: a small base, the config parsed once, one module per scheme (no single-file catch-all).
QUANT_MODULES = {
    "base",
    "config",
    "schemes",
    "errors",
    "unquantized",
    "mxfp8",
    "w8a8",
    "w4a8",
    "w4a4",
    "mx_layout",
    "mx_wire",
    "kv_cache",
    "lifecycle",
    "converter_config",
}


def test_quantization_is_a_package_with_a_module_per_scheme():
    package = ROOT / "layers" / "quantization"
    assert not (ROOT / "layers" / "quantization.py").exists(), "layers/quantization.py came back beside the package"
    modules = {p.stem for p in package.glob("*.py")} - {"__init__"}
    assert modules == QUANT_MODULES, modules ^ QUANT_MODULES
