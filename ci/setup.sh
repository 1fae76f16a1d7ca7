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
# The Mooncake Transfer Engine (the pd extra, in [test]) loads libibverbs even for its TCP protocol.
if [ "$(uname -s)" = Linux ] && ! "$PY" -c "import ctypes; ctypes.CDLL('libibverbs.so.1')" 2>/dev/null; then
    echo "[setup] installing the system package libibverbs1 (the KV transfer engine's dependency)"
    if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
        echo "[setup] error: libibverbs1 is missing and cannot be installed here (needs apt-get as root);" \
            "install the system package libibverbs1 (rdma-core), then rerun" >&2
        exit 1
    fi
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; }; then
        echo "[setup] error: apt-get could not install libibverbs1; install it by hand, then rerun" >&2
        exit 1
    fi
fi
if [ ! -f "$stamp" ]; then
    echo "[setup] installing $TORCH_SPEC and the project with [test] (one time)"
    "$PY" -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
    "$PY" -m pip install --quiet --disable-pip-version-check -e "$ROOT[test]"
    rm -f "$VENV"/.installed-*
    touch "$stamp"
fi
cd "$ROOT"
