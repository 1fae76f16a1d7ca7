"""W4A8 experts: MXFP4 expert weights x MXFP8 activations (the recipe's `w4a8c16`; its linears are mxfp8.py's)."""

from __future__ import annotations

import torch
from torch import nn

from optimized.layers.quantization.base import GMM_TUNING_CONFIG, expect_dtype
from optimized.layers.quantization.lifecycle import check_processed, nz, param, start_processing
from optimized.layers.quantization.mx_layout import (
    BLOCK,
    FLOAT4_E2M1,
    FLOAT8_E8M0,
    MxExpertLayout,
    block_slice,
    check_activation_dtype,
    checkpoint_scale,
    even_blocks,
    runtime_scale,
)
from optimized.layers.quantization.mx_wire import FLOAT8_E4M3FN, MxRows, mx_quant
from optimized.ops import mx_format as mxf


class W4A8MxFp4MoEGMMMethod(MxExpertLayout):
    """MXFP4 expert weights x MXFP8 activations (§6.6 W4A8 row): w13_weight [L, 2*I_r, H/2] (gate rows, then up
    rows), w2_weight [L, H, I_r/2], uint8 packed along K, with per-block scales [L, N, nb], as loaded. The weights
    stay in that checkpoint order, cast to NZ as packed FP4 with `weight_nz` (as the recipe casts them: the fractal
    rows and the FP4 pairs both run along K); the grouped matmul takes their transposes [L, K/2, N] and the scale
    pairs [L, K/64, N, 2] (contiguous); the SwiGLU output is quantized by npu_swiglu_mx_quant."""

    tensors = ("weight", "weight_scale")

    def create_weights(self, layer, experts: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        def param(*shape, zeros=False):
            make = torch.zeros if zeros else torch.empty
            return nn.Parameter(make(*shape, dtype=torch.uint8), requires_grad=False)

        check_activation_dtype(dtype)
        if hidden % 2 or inter % 2:
            raise ValueError(
                f"MXFP4 packs two values per byte along K: hidden_size={hidden} and the per-rank "
                f"moe_intermediate_size={inter} must be even"
            )
        layer.w13_weight = param(experts, 2 * inter, hidden // 2)
        layer.w13_weight_scale = param(experts, 2 * inter, even_blocks(hidden), zeros=True)
        layer.w2_weight = param(experts, hidden, inter // 2)
        layer.w2_weight_scale = param(experts, hidden, even_blocks(inter), zeros=True)
        layer.output_dtype = dtype
        layer.runtime_layout = False

    def _read(self, source, name: str, shape: tuple, index: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = shape
        packed = index if len(index) < 2 else (index[0], block_slice(index[1], k, name, per=2))
        scales = index if len(index) < 2 else (index[0], block_slice(index[1], k, name))
        w = source.read(name, (n, k // 2), packed)
        expect_dtype(source, name, w, torch.uint8, "W4A8 (MXFP4 experts)")
        s = source.read(mxf.scale_name(name), (n, -(-k // BLOCK)), scales)
        expect_dtype(source, mxf.scale_name(name), s, torch.uint8, "W4A8 (MXFP4 experts)")
        return w, s

    def process_weights_after_loading(self, layer) -> None:
        """Weights kept [L, N, K/2] (NZ-cast as FP4 pairs, fractals of 32 codes: customize_dtype float8_e4m3fn),
        scales as the kernel's pairs [L, K/64, N, 2] (contiguous)."""
        start_processing(layer)
        for w in ("w13_weight", "w2_weight"):
            fp4 = nz(layer, getattr(layer, w), customize_dtype=FLOAT8_E4M3FN, input_dtype=FLOAT4_E2M1)
            setattr(layer, w, param(fp4))
            setattr(layer, f"{w}_scale", param(runtime_scale(getattr(layer, f"{w}_scale"))))
        layer.runtime_layout = True

    def checkpoint_layout(self, layer) -> dict[str, torch.Tensor]:
        out = {}
        for w in ("w13_weight", "w2_weight"):
            out[w] = getattr(layer, w)
            out[f"{w}_scale"] = checkpoint_scale(getattr(layer, f"{w}_scale"))
        return out

    def _gmm(self, layer, x, x_scale, weight, weight_scale, tokens_per_expert):
        return torch.ops.npu.npu_grouped_matmul(
            [x],
            [weight],
            antiquant_scale=[weight_scale],
            per_token_scale=[x_scale],
            group_list=tokens_per_expert,
            group_type=0,
            group_list_type=1,
            split_item=3,
            tuning_config=GMM_TUNING_CONFIG,
            output_dtype=mxf.dtype_code(layer.output_dtype),
            weight_dtype=FLOAT4_E2M1,
            per_token_scale_dtype=FLOAT8_E8M0,
        )[0]

    def apply(self, layer, x, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: rows [M, H] in the activation dtype (quantized here) or MxRows already quantized -> [M, H]."""
        check_processed(layer)
        xq, xs = x if isinstance(x, MxRows) else mx_quant(x)  # [M, H] fp8
        w13, w2 = layer.w13_weight.transpose(1, 2), layer.w2_weight.transpose(1, 2)  # [L, K/2, N], packed along K
        h = self._gmm(layer, xq, xs, w13, layer.w13_weight_scale, tokens_per_expert)  # [M, 2*I_r]
        hq, hs = torch.ops.npu.npu_swiglu_mx_quant(
            h, group_index=tokens_per_expert, activate_left=True, dst_type=FLOAT8_E4M3FN
        )  # [M, I_r] fp8
        return self._gmm(layer, hq, hs, w2, layer.w2_weight_scale, tokens_per_expert)  # [M, H]
