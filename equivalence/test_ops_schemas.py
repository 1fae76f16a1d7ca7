"""The schema table is the spec's schema lines, character for character, and every schema is registered."""
from pathlib import Path

import torch

import optimized  # noqa: F401
from optimized.ops.registry import is_defined
from optimized.ops.schemas import SCHEMAS

SPEC_LINES = Path(__file__).parent / "spec" / "npu_op_schemas.txt"


def test_schema_table_equals_spec_lines():
    lines = [line.rstrip("\n") for line in SPEC_LINES.read_text().splitlines() if line.strip()]
    assert sorted(SCHEMAS.values()) == sorted(lines)
    for qualname, schema in SCHEMAS.items():
        assert schema.startswith(qualname + "("), qualname


def test_every_schema_is_defined_in_the_npu_namespace():
    missing = [name for name in SCHEMAS if not is_defined(name)]
    assert not missing, f"not registered: {missing}"


def test_registered_schema_text_matches_torch_npu():
    for qualname, schema in SCHEMAS.items():
        name, _, overload = qualname.partition(".")
        registered = getattr(getattr(torch.ops.npu, name), overload or "default")._schema
        assert str(registered) == str(torch._C.parse_schema("npu::" + schema)), qualname


def test_registration_is_idempotent():
    import importlib

    import optimized.ops.norm as norm

    x, gamma = torch.randn(3, 8), torch.rand(8) + 0.5
    before = torch.ops.npu.npu_rms_norm(x, gamma, 1e-6)[0]
    importlib.reload(norm)            # registers again: must neither raise nor change the operator
    importlib.reload(optimized.ops)
    assert torch.equal(torch.ops.npu.npu_rms_norm(x, gamma, 1e-6)[0], before)
