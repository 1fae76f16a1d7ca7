"""python -m reference generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens 16]
[--dtype float32|bfloat16] [--no-cache] [--fake-quant w4a8]

--fake-quant w4a8 runs the BF16 checkpoint quantize-dequantized where a W4A8 checkpoint is quantized
(reference/fake_quant.py): the oracle of `python -m optimized generate` on the converted checkpoint.

Text is byte-level (the tiny fixtures' tokenizer): a prompt is its UTF-8 bytes; in the decoded output ids
below 256 are bytes and other ids are shown as `<id>`.
"""
from __future__ import annotations

import argparse
import sys

from .tokenizer import decode, encode, parse_prompt_ids


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m reference", description="Plain eager Qwen3-MoE reference")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy generation from a Hugging Face Qwen3-MoE checkpoint")
    gen.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, tokenized byte-level (UTF-8 bytes)")
    prompt.add_argument("--prompt-ids", type=parse_prompt_ids, help="comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--max-new-tokens", type=int, default=16)
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gen.add_argument("--no-cache", action="store_true", help="recompute the full sequence at every step")
    gen.add_argument("--fake-quant", choices=["w4a8"], help="MX quantize-dequantize weights and activations")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0:
        parser.error(f"--max-new-tokens must be >= 0; got {args.max_new_tokens}")
    ids = args.prompt_ids if args.prompt is None else encode(args.prompt)
    if not ids:
        parser.error("the prompt is empty")

    import torch  # after argument parsing, so usage errors are instant

    from reference.checkpoint import load_model
    from reference.generate import greedy_generate

    try:
        if args.fake_quant:
            from reference.fake_quant import load_fake_quant_model
            model = load_fake_quant_model(args.model, getattr(torch, args.dtype))
        else:
            model = load_model(args.model, dtype=getattr(torch, args.dtype))
        new = greedy_generate(model, torch.tensor([ids]), args.max_new_tokens, use_cache=not args.no_cache)
    except (ValueError, OSError) as e:  # bad checkpoint directory, token id outside vocab, too long
        parser.error(str(e))
    new = new[0].tolist()
    print("prompt ids:", ",".join(map(str, ids)))
    print("generated ids:", ",".join(map(str, new)))
    print("text:", repr(decode(ids + new)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
