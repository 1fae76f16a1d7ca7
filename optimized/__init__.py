"""Qwen3-MoE optimized for Ascend NPUs. Importing it makes `torch.ops.npu.*` available on any backend."""
from . import ops  # noqa: F401  (registers the portable operators when torch_npu is absent)
