"""W4A4: MXFP4 weights x MXFP4 activations (the recipe's `w4a4c16`, spec a4w4_hadamard.md §3), linears and experts.

The attention linears rotate their input by the learned Hadamard T when one is loaded (optimized/layers/hadamard.py)
before quantizing it; the experts are not rotated.
"""

from __future__ import annotations

import torch
from torch import nn

from optimized.errors import CheckpointError
from optimized.layers.hadamard import rotate
from optimized.layers.quantization.base import GMM_TUNING_CONFIG, LinearMethod, expect_dtype
from optimized.layers.quantization.lifecycle import check_processed, note_load, param, start_processing
from optimized.layers.quantization.mx_layout import (
    BLOCK,
    FLOAT4_E2M1,
    FLOAT8_E8M0,
    block_slice,
    check_activation_dtype,
    checkpoint_scale,
    even_blocks,
    runtime_scale,
    transpose_packed_fp4,
    untranspose_packed_fp4,
)
from optimized.layers.quantization.mx_wire import no_mxfp8_rows
from optimized.layers.quantization.w4a8 import W4A8MxFp4MoEGMMMethod
from optimized.ops import mx_format as mxf


def fp4_quant(x: torch.Tensor):
    """MXFP4 E2M1 activations as the recipe's W4A4 path quantizes them (scale_alg 0, rint, block 32): uint8 [M, K/2]
    (two codes per byte), scale pairs [M, K/64, 2]."""
    return torch.ops.npu.npu_dynamic_mx_quant(x, dst_type=FLOAT4_E2M1)


