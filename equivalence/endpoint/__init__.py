"""Equivalence of any OpenAI-compatible endpoint with the reference: per position, tie-aware, calibrated.

    python -m equivalence.endpoint --url http://HOST:PORT/v1 --model-path CKPT [--served-model NAME]
        [--prompts FILE | --prompt-ids IDS ...] [--max-tokens N] [--concurrency N]
        [--precision fp32|bf16|w8a8|w4a8|fp8kv] --out DIR

Exit 0: agrees; 1: diverged (the first failing position is named); 2: bad input (one line: unreachable URL, a
model the server does not serve, a tokenizer mismatch, ...). check.py holds the comparison, client.py the HTTP side,
html.py the page, calibrate.py the noise floor (check.CALIBRATION); pytest runs the same check with
`--endpoint URL --endpoint-model-path CKPT`. The quantized precisions compare with the fake-quant reference of the
BF16 --model-path and are judged on all positions together (the note at check.QUANTIZED says why).
"""

from equivalence.endpoint.check import PRECISIONS, Result, run_check  # noqa: F401
from equivalence.endpoint.client import EndpointError  # noqa: F401
