#!/usr/bin/env bash
# The optimized model on an accelerator (CUDA here; platform.py picks nccl and CUDA graphs), from a source
# checkout, installing nothing. Needs a Python with a CUDA torch, transformers, pytest and hypothesis:
#   PYTHON=/path/to/python bash ci/device_check.sh
# 1. the single-process equivalence model tests with the optimized model on the device and the reference on
#    the CPU (fp32 exact path, bf16 within equivalence/support/compare.py's tolerances); DEVICE overrides the device;
# 2. the fake-device proof and graph mode: the decode step captured with CUDA graphs (exe_mode acl_graph);
# 3. `python -m optimized bench` decode on the device beside its HBM floor.
# pytest-xdist is needed too (pyproject.toml's addopts); -n 0 runs in this process. Without a GPU it runs the same steps on the CPU (DEVICE=cpu): the path it shares. Under 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
DEVICE="${DEVICE:-$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}"
echo "device_check: optimized model on $DEVICE ($("$PY" -c 'import torch; print(torch.__version__)'))"

# 1. world-1 model tests (the pool's one rank builds the optimized model on $DEVICE).
QWEN3_MOE_TEST_DEVICE="$DEVICE" "$PY" -m pytest -p no:cacheprovider -q -n 0 \
    equivalence/parallel/test_e2e_parallel.py -k "w1"

# 2. device discipline (any host) and graph mode; on CUDA, acl_graph is inductor + CUDA graphs.
"$PY" -m pytest -p no:cacheprovider -q -n 0 equivalence/model/test_device_discipline.py
"$PY" -m optimized bench --preset qwen3_30b_a3b --layers 1 --prompt-len 64 --decode-steps 4 --repeats 2 \
    --skip-hf --exe-mode acl_graph

# 3. eager decode on the device beside its floor (the report's "floor" lines).
# Two layers on a GPU; one on the CPU path, which would not finish two in the time budget on a small host.
LAYERS=2; [ "$DEVICE" = cpu ] && LAYERS=1
"$PY" -m optimized bench --preset qwen3_30b_a3b --layers "$LAYERS" --prompt-len 128 --decode-steps 8 --skip-hf
