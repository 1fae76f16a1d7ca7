"""model_config.enable_profiler: a profiler trace of the run, one file per rank.

`profiled(directory, rank)` wraps the generation: on an NPU host torch_npu's profiler (CPU + NPU activities,
written by its tensorboard trace handler into `directory/rank<r>/`), elsewhere torch.profiler (CPU, and CUDA
when present), written as a Chrome trace `directory/rank<r>.json` (chrome://tracing, Perfetto). The directory is
`model_config.output_path`, or the config file's directory when that is empty (the recipe's default), plus
`profile/`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from optimized import platform
from optimized.errors import UsageError


class ProfilerError(UsageError, OSError):
    """The trace directory cannot be written (the message names it)."""


def trace_directory(output_path: str, config_file: str | Path) -> Path:
    return Path(output_path or Path(config_file).resolve().parent) / "profile"


def ensure_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ProfilerError(
            f"model_config.enable_profiler: cannot write the trace to {directory}: "
            f"{e.strerror or e}; set model_config.output_path to a writable directory"
        ) from None


@contextlib.contextmanager
def profiled(directory: Path, rank: int):
    """Profile the body; the trace file(s) are written when it ends. Yields the path written (or its directory).
    Call `ensure_writable(directory)` first to fail before the run rather than after it."""
    if platform.backend_name() == "npu":  # pragma: no cover - needs torch_npu
        import torch_npu

        where = directory / f"rank{rank}"
        activities = [torch_npu.profiler.ProfilerActivity.CPU, torch_npu.profiler.ProfilerActivity.NPU]
        with torch_npu.profiler.profile(
            activities=activities, on_trace_ready=torch_npu.profiler.tensorboard_trace_handler(str(where))
        ):
            yield where
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    trace = directory / f"rank{rank}.json"
    with profile(activities=activities) as prof:
        yield trace
    prof.export_chrome_trace(str(trace))
