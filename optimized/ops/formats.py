"""Storage formats: `npu_format_cast` (torch_npu's internal-format cast; no spec section: its semantics are the
identity on values).

On an NPU a tensor's ACL format is how its bytes are laid out in device memory: ND (2) is row-major, FRACTAL_NZ (29)
tiles the last two axes into the blocks the cube unit reads, so a matmul weight cast to NZ once is read without a
per-call relayout. The logical tensor (shape, values, what `.cpu()` gives back) is unchanged. The portable kernel is
therefore the identity on values, returned as a new contiguous tensor (an operator may not alias its input): the CPU
and CUDA backends have one storage format. The model calls it once per weight, at load
(`quantization.process_weights_after_loading`), never in a step.
"""

from __future__ import annotations

import torch

from .registry import register
from .validation import check

OP = "npu_format_cast"
ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29
# The formats a weight is cast to here (an NPU knows more, for convolution layouts the model never uses).
_FORMATS = {ACL_FORMAT_ND: "ND", ACL_FORMAT_FRACTAL_NZ: "FRACTAL_NZ"}


# schema: npu_format_cast(Tensor self, int acl_format) -> Tensor
# values: unchanged (a layout of the same logical tensor); FRACTAL_NZ tiles the last two axes, so it needs >= 2 dims.
def _validate(self: torch.Tensor, acl_format: int) -> None:
    check(
        acl_format in _FORMATS,
        OP,
        f"acl_format={acl_format} is not supported; allowed: "
        + ", ".join(f"{code} ({name})" for code, name in _FORMATS.items()),
    )
    if acl_format == ACL_FORMAT_FRACTAL_NZ:
        check(
            self.dim() >= 2,
            OP,
            f"FRACTAL_NZ (29) tiles the last two axes: self must have >= 2 dims; got shape {tuple(self.shape)}",
        )


def npu_format_cast(self: torch.Tensor, acl_format: int) -> torch.Tensor:
    _validate(self, acl_format)
    return self.clone(memory_format=torch.contiguous_format)


def _fake(self: torch.Tensor, acl_format: int) -> torch.Tensor:
    _validate(self, acl_format)
    return torch.empty(self.shape, dtype=self.dtype, device=self.device)


register("npu_format_cast", npu_format_cast, _fake)
