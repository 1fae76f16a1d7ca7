"""MX weights in the checkpoint layout and in the runtime layout the NPU kernels take (spec mx_quant.md §2.2, §7).

As loaded: MXFP8 `weight [N, K]` float8_e4m3fn, MXFP4 weights uint8 `[N, K/2]` (two E2M1 codes per byte, packed
along K), `weight_scale [N, nb]` one E8M0 byte per 32-block of K, with nb padded to even by a zero byte so the pair
layout `[N, nb/2, 2]` is a view. A rank's K-slice (row-parallel o_proj, down_proj under MoE TP) must start and end
on a 32-block boundary: packed bytes and scale bytes are then sliced whole, straight from the checkpoint.

After processing: weights become their transposed views (`[K, N]`, experts `[L, K(/2), N]`; no copy; A4W4 repacked
along N), scales the paired, transposed pairs `[nb/2, N, 2]` / `[L, nb/2, N, 2]`, contiguous (one copy at build).
`MxExpertLayout` does this for the stacked experts of every MX scheme.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from optimized.errors import CheckpointError
from optimized.layers.quantization.base import FusedMoEMethod
from optimized.layers.quantization.errors import QuantConfigError
from optimized.layers.quantization.lifecycle import nz, note_load, param, start_processing
from optimized.ops import mx_format as mxf

BLOCK = mxf.BLOCK_SIZE
FLOAT4_E2M1 = mxf.float4_e2m1fn_x2  # uint8 holding two codes
FLOAT8_E8M0 = mxf.float8_e8m0fnu  # scale bytes


def check_activation_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.bfloat16, torch.float16):
        raise QuantConfigError(
            f"W4A8 / W8A8 checkpoints run with bfloat16 or float16 activations, W4A4 ones too (the "
            f"MX matmuls write no float32, the fused SwiGLU + MX quantization takes none); got dtype "
            f"{dtype}"
        )


def even_blocks(k: int) -> int:
    nb = -(-k // BLOCK)
    return nb + nb % 2


def block_slice(cols: slice, k: int, name: str, per: int = BLOCK) -> slice:
    """The checkpoint columns `cols` of K as whole units of `per` (32: scale bytes, 2: packed FP4 bytes)."""
    start, stop, _ = cols.indices(k)
    if start % BLOCK or (stop % BLOCK and stop != k):
        raise CheckpointError(
            f"tensor {name!r}: this rank's K-slice [{start}, {stop}) of K={k} does not fall on "
            f"{BLOCK}-element MX block boundaries; choose a parallel layout whose K per rank is a "
            f"multiple of {BLOCK}"
        )
    return slice(start // per, -(-stop // per))


def runtime_scale(scale: torch.Tensor) -> torch.Tensor:
    """Checkpoint scale bytes [..., N, nbp] -> the kernels' pairs [..., nbp/2, N, 2] (§2.2), contiguous."""
    return mxf.pair_scales(scale).transpose(-3, -2).contiguous()


def checkpoint_scale(pairs: torch.Tensor) -> torch.Tensor:
    """The inverse of `runtime_scale`: [..., nbp/2, N, 2] -> [..., N, nbp] (a copy)."""
    return pairs.transpose(-3, -2).flatten(-2)


def transpose_packed_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., N, K/2] packed along K -> [..., K, N/2] packed along N, contiguous (the recipe's transpose_packed_fp4)."""
    if packed.shape[-2] % 2:
        raise ValueError(f"MXFP4 A4W4 weights are packed along N after loading: N={packed.shape[-2]} must be even")
    return mxf.pack_fp4(mxf.unpack_fp4(packed).transpose(-1, -2)).contiguous()


def untranspose_packed_fp4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `transpose_packed_fp4`: [..., K, N/2] -> [..., N, K/2] (a copy)."""
    return mxf.pack_fp4(mxf.unpack_fp4(packed).transpose(-1, -2))


class MxExpertLayout(FusedMoEMethod):
    """Stacked MX experts: copies one expert's weight and scale rows (this rank's columns) into the stacked
    parameters (`_read`, per format, reads and checks a weight with its scale partner), and moves them to the grouped
    matmul's layouts once."""

    tensors = ("weight", "weight_scale")

    @abstractmethod
    def _read(self, source, name: str, shape: tuple, index: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Weight `name[index]` ([N, K] of `shape`, this rank's part) and its scale bytes, dtypes checked."""

    def load(self, layer, source, name: str, local: int, cols: slice) -> None:
        inter, hidden, i_r = layer.intermediate_size, layer.hidden_size, layer.inter_per_rank
        note_load(layer, name.rpartition(".")[0])  # the experts' prefix, not each expert
        for offset, proj in ((0, "gate_proj"), (i_r, "up_proj")):
            w, s = self._read(source, f"{name}.{proj}.weight", (inter, hidden), (cols,))  # [I_r, H(/2)], [I_r, nb]
            layer.w13_weight[local, offset : offset + i_r].copy_(w)
            layer.w13_weight_scale[local, offset : offset + i_r, : s.shape[1]].copy_(s)
        w, s = self._read(source, f"{name}.down_proj.weight", (hidden, inter), (slice(None), cols))  # [H, I_r(/2)]
        layer.w2_weight[local].copy_(w)
        layer.w2_weight_scale[local, :, : s.shape[1]].copy_(s)

    def process_weights_after_loading(self, layer) -> None:
        """npu_grouped_matmul's layouts, in place of the checkpoint's: w13_weight / w2_weight [L, K(/2), N] (the
        transposed views: no copy), their scales pairs [L, nb/2, N, 2] (contiguous; the [L, N, nb] bytes freed)."""
        start_processing(layer)
        for w in ("w13_weight", "w2_weight"):
            setattr(layer, w, param(nz(layer, getattr(layer, w).transpose(1, 2))))
            setattr(layer, f"{w}_scale", param(runtime_scale(getattr(layer, f"{w}_scale"))))
        layer.runtime_layout = True

    def checkpoint_layout(self, layer) -> dict[str, torch.Tensor]:
        out = {}
        for w in ("w13_weight", "w2_weight"):
            out[w] = getattr(layer, w).transpose(1, 2)
            out[f"{w}_scale"] = checkpoint_scale(getattr(layer, f"{w}_scale"))
        return out
