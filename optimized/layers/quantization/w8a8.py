"""W8A8 experts: MXFP8 expert weights x MXFP8 activations (the recipe's `w8a8c16`; its linears are mxfp8.py's)."""

from __future__ import annotations

import torch
from torch import nn

from optimized.layers.quantization.base import GMM_TUNING_CONFIG, expect_dtype
from optimized.layers.quantization.lifecycle import check_processed
from optimized.layers.quantization.mx_layout import (
    BLOCK,
    FLOAT8_E8M0,
    MxExpertLayout,
    block_slice,
    check_activation_dtype,
    even_blocks,
)
from optimized.layers.quantization.mx_wire import MxRows, mx_quant
from optimized.ops import mx_format as mxf


class MxFp8MoEGMMMethod(MxExpertLayout):
    """MXFP8 W8A8 experts (§6.6 MXFP8 row, the recipe's `w8a8c16`): w13_weight [L, 2*I_r, H] (gate rows, then up
    rows), w2_weight [L, H, I_r] float8_e4m3fn with per-block scales [L, N, nb], as loaded. The grouped matmul takes
    them as process_weights_after_loading leaves them: the transposed views [L, K, N] and the weight scale in
    `scale` as pairs [L, K/64, N, 2] (contiguous, scale_dtype E8M0); between
    the two, npu_swiglu then npu_dynamic_mx_quant, as the recipe's MxFp8MoEGMMMethod does (no fused SwiGLU + MX
    quantization for this mode)."""

    tensors = ("weight", "weight_scale")

    def create_weights(self, layer, experts: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        def param(*shape, dtype, zeros=False):
            make = torch.zeros if zeros else torch.empty
            return nn.Parameter(make(*shape, dtype=dtype), requires_grad=False)

        check_activation_dtype(dtype)
        fp8, u8 = torch.float8_e4m3fn, torch.uint8
        layer.w13_weight = param(experts, 2 * inter, hidden, dtype=fp8)
        layer.w13_weight_scale = param(experts, 2 * inter, even_blocks(hidden), dtype=u8, zeros=True)
        layer.w2_weight = param(experts, hidden, inter, dtype=fp8)
        layer.w2_weight_scale = param(experts, hidden, even_blocks(inter), dtype=u8, zeros=True)
        layer.output_dtype = dtype
        layer.runtime_layout = False

    def _read(self, source, name: str, shape: tuple, index: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = shape
        scales = index if len(index) < 2 else (index[0], block_slice(index[1], k, name))
        w = source.read(name, shape, index)
        expect_dtype(source, name, w, torch.float8_e4m3fn, "W8A8 (MXFP8 experts)")
        s = source.read(mxf.scale_name(name), (n, -(-k // BLOCK)), scales)
        expect_dtype(source, mxf.scale_name(name), s, torch.uint8, "W8A8 (MXFP8 experts)")
        return w, s

    def _gmm(self, layer, x: MxRows, weight, weight_scale, tokens_per_expert):
        return torch.ops.npu.npu_grouped_matmul(
            [x.data],
            [weight],
            scale=[weight_scale],
            per_token_scale=[x.scale],
            group_list=tokens_per_expert,
            group_type=0,
            group_list_type=1,
            split_item=3,
            tuning_config=GMM_TUNING_CONFIG,
            output_dtype=mxf.dtype_code(layer.output_dtype),
            scale_dtype=FLOAT8_E8M0,
            per_token_scale_dtype=FLOAT8_E8M0,
        )[0]

    def apply(self, layer, x, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: rows [M, H] in the activation dtype (quantized here) or MxRows already quantized -> [M, H]."""
        check_processed(layer)
        xq = x if isinstance(x, MxRows) else mx_quant(x)  # [M, H] fp8
        h = self._gmm(layer, xq, layer.w13_weight, layer.w13_weight_scale, tokens_per_expert)  # [M, 2*I_r]
        h = torch.ops.npu.npu_swiglu(h)  # [M, I_r]
        return self._gmm(layer, mx_quant(h), layer.w2_weight, layer.w2_weight_scale, tokens_per_expert)  # [M, H]
