"""Qwen3-MoE optimized for Ascend NPUs. Importing it makes `torch.ops.npu.*` available on any backend."""
from . import ops  # noqa: F401  (registers the portable operators when torch_npu is absent)
from .build import load_model, model_from_source  # noqa: F401
from .comm import ParallelState, init_distributed  # noqa: F401
from .runner import GenerationResult, ModelRunner  # noqa: F401
from .sampling import SamplingParams  # noqa: F401

__all__ = ["load_model", "model_from_source", "ModelRunner", "GenerationResult", "SamplingParams", "ParallelState",
           "init_distributed"]
