"""NPU tests skip only on the device's declared capability, decided before the kernel call: no test turns a kernel's
exception into a skip (an `except` whose body skips), and the capability checks skip or pass on the SoC name alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from equivalence.support import npu_capability as cap

ROOT = Path(__file__).resolve().parent.parent


def _skips_in_handlers(path: Path) -> list[str]:
    """`file:line` of every pytest.skip / skipTest / xfail call inside an `except` handler of `path`."""
    found = []
    for handler in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ExceptHandler)):
        for node in ast.walk(handler):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("skip", "skipTest", "xfail", "importorskip")
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_test_turns_an_exception_into_a_skip():
    files = sorted((ROOT / "equivalence").rglob("test_*.py")) + sorted((ROOT / "tests").glob("test_*.py"))
    found = [where for f in files for where in _skips_in_handlers(f)]
    assert not found, f"a skip inside an except handler hides a kernel error as a skip: {found}"


def test_the_handler_scan_sees_a_skip_in_an_except(tmp_path):
    (tmp_path / "x.py").write_text("import pytest\ntry:\n    f()\nexcept RuntimeError as e:\n    pytest.skip(str(e))\n")
    assert [w.rsplit(":", 1)[1] for w in _skips_in_handlers_at(tmp_path / "x.py")] == ["5"]


def _skips_in_handlers_at(path: Path) -> list[str]:
    global ROOT
    saved, ROOT = ROOT, path.parent
    try:
        return _skips_in_handlers(path)
    finally:
        ROOT = saved


@pytest.mark.parametrize("soc, runs", [("Ascend950PR_9599", True), ("Ascend910_9392", False), ("", False)])
def test_mx_capability_is_decided_by_the_soc_name(monkeypatch, soc, runs):
    monkeypatch.setattr(cap, "soc_name", lambda: soc)
    if runs:
        cap.require_950("MX")
        cap.require_dynamic_quant(torch.float8_e4m3fn, "pertoken")
    else:
        with pytest.raises(
            pytest.skip.Exception, match=f"runs on Ascend 950; this device declares SoC {soc or 'none'}"
        ):
            cap.require_950("MX")
        cap.require_dynamic_quant(torch.int8, "pertoken")  # every SoC declares it: no skip
        with pytest.raises(pytest.skip.Exception):
            cap.require_dynamic_quant(torch.float8_e4m3fn, "pertoken")


def test_without_an_npu_only_npu_marked_tests_skip():
    """The no-NPU skip follows the `npu` marker, not a name: equivalence/npu/ also holds CPU tests (the recorded-calls
    contract), which must run on a host without an NPU while the replay beside them skips."""
    import subprocess
    import sys

    from optimized.platform import backend_name

    if backend_name() == "npu":
        pytest.skip("this host has an NPU: nothing is skipped for the lack of one")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            "-q",
            "-rs",
            "equivalence/npu",
            "-k",
            "signature_names or the_recording_is_what",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert "1 passed, 1 skipped" in proc.stdout, proc.stdout[-2000:]
