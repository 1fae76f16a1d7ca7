"""What the NPU under test declares it runs, decided before any kernel is called.

An NPU-marked test skips only on this declaration (the SoC name torch_npu reports): MX formats and FP8 outputs are
Ascend 950 features; on a device that declares an operator, a kernel error is a failure, never a skip.
"""

from __future__ import annotations

import pytest
import torch


def soc_name() -> str:
    """The NPU's SoC name as torch_npu reports it (e.g. 'Ascend910_9392' on an Atlas A3, an 'Ascend950...' name on
    an Atlas 950); '' without an NPU."""
    from optimized.platform import backend_name

    return torch.npu.get_device_name(0) if backend_name() == "npu" else ""


def is_950() -> bool:
    return "950" in soc_name()


def require_950(what: str) -> None:
    """Skip unless the device is an Ascend 950 (MX formats, FP8 outputs); called before the kernel."""
    if not is_950():
        pytest.skip(f"{what} runs on Ascend 950; this device declares SoC {soc_name() or 'none'}")


# npu_dynamic_quant: what every SoC declares (int8 / int4 per token); the rest (FP8 outputs, per-tensor and
# per-channel modes) on Ascend 950.
_DYNAMIC_QUANT_EVERYWHERE = {(torch.int8, "pertoken"), (torch.quint4x2, "pertoken")}


def require_dynamic_quant(dst: torch.dtype, mode: str) -> None:
    if (dst, mode) not in _DYNAMIC_QUANT_EVERYWHERE:
        require_950(f"npu_dynamic_quant dst_type={dst} quant_mode={mode}")
