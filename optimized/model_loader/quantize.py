"""Offline BF16 -> W4A8 / W8A8 / W4A4 checkpoint conversion (spec mx_quant.md §8), streamed tensor by tensor.

`convert_checkpoint(src, dst, quant, ...)` (`python -m optimized convert --quant w4a8|w8a8|w4a4 SRC DST`) writes:
- W4A8 (`w4a8c16`): routed experts' gate/up/down MXFP4 E2M1 (uint8, two codes per byte along K, low nibble first),
  attention q/k/v/o and dense-MLP weights MXFP8 E4M3;
- W8A8 (`w8a8c16`): all of those MXFP8 E4M3, the experts too;
- W4A4 (`w4a4c16`): all of those MXFP4, q/k/v and o first rotated by the layer's T_in / T_out when a rotation
  directory is given (`cast(fp32(W) @ inverse(T)^T)`, back to the source dtype);
each with `<name>_scale`, one E8M0 byte per 32-block of K ([N, ceil(K/32)]); norms, router, embeddings and lm_head
copied unchanged; config.json's compressed-tensors `quantization_config` (with the per-token FP8 `kv_cache_scheme`
for kv_cache="fp8", null for "bf16"); other files copied, an index rewritten with the same shard names.
`keep_dense_gate_proj` leaves dense MLPs' gate_proj 16-bit, as the recipe's converter does. Every output header is
computed from the source's metadata first, then each tensor is read, quantized and appended in row chunks: memory
holds a few MB of one tensor. A quantized source or a non-empty destination is a ConversionError.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from optimized.errors import CheckpointError, UsageError
from optimized.model_loader.checkpoint_files import INDEX_FILE, open_file, read_json, weight_files
from optimized.ops import mx_format as mxf

# config.json's quantization_config as the recipe's converter writes it (§8.3): the loader accepts exactly this
from optimized.layers.quantization.converter_config import recipe_quantization_config as quantization_config
from optimized.layers.quantization.schemes import MX_SCHEMES, W4A8, QuantScheme, scheme_row
from optimized.ops.mx_format import mx_quantize_weight, scale_name  # noqa: F401  (scale_name: the converter's naming)

QUANT_TYPES = MX_SCHEMES  # the quantization table's schemes
SCHEMES_ROTATED = tuple(scheme_row(q).label for q in MX_SCHEMES if scheme_row(q).hadamard)
KV_CACHE_CHOICES = ("fp8", "bf16")
BLOCK = mxf.BLOCK_SIZE
KEPT_CHUNK_BYTES = 64 << 20  # unquantized tensors are copied in row chunks of about this size
QUANT_CHUNK_VALUES = 1 << 20  # quantized tensors are converted in row chunks of about this many values

_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_FP8_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
_DENSE_GATE = re.compile(r"^model\.layers\.\d+\.mlp\.gate_proj\.weight$")
_ATTN = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight$")
_KEPT = re.compile(
    r"^(model\.layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm|mlp\.gate)"
    r"\.weight|model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight)$"
)


class ConversionError(UsageError, ValueError):
    """The source cannot be converted (the message names the file, tensor or config key)."""


# --------------------------------------------------------------------------------------------- quantizer

# The converter's quantizer (§8.2) is the MX family's `mx_quantize_weight`; the two formats it writes:
MXFP8, MXFP4 = mxf.E4M3, mxf.E2M1


def quant_format(name: str, quant: str = W4A8, keep_dense_gate_proj: bool = False) -> mxf.MxFormat | None:
    """The format of checkpoint tensor `name` under `quant` (None: copied unchanged); unknown tensors are an
    error. keep_dense_gate_proj: a dense MLP's gate_proj is copied unchanged, as the recipe's converter does."""
    row = scheme_row(quant)
    if _EXPERT.match(name):
        return _weight_format(row, "MoEGMM")
    if keep_dense_gate_proj and _DENSE_GATE.match(name):
        return None
    if _FP8_LINEAR.match(name):
        return _weight_format(row, "Linear")
    if _KEPT.match(name):
        return None
    raise ConversionError(
        f"tensor {name!r} is not a Qwen3-MoE checkpoint tensor the MX converter knows "
        "(per-expert names expected, e.g. model.layers.0.mlp.experts.0.gate_proj.weight)"
    )


def _weight_format(row: QuantScheme, target: str) -> mxf.MxFormat:
    """The MX format of a `target`'s weights under the scheme (a target the scheme lacks falls to its Linear group, as
    the recipe's w8a8c16 experts do)."""
    weight_bits, _ = row.targets.get(target, row.targets["Linear"])
    return MXFP4 if weight_bits == 4 else MXFP8


