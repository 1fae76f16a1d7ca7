"""Portable torch_npu operators: importing this package makes every `torch.ops.npu.<op>` callable.

One module per family, each holding its operators' kernels, validation and fake kernels together.
On an NPU host torch_npu owns the namespace and these modules only record their portable kernels.
"""

from . import attention, cache, formats, gmm, mc2, mx, norm, quant, rotary, routing, torchair_ops  # noqa: F401  (registration)
from .registry import portable_kernel, register  # noqa: F401
