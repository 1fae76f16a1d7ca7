"""The files of a safetensors checkpoint, opened with a named error for every way they can be broken.

- `weight_files(path) -> {tensor name: file}`, from `model.safetensors.index.json` (its `weight_map`) or the single
  `model.safetensors`; bad JSON, an index without `weight_map`, a listed shard the directory lacks, and a truncated,
  empty or corrupt-header file each raise CheckpointError naming the file and the fix.
- `declared_dtype(path, names)`: the dtype config.json declares (`dtype`, or the older `torch_dtype`), which every
  tensor read must have; MX scale tensors with no `quantization_config` in config.json are named as that key lost.
- `read_json(file, error, fix)`: a JSON file, or `error` naming it (unreadable, not UTF-8, invalid, nested too deep).
- `FusedExpertView`: transformers v5's one-tensor-per-layer experts (`...experts.gate_up_proj` [E, 2I, H],
  `...experts.down_proj` [E, H, I]) presented per expert, reading only the requested slice (`get_slice`), so no
  rank materializes the fused tensor.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

from optimized.errors import CheckpointError  # noqa: F401  (raised here, named for the loader's callers)
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")

# safetensors dtype codes (slice.get_dtype()) -> torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def read_json(file: Path, error: type[Exception] = CheckpointError, fix: str = "re-download it"):
    """The parsed JSON of `file`, or `error` naming the file and the fix."""
    try:
        return json.loads(file.read_text())
    except RecursionError:
        raise error(
            f"{file} is nested too deeply to be a checkpoint's JSON (more than {sys.getrecursionlimit()} levels); {fix}"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise error(f"{file} is not valid JSON ({getattr(e, 'strerror', None) or e}); {fix}") from None


def open_file(file: Path):
    """safe_open with a named error for a missing, empty, truncated or corrupt file."""
    try:
        return safe_open(file, framework="pt")
    except FileNotFoundError:
        raise CheckpointError(f"{file}: file not found; the checkpoint is incomplete (re-download it)") from None
    except Exception as e:  # safetensors raises its own SafetensorError (not an OSError) for bad files
        size = file.stat().st_size if file.exists() else 0
        raise CheckpointError(
            f"{file} ({size} bytes) is not a readable safetensors file ({e}); it is truncated "
            f"or corrupt: re-download or re-convert it"
        ) from None


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it."""
    index = path / INDEX_FILE
    if index.exists():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(
                f"{index} has no 'weight_map' (tensor name -> shard file); re-download it, "
                f"or remove it if the weights are one {SINGLE_FILE}"
            )
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                listed = sorted(n for n, f in files.items() if f == file)
                raise CheckpointError(
                    f"{index} lists shard {file.name} (for {len(listed)} tensor(s), e.g. "
                    f"{listed[0]}) but {file} does not exist; the download is incomplete"
                )
        return files
    if (path / SINGLE_FILE).exists():
        with open_file(path / SINGLE_FILE) as f:
            return {name: path / SINGLE_FILE for name in f.keys()}
    raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def declared_dtype(path: Path, names=()) -> torch.dtype | None:
    """config.json's `dtype` / `torch_dtype`; None when absent or when the checkpoint is quantized. `names`: the
    checkpoint's tensor names, to tell a quantized checkpoint whose config.json lost `quantization_config`."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(config, dict):
        return None
    if config.get("quantization_config"):  # quantized tensors have their own dtypes
        return None
    scales = sorted(n for n in names if n.endswith("weight_scale"))
    if scales:  # only the converter writes them, always beside its quantization_config
        raise CheckpointError(
            f"{path / 'config.json'} has no 'quantization_config', but the checkpoint holds "
            f"quantized tensors ({len(scales)} MX scale tensors, e.g. {scales[0]}): config.json lost "
            f"the key `python -m optimized convert` writes; restore it from the converted "
            f"checkpoint's config.json, or re-convert"
        )
    name = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def expand_fused_experts(files: dict[str, Path], shape_of) -> dict[str, tuple[str, str, int]]:
    """Per-expert name -> (fused name, 'gate' | 'up' | 'down', expert) for every fused expert tensor.

    `shape_of(name)` gives a fused tensor's shape (read from the header only).
    """
    virtual: dict[str, tuple[str, str, int]] = {}
    for name in files:
        m = FUSED_EXPERTS.match(name)
        if m is None:
            continue
        prefix, kind = m.groups()
        shape = tuple(shape_of(name))
        if len(shape) != 3 or (kind == "gate_up_proj" and shape[1] % 2):
            raise CheckpointError(
                f"fused expert tensor {name} has shape {shape}; expected [E, 2*I, H] "
                f"(gate_up_proj) or [E, H, I] (down_proj)"
            )
        parts = ("gate", "up") if kind == "gate_up_proj" else ("down",)
        for e in range(shape[0]):
            for part in parts:
                virtual[f"{prefix}.{e}.{part}_proj.weight"] = (name, part, e)
    return virtual


class FusedExpertView:
    """One expert's gate / up / down matrix inside a fused expert tensor, sliced on read."""

    def __init__(self, fused_slice, part: str, expert: int):
        self.fused, self.part, self.expert = fused_slice, part, expert
        e, rows2, cols = fused_slice.get_shape()
        self.offset = rows2 // 2 if part == "up" else 0
        self.shape = (rows2 // 2, cols) if part in ("gate", "up") else (rows2, cols)

    def get_shape(self):
        return self.shape

    def get_dtype(self):
        return self.fused.get_dtype()

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        rows = index[0] if index else slice(None)
        cols = index[1] if len(index) > 1 else slice(None)
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise TypeError(f"fused expert reads need contiguous row slices, got {rows}")
        rows = slice(self.offset + start, self.offset + stop)
        return self.fused[self.expert : self.expert + 1, rows, cols][0]
