"""Equivalence of any OpenAI-compatible endpoint with the reference: per position, tie-aware, calibrated.

    python -m equivalence.endpoint --url http://HOST:PORT/v1 --model-path CKPT [--served-model NAME]
        [--prompts FILE | --prompt-ids IDS ...] [--max-tokens N] [--concurrency N] [--precision fp32|bf16] --out DIR

Exit 0: agrees; 1: diverged (the first failing position is named); 2: bad input (one line: unreachable URL, a
model the server does not serve, a tokenizer mismatch, ...). check.py holds the comparison, client.py the HTTP side,
html.py the page; pytest runs the same check with `--endpoint URL --endpoint-model-path CKPT`.
"""
from equivalence.endpoint.check import PRECISIONS, Result, run_check  # noqa: F401
from equivalence.endpoint.client import EndpointError  # noqa: F401
