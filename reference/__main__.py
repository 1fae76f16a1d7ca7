"""python -m reference generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) [--chat] [--max-new-tokens 16]
[--dtype float32|bfloat16] [--no-cache] [--ignore-eos] [--fake-quant w4a8|w8a8] [--kv-cache fp8|bf16]

--fake-quant w4a8 (w8a8) runs the BF16 checkpoint quantize-dequantized where a W4A8 (W8A8) checkpoint is
quantized (reference/fake_quant.py): the oracle of `python -m optimized generate` on the converted checkpoint.

Text prompts are encoded by the checkpoint's own tokenizer (`--chat`: through its chat template) and the
output decoded with it; greedy generation stops at an EOS id of generation_config.json (else config.json)
unless --ignore-eos. Errors a user can fix print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .tokenizer import decode, encode, eos_token_ids, load_tokenizer, parse_prompt_ids


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line (no usage block), exit status 2 like argparse
        message = " ".join(str(message).split())
        print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m reference", description="Plain eager Qwen3-MoE reference")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="greedy generation from a Hugging Face Qwen3-MoE checkpoint")
    gen.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors + tokenizer)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, encoded by the checkpoint's tokenizer")
    prompt.add_argument("--prompt-ids", type=parse_prompt_ids, help="comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to --prompt")
    gen.add_argument("--max-new-tokens", type=int, default=16)
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gen.add_argument("--no-cache", action="store_true", help="recompute the full sequence at every step")
    gen.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    gen.add_argument(
        "--fake-quant",
        choices=["w4a8", "w8a8"],
        help="MX quantize-dequantize weights and activations as a W4A8 / W8A8 checkpoint does",
    )
    gen.add_argument(
        "--kv-cache",
        choices=["fp8", "bf16"],
        default="bf16",
        help="fp8: quantize-dequantize the KV cache per token (FP8 E4M3, one scale per token)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0:
        parser.error(f"--max-new-tokens must be >= 0; got {args.max_new_tokens}")
    if args.chat and args.prompt is None:
        parser.error("--chat applies the chat template to --prompt text; it cannot be combined with --prompt-ids")
    if args.prompt is not None and not args.prompt:
        parser.error("the prompt is empty")

    import torch  # after argument parsing, so usage errors are instant

    from reference.checkpoint import load_config, load_model
    from reference.generate import greedy_generate, trim_at_eos

    reading = "config.json"  # the JSON file being read: json recurses once per level, so a file nested
    try:  # 100 000 levels deep is a RecursionError, named here
        config = load_config(args.model)  # a bad model path fails before the tokenizer is looked for
        quantized = getattr(config, "quantization_config", None)
        if quantized:
            parser.error(
                f"{args.model} is already quantized (its config.json has a quantization_config, "
                f"quant_method {(quantized if isinstance(quantized, dict) else {}).get('quant_method')!r}): "
                + (
                    "--fake-quant w4a8 quantizes the BF16 checkpoint itself; point --model at the BF16 "
                    "source it was converted from"
                    if args.fake_quant
                    else "the reference runs BF16 checkpoints; point --model at the BF16 source (with "
                    "--fake-quant w4a8 for the quantized model's oracle)"
                )
            )
        tokenizer = load_tokenizer(args.model)
        ids = (
            args.prompt_ids
            if args.prompt is None
            else encode(tokenizer, args.prompt, "chat" if args.chat else "default")
        )
        if not ids:
            parser.error("the prompt is empty")
        reading = "generation_config.json"
        eos = [] if args.ignore_eos else eos_token_ids(args.model)
        reading = None
        if args.fake_quant:
            from reference.fake_quant import load_fake_quant_model

            model = load_fake_quant_model(args.model, getattr(torch, args.dtype), scheme=args.fake_quant)
        else:
            model = load_model(args.model, dtype=getattr(torch, args.dtype))
        _check_finite(model, args.model, parser)
        if args.kv_cache == "fp8":
            if args.no_cache:
                parser.error("--kv-cache fp8 quantizes the KV cache; it cannot be combined with --no-cache")
            from reference.fake_quant import fake_quantize_kv_cache

            fake_quantize_kv_cache(model)
        new = greedy_generate(
            model, torch.tensor([ids]), args.max_new_tokens, use_cache=not args.no_cache, eos_token_ids=eos
        )
    except (ValueError, OSError) as e:  # bad checkpoint / config / prompt, token id outside vocab, too long
        parser.error(str(e))
    except RecursionError:
        if reading is None:
            raise
        parser.error(
            f"{Path(args.model) / reading} is nested too deeply to be a checkpoint's JSON (more than "
            f"{sys.getrecursionlimit()} levels); fix or re-download it"
        )
    new = trim_at_eos(new[0].tolist(), eos)
    print("prompt ids:", ",".join(map(str, ids)))
    print("generated ids:", ",".join(map(str, new)))
    print("finish:", "eos" if new and new[-1] in eos else "length")
    if tokenizer is not None:
        print("text:", repr(decode(tokenizer, ids + new)))
        print("completion:", repr(decode(tokenizer, new)))
    return 0


def _check_finite(model, path: str, parser) -> None:
    """A NaN / inf weight makes every logit NaN and greedy decoding pick token 0 forever: name the tensor instead.
    (aminmax propagates NaN and keeps +-inf: one pass, no temporary the size of the weight.)"""
    import torch

    for name, t in model.state_dict().items():
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(torch.stack(t.aminmax())).all()):
            parser.error(
                f"checkpoint {path}: tensor {name!r} holds {int((~torch.isfinite(t)).sum())} non-finite "
                f"value(s) (NaN or inf); the checkpoint is corrupt: re-download or re-convert it"
            )


if __name__ == "__main__":
    sys.exit(main())
