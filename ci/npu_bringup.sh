#!/usr/bin/env bash
# NPU bring-up in one command, on an NPU host with torch_npu installed (docs/devices.md, "The first hour on an NPU
# host"): the operator replay, the model per precision, ge_graph decode, a batch-1 W4A4 decode, the W4A8 NZ grouped
# matmul, the sampler, the 2-rank MC2 replay and the latency budgets, smallest first, stopping at the first failure
# with its evidence. Writes npu_bringup/npu_bringup.txt and .json (paste them into an issue).
#   PYTHON=/path/to/python bash ci/npu_bringup.sh [--out DIR] [--dry-run] [--keep-going]
# On a host without an NPU every step is reported skipped, with the reason (equivalence/npu/bringup.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
exec "$PY" -m equivalence.npu.bringup "$@"
