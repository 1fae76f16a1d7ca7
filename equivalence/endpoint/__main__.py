"""`python -m equivalence.endpoint`: see equivalence/endpoint/__init__.py."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from equivalence.endpoint.check import PRECISIONS, run_check
from equivalence.endpoint.client import EndpointError
from equivalence.endpoint.html import render_html
from optimized.cli.common import parse_prompt_ids


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m equivalence.endpoint",
        description="compare an OpenAI-compatible endpoint with the reference per position "
        "(exit 0 agree, 1 diverged, 2 bad input)",
    )
    ap.add_argument("--url", required=True, help="the server's OpenAI base, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument(
        "--model-path",
        required=True,
        help="the checkpoint directory the endpoint serves; at w8a8 / w4a8 / fp8kv the BF16 checkpoint the "
        "served one was converted from (the reference fake-quantizes it)",
    )
    ap.add_argument("--served-model", help="the model name the server serves (default: its only one)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompts", metavar="FILE", help="text prompts, one per line")
    src.add_argument("--prompt-ids", action="append", type=parse_prompt_ids, metavar="IDS", help="token ids; repeat")
    ap.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per prompt (default 8)")
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent requests for batch invariance")
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=list(PRECISIONS),
        help="the endpoint's precision, which picks the reference and the tolerance table entry "
        "(default fp32): fp32, bf16 (the plain reference); w8a8, w4a8 (the fake-quant reference of "
        "that scheme, judged on all positions together: the per-position bound is about 1 nat "
        "there); fp8kv (W4A8 with the per-token FP8 KV cache, the recipe's default conversion)",
    )
    ap.add_argument("--top-k", type=int, default=5, help="logprobs top-k asked for (default 5)")
    ap.add_argument("--out", default="endpoint_report", help="output directory (report.json, report.html)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        prompts = args.prompt_ids
        if args.prompts:
            path = Path(args.prompts)
            if not path.is_file():
                raise EndpointError(f"--prompts {args.prompts!r} is not a file")
            lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
            if not lines:
                raise EndpointError(f"--prompts {args.prompts!r} holds no prompt")
            from reference.tokenizer import load_tokenizer

            tok = load_tokenizer(args.model_path) if Path(args.model_path).is_dir() else None
            if tok is None:
                raise EndpointError(f"--model-path {args.model_path} has no tokenizer to encode --prompts")
            prompts = [tok.encode(ln) for ln in lines]
        if not Path(args.model_path).is_dir():
            raise EndpointError(f"--model-path {args.model_path!r} is not a checkpoint directory")
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise EndpointError(f"--out {args.out!r} exists and is not a directory")
        result = run_check(
            args.url,
            args.model_path,
            served_model=args.served_model,
            prompts=prompts,
            max_tokens=args.max_tokens,
            concurrency=args.concurrency,
            precision=args.precision,
            top_k=args.top_k,
        )
    except EndpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    data = result.to_json()
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "report.html").write_text(render_html(data))
    print(result.summary())
    print(f"wrote {out / 'report.json'} and {out / 'report.html'}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
