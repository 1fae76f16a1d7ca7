"""RMSNorm on the fused operators: `npu_rms_norm` alone, `npu_add_rms_norm` when a residual is carried."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def load(self, source, name: str) -> None:
        self.weight.copy_(source.read(name, (self.hidden_size,)))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: the normalized x. With residual: (normalized residual + x, residual + x)."""
        if residual is None:
            return torch.ops.npu.npu_rms_norm(x, self.weight, self.eps)[0]
        y, _, new_residual = torch.ops.npu.npu_add_rms_norm(residual, x, self.weight, self.eps)
        return y, new_residual
