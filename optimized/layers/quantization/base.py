"""The quant method interface: how a layer's weights are created, loaded, prepared once and applied.

Each linear and grouped-matmul layer owns one method, chosen when the model is built (config.py: per layer prefix,
from the checkpoint's quantization_config). The layer delegates to it in four steps:

1. `create_weights(layer, ...)`: the parameters, in the checkpoint layout and dtype of its scheme;
2. `load(layer, source, name, ...)`: this rank's slices of checkpoint tensor `name` into them (format checked);
3. `process_weights_after_loading(layer)`: once, after every load: the runtime layouts the NPU kernels take
   (lifecycle.py runs it over a model);
4. `apply(layer, x, ...)`: the layer's matmul(s).

`LinearMethod` and `FusedMoEMethod` fix the arguments for the two kinds of layer (linear.py, moe.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from optimized.errors import CheckpointError

GMM_TUNING_CONFIG = [0]  # the grouped matmuls' tuning_config (a tiling hint: the expected rows per expert)


class QuantMethod(ABC):
    """One layer's weight format. Holds no tensors itself: they live on the layer."""

    tensors: tuple[str, ...] = ("weight",)  # the checkpoint tensors of one weight (MX: weight and weight_scale)

    @abstractmethod
    def create_weights(self, layer: nn.Module, *sizes, **kwargs) -> None:
        """Create the layer's parameters (checkpoint layout)."""

    @abstractmethod
    def load(self, layer: nn.Module, source, name: str, *where) -> None:
        """Copy this rank's part of checkpoint tensor `name` (read from `source`) into the layer's parameters."""

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Put the loaded parameters in the runtime layouts, once."""

    @abstractmethod
    def apply(self, layer: nn.Module, x, *args) -> torch.Tensor:
        """The layer's forward on activations `x` (a tensor or MxRows)."""

    def checkpoint_layout(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        """The processed parameters back in the checkpoint layouts (only MX methods move them)."""
        return {}


class LinearMethod(QuantMethod):
    """A linear layer: weight rows [N, K] (this rank's), y = x W^T."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, out_rows: int, in_features: int, dtype: torch.dtype) -> None:
        """Parameters for `out_rows` output rows of `in_features` inputs; `dtype`: the activation dtype."""

    @abstractmethod
    def load(
        self, layer: nn.Module, source, name: str, full_shape: tuple, index: tuple = (), rows: slice = slice(None)
    ) -> None:
        """Copy `name[index]` (checked to have `full_shape`) into the layer's weight rows `rows`."""

    @abstractmethod
    def apply(self, layer: nn.Module, x) -> torch.Tensor:
        """x [..., K] -> [..., N]."""


class FusedMoEMethod(QuantMethod):
    """This rank's experts for the grouped matmul: w13 (gate | up) and w2 (down), stacked over the local experts."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, experts: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        """Parameters for `experts` local experts of intermediate size `inter` (this rank's share)."""

    @abstractmethod
    def load(self, layer: nn.Module, source, name: str, local: int, cols: slice) -> None:
        """Expert `name`'s gate/up/down weights (intermediate columns `cols`) into local expert slot `local`."""

    @abstractmethod
    def apply(self, layer: nn.Module, x, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Rows [M, H] grouped by local expert, counts [L] -> [M, H]."""


def expect_dtype(source, name: str, tensor: torch.Tensor, dtype: torch.dtype, scheme: str) -> None:
    """A quantized checkpoint tensor has its scheme's storage dtype."""
    if tensor.dtype != dtype:
        raise CheckpointError(
            f"{source.label}: tensor {name!r} has dtype {tensor.dtype} but the model is built for "
            f"{scheme} (from config.json's quantization_config), which stores it as {dtype}"
        )


def expect_float(source, name: str, tensor: torch.Tensor) -> None:
    """A 16-bit layer's checkpoint tensor is a float of 2 bytes or more (not a quantized one)."""
    if not tensor.dtype.is_floating_point or tensor.dtype.itemsize == 1:
        raise CheckpointError(
            f"{source.label}: tensor {name!r} has dtype {tensor.dtype}: a quantized checkpoint "
            "tensor, but config.json has no quantization_config (the model is built unquantized)"
        )
