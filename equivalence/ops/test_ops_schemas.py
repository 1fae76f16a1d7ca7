"""The operator schemas are torch_npu's, character for character, and every schema is registered.

The contract is the torch_npu schema strings kept in the repository (equivalence/spec/npu_op_schemas.txt,
one schema a line, read independently of optimized/ops/schemas.py). Everywhere: the table `SCHEMAS` equals
those lines, and the operator registered under each name carries the kept line's schema (on a CPU that is
the portable registration). Under the `npu` marker: the live torch_npu registration carries it too.
"""

from pathlib import Path

import pytest
import torch

import optimized  # noqa: F401
from optimized.ops.registry import is_defined
from optimized.ops.schemas import SCHEMAS

SPEC_LINES = Path(__file__).resolve().parents[1] / "spec" / "npu_op_schemas.txt"


def kept_schemas() -> dict[str, str]:
    """{qualified name (overload included): schema line} of the kept torch_npu strings."""
    lines = [line.rstrip("\n") for line in SPEC_LINES.read_text().splitlines() if line.strip()]
    kept = {line.partition("(")[0]: line for line in lines}
    assert len(kept) == len(lines), f"{SPEC_LINES}: a qualified name appears twice"
    return kept


def registered_schema(qualname: str) -> str:
    name, _, overload = qualname.partition(".")
    return str(getattr(getattr(torch.ops.npu, name), overload or "default")._schema)


def _assert_registered_equals_kept():
    wrong = {}
    for qualname, line in kept_schemas().items():
        want = str(torch._C.parse_schema("npu::" + line))
        got = registered_schema(qualname)
        if got != want:
            wrong[qualname] = f"registered {got!r}\n  kept      {want!r}"
    assert not wrong, f"schemas differing from {SPEC_LINES.name}:\n" + "\n".join(f"{k}: {v}" for k, v in wrong.items())


def test_schema_table_equals_kept_torch_npu_lines():
    kept = kept_schemas()
    assert sorted(SCHEMAS) == sorted(kept), (
        f"names: only in SCHEMAS {sorted(set(SCHEMAS) - set(kept))}, only kept {sorted(set(kept) - set(SCHEMAS))}"
    )
    differ = [q for q in SCHEMAS if SCHEMAS[q] != kept[q]]
    assert not differ, f"SCHEMAS text differs from {SPEC_LINES.name} for {differ}"


def test_every_schema_is_defined_in_the_npu_namespace():
    missing = [name for name in kept_schemas() if not is_defined(name)]
    assert not missing, f"not registered: {missing}"


def test_registered_schemas_equal_kept_torch_npu_strings():
    _assert_registered_equals_kept()


@pytest.mark.npu
def test_live_torch_npu_schemas_equal_kept_strings():
    import torch_npu  # noqa: F401  (owns torch.ops.npu.*: the portable registration stands aside)

    _assert_registered_equals_kept()


def test_registration_is_idempotent():
    import importlib

    import optimized.ops.norm as norm

    x, gamma = torch.randn(3, 8), torch.rand(8) + 0.5
    before = torch.ops.npu.npu_rms_norm(x, gamma, 1e-6)[0]
    importlib.reload(norm)  # registers again: must neither raise nor change the operator
    importlib.reload(optimized.ops)
    assert torch.equal(torch.ops.npu.npu_rms_norm(x, gamma, 1e-6)[0], before)
