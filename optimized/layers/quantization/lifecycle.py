"""The load lifecycle of a layer's weights: load (checkpoint layout) -> process once (runtime layout) -> apply.

After every load, `process_weights_after_loading(model)` (the build calls it once) has each quant method put its
layer's parameters in the runtime layouts the NPU kernels take, as the recipe's MX modules do, so no forward call
re-lays them out (with `weight_nz`, also cast once to the NZ layout). Applying an MX layer before that, processing
it twice or loading into it after it, is an error naming the layer. `checkpoint_layout_parameters(model)` gives the
parameters back in the checkpoint layouts (tests, inspection).
"""

from __future__ import annotations

import torch
from torch import nn

ACL_FORMAT_FRACTAL_NZ = 29  # npu_format_cast's acl_format for the NZ weight layout


def layer_label(layer: nn.Module) -> str:
    names = getattr(layer, "loaded_from", None)
    return f"{type(layer).__name__} ({', '.join(names) if names else 'nothing loaded'})"


def note_load(layer: nn.Module, name: str) -> None:
    """Remembers what the layer loads (its name in errors); a load into runtime layouts would scramble them."""
    if getattr(layer, "runtime_layout", False):
        raise RuntimeError(
            f"{layer_label(layer)}: cannot load {name!r} after process_weights_after_loading (its "
            f"parameters are in the runtime layout now); load into a freshly built model"
        )
    names = layer.__dict__.setdefault("loaded_from", [])
    if name not in names:
        names.append(name)


def start_processing(layer: nn.Module) -> None:
    # Refused, not idempotent: a second pass would transpose the runtime layouts again.
    if getattr(layer, "runtime_layout", False):
        raise RuntimeError(
            f"{layer_label(layer)}: process_weights_after_loading was already called; it runs "
            f"once per layer, after all its weights are loaded"
        )


def check_processed(layer: nn.Module) -> None:
    if not layer.runtime_layout:
        raise RuntimeError(
            f"{layer_label(layer)}: applied before process_weights_after_loading(layer): its MX "
            f"weights are still in the checkpoint layout (the model build calls it after loading; "
            f"a layer built by hand must call it too)"
        )


def param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def nz(layer: nn.Module, weight: torch.Tensor, **element) -> torch.Tensor:
    """`weight` as the kernels read it: with `layer.weight_nz` (model_config.enable_weight_nz, set by
    `process_weights_after_loading(model, weight_nz=...)`) made contiguous, then cast once to FRACTAL_NZ, whose
    fractals tile its last two axes as they are now (docs/nz_format.md); without it, as it is. `element`: the
    cast's customize_dtype / input_dtype (packed FP4)."""
    if not getattr(layer, "weight_nz", False):
        return weight
    return torch.ops.npu.npu_format_cast(weight.contiguous(), ACL_FORMAT_FRACTAL_NZ, **element)


def process_weights_after_loading(model: nn.Module, weight_nz: bool = False) -> None:
    """Each layer with a quant method in `model` (itself included) prepares its runtime layouts: once, after every
    weight is loaded. `modules()` yields a module held twice once. weight_nz: every linear, expert and MX weight is
    cast to the NZ layout (contiguous first) except the router gate (`router`: made contiguous, kept ND)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            module.weight_nz = weight_nz and not getattr(module, "router", False)
            method.process_weights_after_loading(module)


def checkpoint_layout_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.named_parameters()` with every processed MX layer's tensors in the checkpoint layouts (weights as
    views, scales as copies [..., N, nbp]): what loading wrote, for tests and inspection."""
    params = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        if getattr(module, "runtime_layout", False):
            for attr, tensor in module.quant_method.checkpoint_layout(module).items():
                params[f"{prefix}.{attr}" if prefix else attr] = tensor
    return params
