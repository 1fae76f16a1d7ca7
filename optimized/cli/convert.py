"""`python -m optimized convert`.

convert
  Offline conversion of a BF16 Qwen3-MoE checkpoint directory SRC into a W4A8 checkpoint DST (MXFP4 experts,
  MXFP8 attention linears), a W8A8 one (MXFP8 experts and attention linears) or a W4A4 one (MXFP4 experts and
  attention linears; --hadamard-weight-path DIR rotates the attention weights by the directory's per-layer
  matrices first, as the recipe's w4a4c16 does), the rest unchanged (see
  optimized/model_loader/quantize.py; --keep-dense-gate-proj leaves dense MLPs' gate_proj 16-bit as the recipe's
  converter does), streamed tensor by tensor with a progress bar on stderr. A source that is already quantized, or a
  non-empty DST, is an error.
"""

from __future__ import annotations

import time


QUANT_TYPES = [
    "w4a8",
    "w8a8",
    "w4a4",
]  # optimized.model_loader.quantize.QUANT_TYPES (not imported: usage errors stay instant)


def add_parser(sub) -> None:
    conv = sub.add_parser(
        "convert",
        help="offline BF16 -> W4A8 (MXFP4 experts, MXFP8 attention), W8A8 (MXFP8 experts and attention) "
        "or W4A4 (MXFP4 experts and attention) checkpoint conversion",
    )
    conv.add_argument(
        "--quant",
        required=True,
        choices=QUANT_TYPES,
        help="target scheme: w4a8 (the recipe's w4a8c16), w8a8 (w8a8c16) or w4a4 (w4a4c16)",
    )
    conv.add_argument(
        "--kv-cache",
        choices=["fp8", "bf16"],
        default=None,
        help="fp8 (default for w4a8 / w8a8, as the recipe writes it): the per-token FP8 KV cache; bf16 "
        "(w4a4's only choice): a 16-bit cache",
    )
    conv.add_argument(
        "--hadamard-weight-path",
        default=None,
        metavar="DIR",
        help="w4a4 only: directory of layer_{i}_self_attn.pt rotations; q/k/v/o weights are rotated by "
        "inverse(T)^T before quantization (give the same DIR to the runtime: "
        "model_config.hadamard_weight_path)",
    )
    conv.add_argument(
        "--keep-dense-gate-proj",
        action="store_true",
        help="leave dense MLP layers' gate_proj 16-bit, as the recipe's converter does (default: MXFP8 "
        "like up/down_proj)",
    )
    conv.add_argument("src", help="BF16 checkpoint directory (config.json + safetensors)")
    conv.add_argument("dst", help="output directory (must not exist or be empty)")
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from optimized.model_loader.quantize import convert_checkpoint

    start = time.perf_counter()  # ConversionError, CheckpointError: UsageErrors naming the file, tensor or key
    report = convert_checkpoint(
        args.src,
        args.dst,
        args.quant,
        progress=not args.no_progress,
        kv_cache=args.kv_cache,
        keep_dense_gate_proj=args.keep_dense_gate_proj,
        hadamard_weight_path=args.hadamard_weight_path,
    )
    print(
        f"converted {args.src} -> {args.dst} ({args.quant}): {report.tensors} tensors, "
        f"{report.bytes_in / 2**20:.1f} MiB -> {report.bytes_out / 2**20:.1f} MiB in "
        f"{time.perf_counter() - start:.1f} s"
    )
    return 0
