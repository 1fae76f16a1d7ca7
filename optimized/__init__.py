"""Qwen3-MoE optimized for Ascend NPUs. Importing it makes `torch.ops.npu.*` available on any backend.

The library: `from optimized import LLM, SamplingParams` (optimized/llm.py, imported on first use).
"""

from optimized import ops  # noqa: F401  (registers the portable operators when torch_npu is absent)
from optimized.model_loader.build import load_model, model_from_source  # noqa: F401
from optimized.distributed import ParallelState, init_distributed  # noqa: F401
from optimized.executor.model_runner import GenerationResult, ModelRunner  # noqa: F401
from optimized.model_loader.tokenizer import CheckpointTokenizer, eos_token_ids  # noqa: F401

_LIBRARY = ("LLM", "SamplingParams", "RequestOutput", "TokenLogprob")

__all__ = [
    *_LIBRARY,
    "load_model",
    "model_from_source",
    "ModelRunner",
    "GenerationResult",
    "ParallelState",
    "init_distributed",
    "CheckpointTokenizer",
    "eos_token_ids",
]


def __getattr__(name):
    if name in _LIBRARY:  # kept out of `python -m optimized`'s start-up
        from optimized import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'optimized' has no attribute {name!r}")
