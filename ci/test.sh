#!/usr/bin/env bash
# Set up (once) and run the whole test suite. Extra arguments go to pytest, e.g.
#   bash ci/test.sh -m equivalence
# Exits non-zero on any failure, and when no test ran (pytest exit code 5).
set -euo pipefail
source "$(dirname "$0")/setup.sh"
# Lint and format first (pyproject.toml [tool.ruff]): a second, no test runs on code that fails them.
"$PY" -m ruff check --quiet .
"$PY" -m ruff format --check --quiet .
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
# Two xdist workers for the two cores; each keeps torch to one thread so they do not fight.
exec "$PY" -m pytest -n "${PYTEST_WORKERS:-2}" -p no:cacheprovider "$@"
