"""The learned Hadamard rotation of W4A4 checkpoints (spec a4w4_hadamard.md): its directory, and where it acts.

`hadamard_weight_path` is a directory with one file per decoder layer, `layer_{i}_self_attn.pt`: a flat mapping with
two 128x128 float matrices (any floating dtype, used as float32; other keys ignored),
`input_transform.transform.linear.weight` (T_in: q/k/v) and `out_transform.transform.linear.weight` (T_out: o).
`load_layer` reads one (RotationError naming the file, key or matrix it cannot use); `attach(model, path, tp)` hands
them to the W4A4 linears as non-persistent buffers on the model's device, replicated on every rank.

- Activations, online: x <- bf16(fp32(x) @ T) per 128 features (`rotate`), right before the W4A4 linear quantizes
  its input (`MxFp4LinearMethod.apply`), so every path that calls the linear rotates it.
- Weights, offline (the converter): W <- cast(fp32(W) @ inverse(T)^T) per 128 in-features (`weight_rotation`):
  inverse, never a transpose, since T need not be orthogonal. The two cancel.
Every rotated width must be a multiple of 128 (`check_widths`: hidden_size; heads / attn_tp_size * head_dim).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch import nn

from optimized.config import head_dim_of
from optimized.errors import CheckpointError

SIZE = 128  # the recipe's hard-coded block; independent of head_dim
INPUT_KEY = "input_transform.transform.linear.weight"  # q/k/v (merged_qkv_proj)
OUTPUT_KEY = "out_transform.transform.linear.weight"  # o_proj


class RotationError(CheckpointError):
    """A rotation directory, file, key or matrix that cannot be used (the message names layer, file and key)."""


def layer_file(path, layer_idx: int) -> Path:
    return Path(path) / f"layer_{layer_idx}_self_attn.pt"


def check_directory(path) -> Path:
    """The rotation directory, or a RotationError: empty path, missing, not a directory."""
    if path is None or str(path) == "":
        raise RotationError(
            "enable_hadamard is true, but hadamard_weight_path is empty: give the directory of "
            "layer_{i}_self_attn.pt rotation files"
        )
    p = Path(path)
    if not p.exists():
        raise RotationError(
            f"hadamard_weight_path {p} does not exist (a directory of layer_{{i}}_self_attn.pt files is expected)"
        )
    if not p.is_dir():
        raise RotationError(
            f"hadamard_weight_path {p} is not a directory (it must hold one layer_{{i}}_self_attn.pt "
            f"file per decoder layer)"
        )
    return p


def load_layer(path, layer_idx: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(T_in, T_out) of decoder layer `layer_idx`, float32 [128, 128] on `device`: read on the host
    (`torch.load(map_location="cpu", weights_only=True)`, as the recipe reads it), checked, then copied over once."""
    file = layer_file(check_directory(path), layer_idx)
    if not file.is_file():
        raise RotationError(
            f"layer {layer_idx}: rotation file {file} not found (hadamard_weight_path needs "
            f"layer_0_self_attn.pt .. layer_{{L-1}}_self_attn.pt, one per decoder layer)"
        )
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a pickle with custom classes, a truncated or foreign file: one line, named
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RotationError(
            f"layer {layer_idx}: cannot load {file} as a plain mapping of tensors "
            f"(torch.load weights_only=True): {first}"
        ) from None
    if not isinstance(data, dict):
        raise RotationError(
            f"layer {layer_idx}: {file} holds a {type(data).__name__}; a mapping with the keys "
            f"{INPUT_KEY!r} and {OUTPUT_KEY!r} is expected"
        )
    return tuple(_matrix(data, key, layer_idx, file).to(device) for key in (INPUT_KEY, OUTPUT_KEY))


def _matrix(data: dict, key: str, layer_idx: int, file: Path) -> torch.Tensor:
    if key not in data:
        keys = ", ".join(sorted(map(str, data))) or "none"
        raise RotationError(f"layer {layer_idx}: {file} has no key {key!r} (flat dotted keys expected; it has: {keys})")
    t = data[key]
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        what = f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
        raise RotationError(
            f"layer {layer_idx}: {file} key {key!r} is {what}; a floating [{SIZE}, {SIZE}] matrix is expected"
        )
    if tuple(t.shape) != (SIZE, SIZE):
        raise RotationError(
            f"layer {layer_idx}: {file} key {key!r} has shape {list(t.shape)}; the rotation is [{SIZE}, {SIZE}]"
        )
    t = t.float()
    if not torch.isfinite(t).all():
        raise RotationError(f"layer {layer_idx}: {file} key {key!r} holds a NaN or inf")
    return t


