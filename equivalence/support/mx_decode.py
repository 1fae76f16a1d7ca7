"""MX payloads compared after decoding: two quantizations may differ by at most one element step."""

from __future__ import annotations

import numpy as np
import torch

import optimized  # noqa: F401  (registers torch.ops.npu.*)
from equivalence.ops import mx_oracle as oracle


def bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def _decoded_close_within_one_step(a_y, a_s, b_y, b_s, fmt: str) -> None:
    """Fused ops may differ by 1 ulp of the bf16 pre-quant tensor (§6.2, §13.6): the decoded values must then
    agree within one element step at the larger of the two block scales."""
    a = oracle.dequantize(bytes_of(a_y), a_s.numpy(), fmt)
    b = oracle.dequantize(bytes_of(b_y), b_s.numpy(), fmt)
    scale = np.ldexp(1.0, np.maximum(a_s.numpy(), b_s.numpy()).astype(np.int64) - 127)
    k = a.shape[-1]
    scale = scale.reshape(scale.shape[:-2] + (-1,))[..., np.arange(k) // 32]
    step = oracle.element_ulp(np.maximum(np.abs(a), np.abs(b)) / scale, fmt) * scale
    assert np.all((np.abs(a - b) <= step) | (np.isnan(a) & np.isnan(b)))
    assert np.mean(a_s.numpy() == b_s.numpy()) >= 0.99, "scale bytes mostly identical"
