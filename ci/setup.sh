# Sourced by ci/test.sh and ci/demo.sh: create or reuse the project's virtual environment.
# Sets PY to its interpreter. Fast when nothing changed (a stamp keyed by the install inputs).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
# The CPU wheel, pinned here (not in pyproject.toml): a bare `torch` may resolve to a multi-GB CUDA build.
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    echo "[setup] creating virtual environment $VENV"
    python3 -m venv "$VENV"
fi
stamp="$VENV/.installed-$(cat "$ROOT/pyproject.toml" "$ROOT/ci/setup.sh" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "[setup] installing $TORCH_SPEC and the project with [test] (one time)"
    "$PY" -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
    "$PY" -m pip install --quiet --disable-pip-version-check -e "$ROOT[test]"
    rm -f "$VENV"/.installed-*
    touch "$stamp"
fi
cd "$ROOT"