def check_width(width: int, what: str) -> None:
    if width % SIZE:
        raise RotationError(
            f"the Hadamard rotation acts on {SIZE}-feature blocks: {what} = {width} is not a multiple "
            f"of {SIZE} (a block would join features of two tokens); choose a model or attn_tp_size "
            f"where it is"
        )


def check_widths(config, attn_tp_size: int) -> None:
    """hidden_size (q/k/v input) and this rank's attention width (o_proj input) are multiples of 128 (spec §4.2)."""
    check_width(config.hidden_size, "hidden_size")  # the q/k/v input
    heads, d = config.num_attention_heads, head_dim_of(config)
    check_width(
        heads // attn_tp_size * d,
        f"num_attention_heads / attn_tp_size * head_dim ({heads} / {attn_tp_size} * {d}, this rank's o_proj input)",
    )


def rotate(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`x [..., K] <- cast(fp32(x) @ B(t))`, B(t) = t on every 128-feature block of K, back in x's dtype (§2.1)."""
    k = x.shape[-1]
    if k % SIZE:
        raise RotationError(f"rotate: the last dim {k} of {tuple(x.shape)} is not a multiple of {SIZE}")
    return (x.float().reshape(-1, SIZE) @ t).reshape(x.shape).to(x.dtype)


def weight_rotation(t: torch.Tensor) -> torch.Tensor:
    """inverse(fp32(t))^T: the matrix the converter applies to a weight's in-features (§2.3)."""
    return torch.linalg.inv(t.float()).T


def fingerprint(path, num_layers: int) -> str:
    """A digest of the rotation files the model reads (layer_0 .. layer_{L-1}, their bytes): what a compiled graph
    holding the rotations as constants depends on (the compile cache's key)."""
    digest = hashlib.sha256()
    for i in range(num_layers):
        file = layer_file(path, i)
        digest.update(f"{file.name}\0".encode() + file.read_bytes())
    return digest.hexdigest()[:20]


def attach(model: nn.Module, path, attn_tp_size: int) -> None:
    """Loads every decoder layer's (T_in, T_out) from `path` onto its merged_qkv_proj / o_proj (and the SP prefill's
    replicated o_proj) as the non-persistent buffer `input_rotation`, on the layer's device; the model keeps the
    files' digest as `hadamard_rotation`."""
    check_directory(path)
    check_widths(model.config, attn_tp_size)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        t_in, t_out = load_layer(path, i, attn.merged_qkv_proj.weight.device)
        for linear, t in ((attn.merged_qkv_proj, t_in), (attn.o_proj, t_out), (attn.o_proj_replicated, t_out)):
            if linear is None:
                continue
            if "input_rotation" not in linear._buffers:  # only MxFp4LinearMethod gives a linear the slot
                raise RotationError(
                    f"layer {i}: the Hadamard rotation applies to W4A4 (MXFP4) attention linears; "
                    f"this one runs {type(linear.quant_method).__name__}"
                )
            linear.input_rotation = t  # a non-persistent buffer: not in the state dict
    model.hadamard_rotation = fingerprint(path, len(model.layers))


def describe(scheme, path) -> str:
    """The start-up line: what enable_hadamard does with this checkpoint (`scheme`: its row of the quantization
    table, schemes.QuantScheme; the recipe ignores the rotation unless the row's `hadamard`)."""
    if scheme.hadamard:
        return (
            f"hadamard rotation: layer_{{i}}_self_attn.pt from {os.fspath(path)}, applied to the inputs of "
            f"merged_qkv_proj and o_proj"
        )
    kind = scheme.label
    return (
        f"hadamard rotation: enable_hadamard ignored: the checkpoint is {kind}, and the rotation applies to W4A4 "
        f"checkpoints only (as in the recipe)"
    )
