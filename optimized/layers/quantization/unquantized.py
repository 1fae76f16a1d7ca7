"""16-bit weights (BF16 checkpoints, and a 16-bit projection inside an MX checkpoint): plain matmuls."""

from __future__ import annotations

import torch
from torch import nn

from optimized.layers.quantization.base import GMM_TUNING_CONFIG, FusedMoEMethod, LinearMethod, expect_float
from optimized.layers.quantization.lifecycle import nz, param
from optimized.layers.quantization.mx_wire import no_mx
from optimized.ops import cpu_gemm


class UnquantizedLinearMethod(LinearMethod):
    """weight [N, K] in the activation dtype; y = x W^T."""

    def create_weights(self, layer: nn.Module, out_rows: int, in_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_rows, in_features, dtype=dtype), requires_grad=False)

    def load(self, layer, source, name: str, full_shape: tuple, index: tuple = (), rows: slice = slice(None)) -> None:
        """Copy `name[index]` (checked to have `full_shape`) into the layer's weight rows `rows`."""
        t = source.read(name, full_shape, index)
        expect_float(source, name, t)
        layer.weight[rows].copy_(t)

    def process_weights_after_loading(self, layer) -> None:
        """The [N, K] weight contiguous, cast to NZ with `layer.weight_nz` (the CPU's oneDNN packing is the portable
        kernel's own, cpu_gemm.py)."""
        weight = layer.weight.contiguous()
        if weight is not layer.weight or getattr(layer, "weight_nz", False):
            layer.weight = param(nz(layer, weight))

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        no_mx(x, "an unquantized linear")
        return cpu_gemm.linear(x, layer.weight)  # F.linear, on CPU bf16 with oneDNN's prepacked weight


def _transposed_empty(groups: int, k: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized [groups, k, n] tensor whose storage is [groups, n, k]."""
    return torch.empty(groups, n, k, dtype=dtype).transpose(1, 2)


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """w13 [L, H, 2*I_r] (gate | up), w2 [L, I_r, H] in the activation dtype, stored as transposed views of the
    checkpoint's [N, K] rows (as the recipe does: each expert's GEMM then streams weight rows)."""

    def create_weights(self, layer, experts: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        layer.w13 = nn.Parameter(_transposed_empty(experts, hidden, 2 * inter, dtype), requires_grad=False)
        layer.w2 = nn.Parameter(_transposed_empty(experts, inter, hidden, dtype), requires_grad=False)

    def load(self, layer, source, name: str, local: int, cols: slice) -> None:
        inter, hidden, i_r = layer.intermediate_size, layer.hidden_size, layer.inter_per_rank
        gate = source.read(f"{name}.gate_proj.weight", (inter, hidden), (cols,))  # [I_r, H]
        up = source.read(f"{name}.up_proj.weight", (inter, hidden), (cols,))  # [I_r, H]
        down = source.read(f"{name}.down_proj.weight", (hidden, inter), (slice(None), cols))  # [H, I_r]
        for proj, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            expect_float(source, f"{name}.{proj}.weight", t)
        layer.w13[local, :, :i_r].copy_(gate.t())
        layer.w13[local, :, i_r:].copy_(up.t())
        layer.w2[local].copy_(down.t())

    def process_weights_after_loading(self, layer) -> None:
        """w13 / w2 are created as the grouped matmul's transposed views; with `layer.weight_nz` cast to NZ
        (contiguous first)."""
        if getattr(layer, "weight_nz", False):
            layer.w13, layer.w2 = param(nz(layer, layer.w13)), param(nz(layer, layer.w2))

    def apply(self, layer, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        no_mx(x, "the unquantized experts")
        h = torch.ops.npu.npu_grouped_matmul(
            [x],
            [layer.w13],
            group_list=tokens_per_expert,
            group_type=0,
            group_list_type=1,
            split_item=3,
            tuning_config=GMM_TUNING_CONFIG,
        )[0]  # [M, 2*I_r]
        h = torch.ops.npu.npu_swiglu(h)  # [M, I_r]
        return torch.ops.npu.npu_grouped_matmul(
            [h],
            [layer.w2],
            group_list=tokens_per_expert,
            group_type=0,
            group_list_type=1,
            split_item=3,
            tuning_config=GMM_TUNING_CONFIG,
        )[0]  # [M, H]
