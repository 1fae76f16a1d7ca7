"""The product installed as a user installs it: `pip install .` into a fresh virtual environment outside the
repository, then `python -m optimized generate` on a checkpoint directory, `convert` and `latency --help` from a
directory that is not the repository (so `fixtures`, `equivalence` and the source tree are not importable).

The fresh environment borrows this environment's third-party packages (torch, transformers, ...) through a
`.pth` line: a path added that way is on sys.path but its own .pth files (this checkout's editable install) are
not processed, so `optimized` comes only from the wheel that was just installed.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from fixtures.checkpoints import checkpoint

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(python: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(python of a fresh venv with the product installed from this checkout, a work directory outside it)."""
    root = tmp_path_factory.mktemp("wheel")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = Path(
        _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=root).stdout.strip()
    )
    borrowed = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if Path(p).is_dir()]
    (purelib / "borrowed-site-packages.pth").write_text("\n".join(dict.fromkeys(borrowed)) + "\n")
    # A copy of the sources only: a local build/ or *.egg-info left by an editable install must not leak in.
    source = root / "source"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(".git", ".venv", ".cache", "build", "*.egg-info", "__pycache__", "compile_cache"),
    )
    build = _run(
        python,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--quiet",
        "--target",
        str(purelib),
        str(source),
        cwd=root,
        timeout=600,
    )
    assert build.returncode == 0, f"pip install . failed:\n{build.stdout}\n{build.stderr}"
    work = root / "work"
    work.mkdir()
    where = _run(python, "-c", "import optimized; print(optimized.__file__)", cwd=work)
    assert where.returncode == 0, where.stderr
    assert str(purelib) in where.stdout and str(REPO) not in where.stdout, where.stdout
    return python, work


def test_installed_product_imports_no_test_code(installed):
    python, work = installed
    probe = (
        "import sys, optimized, optimized.cli.main, optimized.benchmarks.budgets as b; "
        "b.load_budgets(); "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fixtures', 'equivalence')); "
        "print(bad); assert not bad"
    )
    r = _run(python, "-c", probe, cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr


def test_installed_generate_on_a_checkpoint_directory(installed, tmp_path):
    python, work = installed
    config = tmp_path / "run.yaml"
    config.write_text(
        textwrap.dedent(f"""\
        model_config: {{model_path: {checkpoint("tiny")}, dtype: float32}}
        data_config: {{input_max_len: 64}}
        scheduler_config: {{max_new_tokens: 4, block_size: 16}}
        """)
    )
    r = _run(python, "-m", "optimized", "generate", "--config", str(config), "--prompt", "Hello", cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "generated ids:" in r.stdout and "completion:" in r.stdout, r.stdout


def test_installed_convert(installed, tmp_path):
    python, work = installed
    dst = tmp_path / "w4a8"
    r = _run(
        python,
        "-m",
        "optimized",
        "convert",
        "--quant",
        "w4a8",
        str(checkpoint("tiny")),
        str(dst),
        "--no-progress",
        cwd=work,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (dst / "config.json").is_file() and "converted" in r.stdout


def test_installed_latency_help_and_fixture_paths(installed, tmp_path):
    python, work = installed
    r = _run(python, "-m", "optimized", "latency", "--help", cwd=work)
    assert r.returncode == 0 and "--budget" in r.stdout, r.stdout + r.stderr
    config = tmp_path / "fixture.yaml"
    config.write_text("model_config: {model_path: 'fixture:tiny'}\n")
    r = _run(python, "-m", "optimized", "generate", "--config", str(config), "--prompt-ids", "1,2", cwd=work)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "source checkout" in r.stderr and "Traceback" not in r.stderr, r.stderr
