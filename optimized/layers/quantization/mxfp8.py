"""MXFP8 linears: the attention (and dense-MLP) linears of W4A8 and W8A8 checkpoints (spec mx_quant.md §6.6)."""

from __future__ import annotations

import torch
from torch import nn

from optimized.layers.quantization.base import LinearMethod, expect_dtype
from optimized.layers.quantization.lifecycle import check_processed, note_load, nz, param, start_processing
from optimized.layers.quantization.mx_layout import (
    BLOCK,
    FLOAT8_E8M0,
    block_slice,
    check_activation_dtype,
    checkpoint_scale,
    even_blocks,
    runtime_scale,
)
from optimized.layers.quantization.mx_wire import MxRows, mx_quant
from optimized.ops import mx_format as mxf


class MxFp8LinearMethod(LinearMethod):
    """MXFP8 W8A8: weight [N, K] float8_e4m3fn + weight_scale [N, nb] as loaded, then (process_weights_after_loading)
    the runtime layouts weight [K, N] (a view) and weight_scale [nb/2, N, 2]; x quantized per call
    (npu_dynamic_mx_quant), then npu_quant_matmul (fp32 accumulation, output in the activation dtype)."""

    def create_weights(self, layer: nn.Module, out_rows: int, in_features: int, dtype: torch.dtype) -> None:
        check_activation_dtype(dtype)
        layer.weight = nn.Parameter(torch.empty(out_rows, in_features, dtype=torch.float8_e4m3fn), requires_grad=False)
        layer.weight_scale = nn.Parameter(
            torch.zeros(out_rows, even_blocks(in_features), dtype=torch.uint8), requires_grad=False
        )
        layer.output_dtype = dtype
        layer.runtime_layout = False

    def load(self, layer, source, name: str, full_shape: tuple, index: tuple = (), rows: slice = slice(None)) -> None:
        n, k = full_shape
        note_load(layer, name)
        w = source.read(name, full_shape, index)
        expect_dtype(source, name, w, torch.float8_e4m3fn, "MXFP8")
        layer.weight[rows].copy_(w)
        s_index = index
        if len(index) == 2:  # a K-slice (row-parallel): whole scale bytes of its blocks
            s_index = (index[0], block_slice(index[1], k, name))
        s = source.read(mxf.scale_name(name), (n, -(-k // BLOCK)), s_index)
        expect_dtype(source, mxf.scale_name(name), s, torch.uint8, "MXFP8")
        layer.weight_scale[rows, : s.shape[1]].copy_(s)

    def process_weights_after_loading(self, layer) -> None:
        """npu_quant_matmul's layouts, in place of the checkpoint's: weight [K, N] (the transposed view: no copy),
        weight_scale pairs [nb/2, N, 2] (contiguous; the [N, nb] bytes freed)."""
        start_processing(layer)
        layer.weight = param(nz(layer, layer.weight.t()))
        layer.weight_scale = param(runtime_scale(layer.weight_scale))
        layer.runtime_layout = True

    def checkpoint_layout(self, layer) -> dict[str, torch.Tensor]:
        return {"weight": layer.weight.t(), "weight_scale": checkpoint_scale(layer.weight_scale)}

    def apply(self, layer, x) -> torch.Tensor:
        """x: [..., K] in the activation dtype (quantized here), or MxRows [M, K] already quantized -> [..., N]."""
        check_processed(layer)
        if isinstance(x, MxRows):
            return self._matmul(layer, x)
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        return self._matmul(layer, mx_quant(x2)).view(*x.shape[:-1], layer.weight.shape[1])

    def _matmul(self, layer, x: MxRows) -> torch.Tensor:
        return torch.ops.npu.npu_quant_matmul(
            x.data,
            layer.weight,
            layer.weight_scale,
            pertoken_scale=x.scale,
            output_dtype=mxf.dtype_code(layer.output_dtype),
            scale_dtype=FLOAT8_E8M0,
            pertoken_scale_dtype=FLOAT8_E8M0,
            group_sizes=[1, 1, BLOCK],
        )
