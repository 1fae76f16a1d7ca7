"""`load_model`: the optimized model for one rank, with its shard of a checkpoint (or random weights)."""

from __future__ import annotations

import os

import torch

from optimized import platform
from optimized.distributed import ParallelState
from optimized.config import InferenceConfig, is_sparse_layer
from optimized.layers.quantization.config import QuantConfig
from optimized.layers.quantization.lifecycle import process_weights_after_loading
from optimized.layers.quantization.schemes import MXFP8_WIRE, QuantScheme
from optimized.model_loader.hf_config import load_hf_config
from optimized.model_loader.loader import CheckpointReader, RandomWeights
from optimized.model import Qwen3MoeForCausalLM
from optimized.ops.required import check_operators, required_operators
from optimized.path_plan import ALLTOALL, PhasePaths


def load_model(
    model_path: str | os.PathLike,
    *,
    parallel: ParallelState | None = None,
    dtype: torch.dtype = torch.bfloat16,
    random_weights: bool = False,
    seed: int = 0,
    num_hidden_layers: int | None = None,
    device: torch.device | str | None = None,
    check_weights: bool = True,
    force_eplb: bool = False,
    weight_nz: bool = True,
    hadamard_weight_path: str | os.PathLike | None = None,
    paths: PhasePaths | None = None,
) -> Qwen3MoeForCausalLM:
    """Build the optimized Qwen3MoeForCausalLM for this rank and load this rank's weight shards.

    model_path: a directory with config.json (+ safetensors unless random_weights). parallel: the process
    groups (default: a single process). num_hidden_layers: keep only the first N layers. device: where the
    model lives, default this process's accelerator (`platform.device()`: the CPU only on a host without one).
    check_weights: every tensor read is checked finite (a CheckpointError names a NaN / inf weight or an E8M0
    scale byte 0xFF). force_eplb: model_config.force_eplb, the recipe's forced balanced routing. weight_nz:
    model_config.enable_weight_nz, every linear, expert and MX weight cast once to the NPU's NZ layout after loading.
    hadamard_weight_path: model_config.enable_hadamard's directory of per-layer rotations (None: enable_hadamard off;
    "" is an error): loaded onto a W4A4 checkpoint's attention linears (optimized/layers/hadamard.py), ignored for
    any other checkpoint as the recipe does (`hadamard.describe` says so). paths: the execution plan's phase paths
    (None: the model decides them by the plan's rule, optimized/path_plan.py).
    """
    config = load_hf_config(model_path)  # ModelConfigError for another model_type, missing counts, ...
    full_layers = config.num_hidden_layers
    if num_hidden_layers is not None:
        if not 1 <= num_hidden_layers <= full_layers:
            raise ValueError(f"num_hidden_layers={num_hidden_layers} must be in [1, {full_layers}] for {model_path}")
        config.num_hidden_layers = num_hidden_layers
    if random_weights:
        if getattr(config, "quantization_config", None):
            from optimized.layers.quantization.errors import QuantConfigError

            raise QuantConfigError(
                f"{model_path}/config.json has a quantization_config: random weights are drawn in "
                "the activation dtype, so run a quantized model from its checkpoint (with_ckpt: true)"
            )
        source = RandomWeights(seed)
    else:
        source = CheckpointReader(model_path, check_weights)
        # Layers cut off by num_hidden_layers are deliberately unused, not unexpected.
        for name in source.names():
            if _layer_of(name) >= config.num_hidden_layers:
                source.skip(name)
    return model_from_source(
        config,
        source,
        parallel=parallel,
        dtype=dtype,
        device=device,
        force_eplb=force_eplb,
        weight_nz=weight_nz,
        hadamard_weight_path=hadamard_weight_path,
        paths=paths,
    )


def model_from_source(
    config,
    source,
    *,
    parallel: ParallelState | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    force_eplb: bool = False,
    weight_nz: bool = True,
    hadamard_weight_path: str | os.PathLike | None = None,
    paths: PhasePaths | None = None,
) -> Qwen3MoeForCausalLM:
    """The optimized model for `config`, weights from any source (CheckpointReader, StateDictSource, ...); paths: the
    plan's phase paths (None: the model decides them by the plan's rule)."""
    parallel = parallel or ParallelState.single()
    InferenceConfig(parallel_config=parallel.parallel).validate_for_model(config)
    # The checkpoint's quantization, parsed once: the method of each layer, by prefix (a dense projection the
    # checkpoint stores 16-bit, without a scale partner, gets a 16-bit linear: the source is asked here).
    quant = QuantConfig.from_hf_config(config, getattr(source, "has", None))
    rotated = hadamard_weight_path is not None and quant.row.hadamard  # else ignored, as the recipe does
    if rotated:  # before the build: a bad directory or width costs no weight read
        from optimized.layers import hadamard

        hadamard.check_directory(hadamard_weight_path)
        hadamard.check_widths(config, parallel.parallel.attn_tp_size)
    with torch.device(platform.device() if device is None else device):
        model = Qwen3MoeForCausalLM(config, parallel, dtype, force_eplb, quant, paths)
    # before any weight is read: an old torch_npu fails here, naming what it lacks
    check_operators(operators_for(model.paths, quant.row, config, weight_nz=weight_nz))
    if rotated:
        hadamard.attach(model, hadamard_weight_path, parallel.parallel.attn_tp_size)
    model.load_weights(source)
    # Once, after every weight is in: the quant methods' runtime layouts (NZ with weight_nz), so no forward call
    # re-lays them out.
    process_weights_after_loading(model, weight_nz=weight_nz)
    model.weight_nz = weight_nz
    model.enable_hadamard = hadamard_weight_path is not None  # model_config.enable_hadamard (W4A4: rotated)
    model.weight_source = source
    return model.eval()


def operators_for(paths: PhasePaths, scheme: QuantScheme, config, *, weight_nz: bool = True) -> frozenset[str]:
    """The torch.ops.npu operators a model of `config` calls on these paths with this quantization scheme."""
    return required_operators(
        dense_mlp=not all(is_sparse_layer(config, i) for i in range(config.num_hidden_layers)),
        scheme_operators=scheme.operators,
        fused_swiglu_experts=scheme.fused_swiglu_experts,
        mx_wire=paths.wire == MXFP8_WIRE,
        double_routing=paths.ep_scheme == ALLTOALL,
        mc2_decode=paths.mc2,
        weight_nz=weight_nz,
    )


def _layer_of(name: str) -> int:
    return int(name.split(".")[2]) if name.startswith("model.layers.") else -1
