#!/usr/bin/env bash
# W4A8 demo: convert the tiny fixture to W4A8 (MXFP4 experts, MXFP8 attention) with
# `python -m optimized convert --quant w4a8`, then generate greedily with the fake-quantized plain reference
# and with the optimized model over 2 ranks (torchrun, gloo) from the converted checkpoint, in bfloat16. The
# converter writes the recipe's kv_cache_scheme, so both run the per-token FP8 KV cache (`kv cache:` line).
# Prints both and their token agreement; exits non-zero if a step fails or the first generated token differs.
# (Later tokens may differ: bf16 rounding differences are re-rounded onto the FP8 grid at every layer, see
# equivalence/support/compare.py "model.w4a8.bfloat16".) Usage: bash ci/demo_w4a8.sh
set -euo pipefail
source "$(dirname "$0")/setup.sh"   # sets $PY, cds to the repository root
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
CONFIG=fixtures/configs/tiny_w4a8_ep2.yaml
PROMPT="The capital of France is"
NEW=16

echo "== building the tiny fixture checkpoint (cached)"
MODEL="$("$PY" -c 'from fixtures.checkpoints import checkpoint; print(checkpoint("tiny"))')"
DST="$PWD/.cache/demo/tiny-w4a8"
rm -rf "$DST"

echo
echo "== converting: $PY -m optimized convert --quant w4a8 <tiny> $DST"
"$PY" -m optimized convert --quant w4a8 "$MODEL" "$DST"

echo
echo "== reference, fake-quantized: $PY -m reference generate --model <tiny> --fake-quant w4a8 --kv-cache fp8 --dtype bfloat16"
REF_OUT="$("$PY" -m reference generate --model "$MODEL" --fake-quant w4a8 --kv-cache fp8 --dtype bfloat16 \
    --prompt "$PROMPT" --max-new-tokens "$NEW")"
echo "$REF_OUT"

echo
echo "== optimized W4A8: torchrun --nproc-per-node 2 -m optimized generate --config $CONFIG --model-path $DST"
OPT_OUT="$("$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
    -m optimized generate --config "$CONFIG" --model-path "$DST" --prompt "$PROMPT" --max-new-tokens "$NEW")"
echo "$OPT_OUT"
grep -q '^kv cache: float8_e4m3fn' <<<"$OPT_OUT" || { echo "MISMATCH: the optimized run does not report the FP8 KV cache"; exit 1; }

ref_ids="$(grep '^generated ids:' <<<"$REF_OUT" | cut -d' ' -f3)"
opt_ids="$(grep '^generated ids:' <<<"$OPT_OUT" | cut -d' ' -f3)"
"$PY" - "$ref_ids" "$opt_ids" <<'PYEOF'
import sys
ref, opt = (list(map(int, s.split(","))) for s in sys.argv[1:3])
same = sum(a == b for a, b in zip(ref, opt))
print(f"\nreference (fake-quant) {ref}\noptimized (W4A8, 2 ranks) {opt}\n"
      f"token agreement {same}/{len(ref)}")
if ref[0] != opt[0]:
    sys.exit("MISMATCH: the first generated token differs")
PYEOF