class MxFp4LinearMethod(LinearMethod):
    """MXFP4 W4A4 (the recipe's `MxFp4LinearMethod`, spec a4w4_hadamard.md §3.1): weight uint8 [N, K/2] (packed along
    K) + weight_scale [N, nb] as loaded, then (process_weights_after_loading) weight [K, N/2] packed along N
    (unpacked, transposed, repacked: contiguous) and weight_scale [nb/2, N, 2]. Per call: the layer's
    `input_rotation` (the Hadamard T of optimized/layers/hadamard.py, when loaded) on x, npu_dynamic_mx_quant to
    FP4, then the FP4 x FP4 npu_quant_matmul (fp32 accumulation, output in the activation dtype). A single row (a
    batch-1 decode) is duplicated first and the output sliced back, as the recipe does: the NPU's FP4 matmul does not
    take M == 1 (strict mode refuses it in the portable kernel too)."""

    def create_weights(self, layer: nn.Module, out_rows: int, in_features: int, dtype: torch.dtype) -> None:
        check_activation_dtype(dtype)
        if in_features % 2:
            raise ValueError(
                f"MXFP4 packs two values per byte along K: this rank's in_features={in_features} must be even"
            )
        layer.weight = nn.Parameter(torch.empty(out_rows, in_features // 2, dtype=torch.uint8), requires_grad=False)
        layer.weight_scale = nn.Parameter(
            torch.zeros(out_rows, even_blocks(in_features), dtype=torch.uint8), requires_grad=False
        )
        layer.in_features_per_rank = in_features
        layer.output_dtype = dtype
        layer.runtime_layout = False
        layer.register_buffer("input_rotation", None, persistent=False)  # the Hadamard T, when loaded (hadamard.py)

    def load(self, layer, source, name: str, full_shape: tuple, index: tuple = (), rows: slice = slice(None)) -> None:
        n, k = full_shape
        note_load(layer, name)
        packed = index if len(index) < 2 else (index[0], block_slice(index[1], k, name, per=2))
        w = source.read(name, (n, k // 2), packed)
        expect_dtype(source, name, w, torch.uint8, "W4A4 (MXFP4)")
        layer.weight[rows].copy_(w)
        scales = index if len(index) < 2 else (index[0], block_slice(index[1], k, name))
        s = source.read(mxf.scale_name(name), (n, -(-k // BLOCK)), scales)
        expect_dtype(source, mxf.scale_name(name), s, torch.uint8, "W4A4 (MXFP4)")
        layer.weight_scale[rows, : s.shape[1]].copy_(s)

    def process_weights_after_loading(self, layer) -> None:
        """npu_quant_matmul's A4W4 layouts: weight [K, N/2] packed along N (contiguous), scale pairs [nb/2, N, 2]."""
        start_processing(layer)
        layer.weight = param(transpose_packed_fp4(layer.weight))
        layer.weight_scale = param(runtime_scale(layer.weight_scale))
        layer.runtime_layout = True

    def checkpoint_layout(self, layer) -> dict[str, torch.Tensor]:
        return {"weight": untranspose_packed_fp4(layer.weight), "weight_scale": checkpoint_scale(layer.weight_scale)}

    def apply(self, layer, x) -> torch.Tensor:
        """x: [..., K] in the activation dtype -> [..., N]; rotated (when the layer has a rotation), then quantized."""
        check_processed(layer)
        no_mxfp8_rows(x, "a W4A4 linear (it rotates and quantizes its own input to MXFP4)")
        if layer.input_rotation is not None:
            x = rotate(x, layer.input_rotation)  # bf16(fp32(x) @ B(T))
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        rows = x2.shape[0]
        if rows == 1:  # the kernel's M == 1 limit: two equal rows; both rows' scales go in (the recipe's apply)
            x2 = torch.cat([x2, x2])
        xq, xs = fp4_quant(x2)  # [M, K/2] uint8, [M, K/64, 2]
        out = torch.ops.npu.npu_quant_matmul(
            xq,
            layer.weight,
            layer.weight_scale,
            pertoken_scale=xs,
            output_dtype=mxf.dtype_code(layer.output_dtype),
            x1_dtype=FLOAT4_E2M1,
            x2_dtype=FLOAT4_E2M1,
            scale_dtype=FLOAT8_E8M0,
            pertoken_scale_dtype=FLOAT8_E8M0,
            group_sizes=[1, 1, BLOCK],
        )
        return out[:rows].view(*x.shape[:-1], out.shape[-1])


class W4A4MxFp4MoEGMMMethod(W4A8MxFp4MoEGMMMethod):
    """MXFP4 expert weights x MXFP4 activations (the recipe's W4A4MxFp4MoEGMMMethod, spec a4w4_hadamard.md §3.2, §6.6
    A4W4 row): loaded as the W4A8 experts are ([L, N, K/2] packed along K, scales [L, N, nb]); after loading
    w13_weight [L, H, 2*I_r/2] and w2_weight [L, I_r, H/2] packed along N (contiguous), scales [L, K/64, N, 2].
    x -> npu_dynamic_mx_quant FP4 -> A4W4 grouped matmul -> npu_swiglu -> FP4 -> A4W4 grouped matmul. Not rotated."""

    def _read(self, source, name: str, shape: tuple, index: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return super()._read(source, name, shape, index)
        except CheckpointError as e:
            raise CheckpointError(str(e).replace("W4A8 (MXFP4 experts)", "W4A4 (MXFP4 experts)")) from None

    def process_weights_after_loading(self, layer) -> None:
        """npu_grouped_matmul's A4W4 layouts: weights [L, K, N/2] packed along N (contiguous), scales [L, K/64, N,
        2]."""
        start_processing(layer)
        for w in ("w13_weight", "w2_weight"):
            setattr(layer, w, param(transpose_packed_fp4(getattr(layer, w))))
            setattr(layer, f"{w}_scale", param(runtime_scale(getattr(layer, f"{w}_scale"))))
        layer.runtime_layout = True

    def checkpoint_layout(self, layer) -> dict[str, torch.Tensor]:
        out = {}
        for w in ("w13_weight", "w2_weight"):
            out[w] = untranspose_packed_fp4(getattr(layer, w))
            out[f"{w}_scale"] = checkpoint_scale(getattr(layer, f"{w}_scale"))
        return out

    def _gmm(self, layer, x, x_scale, weight, weight_scale, tokens_per_expert):
        return torch.ops.npu.npu_grouped_matmul(
            [x],
            [weight],
            scale=[weight_scale],
            per_token_scale=[x_scale],
            group_list=tokens_per_expert,
            group_type=0,
            group_list_type=1,
            split_item=3,
            tuning_config=GMM_TUNING_CONFIG,
            output_dtype=mxf.dtype_code(layer.output_dtype),
            x_dtype=FLOAT4_E2M1,
            weight_dtype=FLOAT4_E2M1,
            scale_dtype=FLOAT8_E8M0,
            per_token_scale_dtype=FLOAT8_E8M0,
        )[0]

    def apply(self, layer, x, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: rows [M, H] in the activation dtype (quantized here) -> [M, H]."""
        check_processed(layer)
        no_mxfp8_rows(x, "the W4A4 experts (they quantize their own input to MXFP4)")
        xq, xs = fp4_quant(x)  # [M, H/2] fp4
        h = self._gmm(layer, xq, xs, layer.w13_weight, layer.w13_weight_scale, tokens_per_expert)  # [M, 2*I_r]
        h = torch.ops.npu.npu_swiglu(h)  # [M, I_r]
        hq, hs = fp4_quant(h)
        return self._gmm(layer, hq, hs, layer.w2_weight, layer.w2_weight_scale, tokens_per_expert)  # [M, H]
