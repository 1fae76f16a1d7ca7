"""The phase paths a run will take, asked of the plan's one rule in-process: a test that runs the CLI in another
process asserts on these fields (what the config means for this checkpoint), not on the start-up lines it printed."""

from __future__ import annotations

from types import SimpleNamespace

from optimized.config import InferenceConfig
from optimized.layers.quantization.schemes import quant_scheme
from optimized.model_loader.hf_config import load_hf_config
from optimized.model_loader.model_path import resolve_model_path
from optimized.path_plan import PhasePaths, decide_paths


def planned_paths(config) -> PhasePaths:
    """The paths of an inference config (a YAML path, a dict of its keys, or an InferenceConfig) on its model_path's
    checkpoint, as `ExecutionPlan.build` decides them at start-up."""
    if not isinstance(config, InferenceConfig):
        config = InferenceConfig.from_dict(config) if isinstance(config, dict) else InferenceConfig.from_yaml(config)
    m = config.model_config
    hf_config = load_hf_config(resolve_model_path(m.model_path, *m.scheme))
    return decide_paths(hf_config, config.parallel_config, quant_scheme(hf_config))


def small_model_shapes(**over) -> SimpleNamespace:
    """A small Qwen3-MoE's config facts, `over` replacing any: what the plan and the config checks read of a model,
    for checks that need no checkpoint."""
    base = dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        moe_intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=240,
        intermediate_size=48,
        num_hidden_layers=4,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        head_dim=16,
        hidden_size=64,
    )
    return SimpleNamespace(**{**base, **over})
