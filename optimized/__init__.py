"""Qwen3-MoE optimized for Ascend NPUs. Importing it makes `torch.ops.npu.*` available on any backend."""

from optimized import ops  # noqa: F401  (registers the portable operators when torch_npu is absent)
from optimized.model_loader.build import load_model, model_from_source  # noqa: F401
from optimized.distributed import ParallelState, init_distributed  # noqa: F401
from optimized.executor.model_runner import GenerationResult, ModelRunner  # noqa: F401
from optimized.executor.sampling import SamplingParams  # noqa: F401
from optimized.model_loader.tokenizer import CheckpointTokenizer, eos_token_ids  # noqa: F401

__all__ = [
    "load_model",
    "model_from_source",
    "ModelRunner",
    "GenerationResult",
    "SamplingParams",
    "ParallelState",
    "init_distributed",
    "CheckpointTokenizer",
    "eos_token_ids",
]
