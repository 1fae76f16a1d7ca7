"""The one place that chooses the device and the collective backend.

Model code never asks which hardware it runs on; it asks this module for a device or a process-group
backend, and calls `torch.ops.npu.*` the same way everywhere.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def torch_npu_available() -> bool:
    """True when torch_npu imports and sees at least one NPU.

    Set QWEN3_MOE_FORCE_PORTABLE=1 to ignore an installed torch_npu and use the portable kernels.
    """
    if os.environ.get("QWEN3_MOE_FORCE_PORTABLE") == "1":
        return False
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401
    except Exception:  # torch_npu without the CANN toolkit fails at import time
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def backend_name() -> str:
    """'npu', 'cuda' or 'cpu': the accelerator this process computes on."""
    if torch_npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def device(local_rank: int = 0) -> torch.device:
    name = backend_name()
    return torch.device(name, local_rank) if name != "cpu" else torch.device("cpu")


def dist_backend() -> str:
    """Collective backend for torch.distributed: hccl on NPU, nccl on CUDA, gloo on CPU."""
    return {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}[backend_name()]