# ------------------------------------------------------------------------------------------- config.json

# ----------------------------------------------------------------------------------------------- writing


@dataclass
class _Entry:
    """One output tensor: where its bytes come from (`source` name, quantized part or kept) and its header."""

    name: str
    source: str
    part: str  # "weight" | "scale" (quantized) | "kept"
    dtype: str
    shape: list[int]
    nbytes: int


_ITEMSIZE = {"F8_E4M3": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8}


def _plan_file(handle, file: str, fmt_of) -> list[_Entry]:
    entries = []
    for name in handle.keys():
        meta = handle.get_slice(name)
        dtype, shape = meta.get_dtype(), list(meta.get_shape())
        if dtype not in ("BF16", "F16", "F32"):
            raise ConversionError(
                f"{file}: tensor {name!r} has dtype {dtype}: the source looks already quantized "
                "(a BF16/FP16/FP32 checkpoint is expected)"
            )
        fmt = fmt_of(name)
        if fmt is None:
            entries.append(_Entry(name, name, "kept", dtype, shape, _ITEMSIZE[dtype] * _numel(shape)))
            continue
        if len(shape) != 2:
            raise ConversionError(f"{file}: tensor {name!r} has shape {shape}; a 2-D [N, K] weight is expected")
        n, k = shape
        if fmt is MXFP4 and k % 2:
            raise ConversionError(
                f"{file}: tensor {name!r} has K={k} (shape {shape}); MXFP4 packs two values per "
                "byte along K, so K must be even"
            )
        w_shape = [n, k] if fmt is MXFP8 else [n, k // 2]
        s_shape = [n, -(-k // BLOCK)]
        entries.append(_Entry(name, name, "weight", "F8_E4M3" if fmt is MXFP8 else "U8", w_shape, _numel(w_shape)))
        entries.append(_Entry(scale_name(name), name, "scale", "U8", s_shape, _numel(s_shape)))
    return entries


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _header(entries: list[_Entry]) -> bytes:
    """A safetensors header (JSON, offsets in entry order), space-padded to 8 bytes like the library's."""
    meta, offset = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        meta[e.name] = {"dtype": e.dtype, "shape": e.shape, "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _raw(t: torch.Tensor):
    """The tensor's bytes as a buffer (no copy for a contiguous tensor)."""
    return t.contiguous().view(torch.uint8).numpy()


class _Stats:
    def __init__(self):
        self.tensors_in = self.bytes_in = self.bytes_out = 0


class _Rotations:
    """The converter's weight rotations (spec a4w4_hadamard.md §2.3): inverse(T)^T per (layer, kind), cached; None
    (no directory) rotates nothing."""

    def __init__(self, path, num_layers: int):
        self.path, self.num_layers, self.cache = path, num_layers, {}

    def check(self, hidden_size: int, attn_width: int) -> None:
        """Before anything is written: the directory, every layer's file and keys, and the rotated widths."""
        if self.path is None:
            return
        from optimized.layers import hadamard

        hadamard.check_directory(self.path)
        hadamard.check_width(hidden_size, "hidden_size (the q/k/v in-features)")
        hadamard.check_width(attn_width, "num_attention_heads * head_dim (the o_proj in-features)")
        for i in range(self.num_layers):
            self.matrix(i, "o")

    def matrix(self, layer: int, proj: str) -> torch.Tensor | None:
        if self.path is None:
            return None
        from optimized.layers import hadamard

        if layer not in self.cache:
            pair = hadamard.load_layer(self.path, layer)
            for t, key in zip(pair, (hadamard.INPUT_KEY, hadamard.OUTPUT_KEY)):
                inverse, info = torch.linalg.inv_ex(t)
                if info or not torch.isfinite(inverse).all():
                    raise hadamard.RotationError(
                        f"layer {layer}: {hadamard.layer_file(self.path, layer)} key {key!r} "
                        f"is not invertible (the weights are rotated by its inverse)"
                    )
            self.cache[layer] = tuple(hadamard.weight_rotation(t) for t in pair)
        return self.cache[layer][1 if proj == "o" else 0]

    def apply(self, name: str, w: torch.Tensor) -> torch.Tensor:
        m = _ATTN.match(name) if self.path is not None else None
        if m is None:
            return w
        from optimized.layers.hadamard import rotate

        return rotate(w, self.matrix(int(m.group(1)), m.group(2)))  # cast(fp32(W) @ B(inverse(T))^T)


def _write_file(
    handle, entries: list[_Entry], out_path: Path, stats: _Stats, progress, rotations: _Rotations | None = None
) -> None:
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with open(out_path, "wb") as out:
        out.write(_header(entries))
        for e in entries:
            if e.part == "kept":
                meta = handle.get_slice(e.source)
                rows = e.shape[0] if e.shape else 1
                step = max(1, KEPT_CHUNK_BYTES // max(1, e.nbytes // max(rows, 1)))
                if not e.shape:
                    out.write(_raw(handle.get_tensor(e.source)))
                else:
                    for start in range(0, rows, step):
                        out.write(_raw(meta[start : start + step]))
                stats.tensors_in += 1
                stats.bytes_in += e.nbytes
                progress.update(1)
            elif e.part == "weight":
                # Row chunks: quantization is per row, so the chunks' bytes concatenate to the whole tensor's,
                # and the fp32 temporaries stay a few MB whatever the tensor's size.
                meta, fmt = handle.get_slice(e.source), MXFP8 if e.dtype == "F8_E4M3" else MXFP4
                rows, k = meta.get_shape()
                step = max(1, QUANT_CHUNK_VALUES // k)
                scales = []
                for start in range(0, rows, step):
                    w = meta[start : start + step]
                    if rotations is not None:
                        w = rotations.apply(e.source, w)  # per row: chunks rotate as the whole tensor
                    q, s = mx_quantize_weight(w, fmt)
                    out.write(_raw(q))
                    scales.append(s)
                    stats.bytes_in += w.numel() * w.element_size()
                stats.tensors_in += 1
                quantized[e.source] = torch.cat(scales)  # its scale follows right after
                progress.update(1)
            else:
                out.write(_raw(quantized.pop(e.source)))
            stats.bytes_out += e.nbytes


@dataclass
class ConversionReport:
    tensors: int
    bytes_in: int
    bytes_out: int
    files: list[str]


def convert_checkpoint(
    src,
    dst,
    quant: str = "w4a8",
    progress: bool = True,
    kv_cache: str | None = None,
    keep_dense_gate_proj: bool = False,
    hadamard_weight_path=None,
) -> ConversionReport:
    """Convert the BF16 (or FP16/FP32) Qwen3-MoE checkpoint directory `src` into a `quant` (w4a8 | w8a8 | w4a4)
    checkpoint at `dst` (kv_cache: "fp8" writes the recipe's per-token FP8 kv_cache_scheme, "bf16" none; None: the
    recipe's choice, fp8 for w4a8 / w8a8, bf16 for w4a4; keep_dense_gate_proj: dense MLPs' gate_proj stay 16-bit,
    as the recipe's converter leaves them; hadamard_weight_path: w4a4 only, the rotation directory whose matrices
    rotate the attention weights before quantization)."""
    src, dst = Path(src), Path(dst)
    if quant not in QUANT_TYPES:
        raise ConversionError(f"--quant {quant!r} is not supported; supported: {', '.join(QUANT_TYPES)}")
    row = scheme_row(quant)
    kv_cache = kv_cache if kv_cache is not None else ("fp8" if row.fp8_kv_cache else "bf16")
    if kv_cache not in KV_CACHE_CHOICES:
        raise ConversionError(f"--kv-cache {kv_cache!r} is not supported; supported: {', '.join(KV_CACHE_CHOICES)}")
    if not row.fp8_kv_cache and kv_cache != "bf16":
        raise ConversionError(
            f"--kv-cache fp8 is not supported with --quant {quant}: the recipe's {quant}c16 writes no "
            "kv_cache_scheme (a 16-bit KV cache)"
        )
    if hadamard_weight_path is not None and not row.hadamard:
        rotated = "/".join(SCHEMES_ROTATED)
        raise ConversionError(
            f"--hadamard-weight-path rotates {rotated} attention weights; it is not read with --quant {quant}"
        )
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{src} has no config.json")
    config = read_json(config_path, ConversionError, "fix it, or re-download the BF16 checkpoint")
    if not isinstance(config, dict):
        raise ConversionError(f"{config_path} must hold a JSON object")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ConversionError(
            f"{config_path} already has a quantization_config (quant_method {method!r}): the "
            "source is already quantized; convert the BF16 checkpoint instead"
        )
    if config.get("model_type") != "qwen3_moe":
        raise ConversionError(f"{config_path} has model_type={config.get('model_type')!r}; expected 'qwen3_moe'")
    files = sorted({path.name for path in weight_files(src).values()})  # CheckpointError: no / a broken index
    indexed = (src / INDEX_FILE).is_file()
    if dst.resolve() == src.resolve():
        raise ConversionError(f"destination {dst} is the source directory")
    if dst.exists() and any(dst.iterdir()):
        raise ConversionError(f"destination {dst} exists and is not empty")

    # Plan every file first: a bad tensor or rotation anywhere fails before anything is written.
    rotations = _Rotations(hadamard_weight_path, config.get("num_hidden_layers", 0))
    try:
        heads, dim = (
            config.get("num_attention_heads", 0),
            config.get("head_dim") or (config.get("hidden_size", 0) // max(config.get("num_attention_heads", 1), 1)),
        )
        rotations.check(config.get("hidden_size", 0), heads * dim)
    except CheckpointError as e:  # hadamard.RotationError: directory, file, key, width
        raise ConversionError(str(e)) from None
    handles = {file: open_file(src / file) for file in files}
    plans = {
        file: _plan_file(handles[file], file, lambda name: quant_format(name, quant, keep_dense_gate_proj))
        for file in files
    }
    try:
        stats = _write(src, dst, quant, kv_cache, config, files, handles, plans, indexed, progress, rotations)
    except OSError as e:  # a read-only or full destination: name it, never a traceback
        where = Path(e.filename) if e.filename else dst
        verb = "write the converted checkpoint to" if where.resolve().is_relative_to(dst.resolve()) else "read"
        raise ConversionError(f"cannot {verb} {where}: {e.strerror or e}") from None
    return ConversionReport(stats.tensors_in, stats.bytes_in, stats.bytes_out, files)


def _write(
    src: Path,
    dst: Path,
    quant: str,
    kv_cache: str,
    config: dict,
    files,
    handles,
    plans,
    indexed: bool,
    progress,
    rotations: _Rotations | None = None,
) -> _Stats:
    """Every output file of the planned conversion (the streamed shards, the copies, the index, config.json)."""
    from tqdm import tqdm

    dst.mkdir(parents=True, exist_ok=True)
    stats = _Stats()
    total = sum(1 for entries in plans.values() for e in entries if e.part != "scale")
    with tqdm(total=total, unit="tensor", desc=f"convert {quant}", disable=not progress) as bar:
        for file in files:
            bar.set_postfix_str(file)
            _write_file(handles.pop(file), plans[file], dst / file, stats, bar, rotations)  # pop: unmap when done

    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name not in ("config.json", INDEX_FILE):
            shutil.copy2(item, dst / item.name)
    if indexed:
        out_map = {e.name: file for file in files for e in plans[file]}
        (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": out_map}, indent=2))
    config["quantization_config"] = quantization_config(config["num_hidden_layers"], kv_cache, quant)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return stats
