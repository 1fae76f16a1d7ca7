"""The one place that chooses the device and the collective backend.

Model code never asks which hardware it runs on; it asks this module for a device or a process-group
backend, and calls `torch.ops.npu.*` the same way everywhere.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from optimized import envs


@functools.cache
def torch_npu_available() -> bool:
    """True when torch_npu imports and sees at least one NPU.

    Set QWEN3_MOE_FORCE_PORTABLE=1 to ignore an installed torch_npu and use the portable kernels.
    """
    if envs.force_portable():
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


def device(local_rank: int | None = None) -> torch.device:
    """The accelerator `local_rank` computes on; None: the one this process selected (`set_device`), else 0."""
    name = backend_name()
    if name == "cpu":
        return torch.device("cpu")
    if local_rank is None:
        local_rank = torch.cuda.current_device() if name == "cuda" else torch.npu.current_device()
    return torch.device(name, local_rank)


def dist_backend() -> str:
    """Collective backend for torch.distributed: hccl on NPU, nccl on CUDA, gloo on CPU."""
    return {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}[backend_name()]


CAPTURED_GRAPH_MODES = ("acl_graph", "npugraph_ex")  # captured device graphs (npugraph_ex: the recipe's name)
STATIC_GRAPH_MODES = ("ge_graph",)  # one static graph per batch bucket (dynamic=False): the recipe's ge_graph
# The recipe's GE compile options (executor/utils/graph_utils.py, compile_model_forward's defaults).
GE_COMPILE_OPTIONS = dict(frozen_parameter=True, tiling_schedule_optimize=True, topology_sorting_strategy="StableRDFS")
# npugraph_ex's options as the recipe passes them (static kernels and super kernels off: enable_static_kernel is
# refused, and Qwen3-MoE defines no custom_params.enable_superkernel).
NPUGRAPH_EX_OPTIONS = {
    "frozen_parameter": True,
    "static_kernel_compile": False,
    "super_kernel_optimize": False,
    "super_kernel_optimize_options": {"dcci_disable_on_kernel": [".*"]},
}


def torchair():
    """torchair on an NPU host; elsewhere its stand-in with the same entry points (optimized/torchair_standin.py),
    which records what would be compiled and compiles it with inductor."""
    if backend_name() == "npu":  # pragma: no cover - needs torch_npu and torchair
        import torchair

        # As the recipe does before patch_for_hcom (executor/utils/graph_utils.py).
        import torchair.ge_concrete_graph.ge_converter.experimental.patch_for_hcom_allreduce  # noqa: F401

        # Defines torch.ops.air.npu_fused_infer_attention_score_v2, which the ge_graph decode calls (torchair.ops
        # imports it lazily, on its first call through torchair.ops).
        import torchair.ops._npu_fused_infer_attention_score_v2  # noqa: F401

        return torchair
    from optimized import torchair_standin

    return torchair_standin


def compiles_static(exe_mode: str) -> bool:
    """Whether `exe_mode` compiles one static graph per batch bucket (its decode lengths are device tensors)."""
    return exe_mode in STATIC_GRAPH_MODES


def graph_compiler(exe_mode: str, cache_dir: str | os.PathLike | None = None):
    """How this host compiles a decode step, as the recipe compiles it: a function `compile(step) -> callable`,
    `step` an nn.Module whose `forward` is compiled whole (fullgraph).

    - ge_graph: after `patch_for_hcom()`, torchair's GE backend with the recipe's CompilerConfig (frozen parameters,
      tiling schedule optimization, the StableRDFS topology sort), static (`dynamic=False`): one graph per batch
      bucket, the KV lengths device tensors. `cache_dir`: `torchair.inference.cache_compile` (GE cache included).
    - npugraph_ex: torch_npu's `npugraph_ex` backend with the recipe's options (`cache_dir`: its cache_compile),
      dynamic, the KV lengths host lists.
    - acl_graph: torchair's backend in "reduce-overhead" mode (captured ACL graphs), dynamic, host lists.
    Off the NPU the same calls go to the torchair stand-in (inductor underneath, every compile recorded); on CUDA the
    captured modes are inductor with CUDA graphs. torchair is imported only here.
    """
    import torch

    from optimized.config import GRAPH_MODES

    if exe_mode not in GRAPH_MODES:
        raise ValueError(f"exe_mode {exe_mode!r} is not a graph mode; graph modes: {', '.join(GRAPH_MODES)}")
    dynamic = not compiles_static(exe_mode)
    name = backend_name()
    if name == "cuda" and exe_mode in CAPTURED_GRAPH_MODES:
        return lambda step: torch.compile(
            step.forward, backend="inductor", mode="reduce-overhead", dynamic=True, fullgraph=True
        )
    tng = torchair()
    tng.patch_for_hcom()
    if exe_mode == "npugraph_ex":
        if name == "npu":  # pragma: no cover - needs torch_npu
            if cache_dir is not None:
                return lambda step: torch.npu.npugraph_ex.inference.cache_compile(
                    step.forward, cache_dir=str(cache_dir), dynamic=True, options=dict(NPUGRAPH_EX_OPTIONS)
                )
            backend = "npugraph_ex"
        else:
            backend = tng.register_npugraph_ex()
        return lambda step: torch.compile(
            step.forward, dynamic=True, fullgraph=True, backend=backend, options=dict(NPUGRAPH_EX_OPTIONS)
        )
    config = tng.CompilerConfig()
    for key, value in GE_COMPILE_OPTIONS.items():
        setattr(config.experimental_config, key, value)
    if exe_mode in CAPTURED_GRAPH_MODES:
        config.mode = "reduce-overhead"
    if cache_dir is not None:
        return lambda step: tng.inference.cache_compile(
            step.forward, cache_dir=str(cache_dir), config=config, dynamic=dynamic, fullgraph=True, ge_cache=True
        )
    backend = tng.get_npu_backend(compiler_config=config)
    return lambda step: torch.compile(step.forward, backend=backend, dynamic=dynamic, fullgraph=True)


def graph_backend_description(exe_mode: str) -> str:
    """One line for the user: what `exe_mode` compiles with on this host."""
    name = backend_name()
    kind = {"ge_graph": "static GE graph per bucket", "acl_graph": "ACL graph", "npugraph_ex": "npugraph_ex"}[exe_mode]
    if name == "npu":
        return f"{exe_mode}: {'torch_npu' if exe_mode == 'npugraph_ex' else 'torchair'} ({kind})"
    if name == "cuda" and exe_mode in CAPTURED_GRAPH_MODES:
        return f"{exe_mode}: torch.compile inductor + CUDA graphs"
    where = "C++ kernels on CPU; no device graph here" if name == "cpu" else "no device graph"
    who = "the npugraph_ex backend's stand-in" if exe_mode == "npugraph_ex" else f"the torchair stand-in ({kind})"
    return f"{exe_mode}: {who} compiled by torch.compile inductor ({where})"


def memory_bytes(device: torch.device) -> int:
    """The device's total memory (bytes): the accelerator's, or the host's physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    if device.type == "npu":  # pragma: no cover - needs torch_npu
        return torch.npu.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a timing boundary); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def set_device(local_rank: int) -> None:
    """Select this process's accelerator (before its process group exists, so hccl / nccl bind to it)."""
    backend = backend_name()
    if backend == "npu":
        torch.npu.set_device(local_rank)
    elif backend == "cuda":
        torch.cuda.set_device(local_rank)


# ------------------------------------------------------------------------------------------ per-platform settings

PLATFORM_VERSION_ENV = envs.PLATFORM_VERSION
# hccl_config "hccl_op_expansion_mode" codes (the recipe's executor/utils/hccl_utils.py, init_comm_group):
# 3 AIV, 5 CCU_MS, 6 CCU_SCH. The recipe's 950 default group takes 5 on a 950DT and 6 on a 950PR, told apart by the
# device name (executor/core/engine/execution_engine.py, _init_device); another 950 gets no options.
HCCL_OP_EXPANSION_CCU_MS, HCCL_OP_EXPANSION_CCU_SCH = 5, 6
DEFAULT_GROUP_EXPANSION_950 = {"950DT": HCCL_OP_EXPANSION_CCU_MS, "950PR": HCCL_OP_EXPANSION_CCU_SCH}


def npu_device_name() -> str:
    """The NPU's name as torch_npu reports it (`torch.npu.get_device_name()`, e.g. 'Ascend950DT'); '' off the NPU or
    where it cannot be read (the recipe's PlatformVersion.get_device_name does the same)."""
    if backend_name() != "npu":
        return ""
    try:  # pragma: no cover - needs torch_npu
        return str(torch.npu.get_device_name())
    except Exception:  # pragma: no cover
        return ""


def task_queue_enable(platform_version: str, exe_mode: str) -> str:
    """TASK_QUEUE_ENABLE as the recipe sets it (executor/core/config/inference_config.py, ModelConfig._validate): 1
    for npugraph_ex (it takes 0 or 1 only) or on any 950, else 2 (level-2 pipelined dispatch). acl_graph, the same
    captured-graph mode under this project's other name, follows npugraph_ex."""
    return "1" if exe_mode in CAPTURED_GRAPH_MODES or platform_version == "950" else "2"


def default_group_expansion_mode(platform_version: str, name: str) -> int | None:
    """The 950 default group's hccl_op_expansion_mode from the device name (upper-cased, as the recipe reads it);
    None elsewhere: A2 / A3 set HCCL_OP_EXPANSION_MODE=AIV in the environment instead (executor/scripts/function.sh,
    set_hccl, for every platform but 950)."""
    if platform_version != "950":
        return None
    upper = name.upper()
    return next((code for model, code in DEFAULT_GROUP_EXPANSION_950.items() if model in upper), None)


class PlatformSettings:
    """What an NPU process sets for model_config.platform_version (A2 | A3 | 950), exe_mode and the device's name, in
    one place, before its process groups exist (`init_distributed` applies it; the start-up printout shows
    `describe()`), as the recipe sets them:

    - TASK_QUEUE_ENABLE (`task_queue_enable`): 1 for the captured graph modes or on a 950, else 2;
    - A2 / A3: HCCL_OP_EXPANSION_MODE=AIV in the environment (collectives expanded on the AI vector cores);
    - 950: no HCCL_OP_EXPANSION_MODE; the default group's hccl_config carries hccl_op_expansion_mode 5 on a 950DT and
      6 on a 950PR (`default_group_expansion_mode`, from the device name), nothing on another 950; a group given an
      hccl_buffer_size (the MC2 group's window) also exports it as HCCL_BUFFSIZE.

    device_name: None reads this host's (`npu_device_name()`, '' off the NPU); tests pass one. A variable the user's
    environment already sets wins. On CPU / CUDA nothing is applied."""

    def __init__(self, platform_version: str, exe_mode: str, device_name: str | None = None):
        from optimized.config import EXE_MODES, PLATFORM_VERSIONS

        if platform_version not in PLATFORM_VERSIONS:
            raise ValueError(f"platform_version {platform_version!r} is not one of {', '.join(PLATFORM_VERSIONS)}")
        if exe_mode not in EXE_MODES:
            raise ValueError(f"exe_mode {exe_mode!r} is not one of {', '.join(EXE_MODES)}")
        is_950 = platform_version == "950"
        if device_name is None:
            device_name = npu_device_name() if is_950 else ""
        self.platform_version, self.exe_mode, self.device_name = platform_version, exe_mode, device_name
        self.env = {"TASK_QUEUE_ENABLE": task_queue_enable(platform_version, exe_mode)}
        if not is_950:
            self.env["HCCL_OP_EXPANSION_MODE"] = "AIV"
        mode = default_group_expansion_mode(platform_version, device_name)
        self.default_group_hccl_config = {} if mode is None else {"hccl_op_expansion_mode": mode}
        self.mirror_buffer_size = is_950

    @classmethod
    def from_environment(cls, exe_mode: str = "eager") -> "PlatformSettings":
        """The settings for $PLATFORM_VERSION (default A3, the recipe's order) when no config names the platform."""
        return cls(envs.platform_version(), exe_mode)

    def __eq__(self, other) -> bool:
        return isinstance(other, PlatformSettings) and vars(self) == vars(other)

    def apply(self, backend: str | None = None) -> dict[str, str]:
        """Set the environment on an NPU (a variable already set is kept); returns what the process now has for
        each variable this platform sets ({} off the NPU). Remembered as the process's settings (`applied()`)."""
        global _APPLIED
        _APPLIED = self
        if (backend or backend_name()) != "npu":
            return {}
        return {name: envs.set_default(name, value) for name, value in self.env.items()}

    def hccl_config(self, hccl_buffer_size_mb: int | None = None, *, default_group: bool = False) -> dict:
        """A group's hccl_config: the default group's op expansion mode (950), its hccl_buffer_size if given (on 950
        also exported as HCCL_BUFFSIZE, unless the environment sets it)."""
        config = dict(self.default_group_hccl_config) if default_group else {}
        if hccl_buffer_size_mb is not None:
            config["hccl_buffer_size"] = int(hccl_buffer_size_mb)
            if self.mirror_buffer_size and backend_name() == "npu":
                envs.set_default("HCCL_BUFFSIZE", str(int(hccl_buffer_size_mb)))
        return config

    def group_options(self, backend: str, hccl_buffer_size_mb: int | None = None, *, default_group: bool = False):
        """ProcessGroupHCCL options holding `hccl_config(...)`; None off hccl or when there is nothing to set."""
        config = self.hccl_config(hccl_buffer_size_mb, default_group=default_group)
        if backend != "hccl" or not config:
            return None
        import torch_npu  # pragma: no cover - needs torch_npu

        options = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()
        options.hccl_config = config
        return options

    def describe(self) -> str:
        """One start-up line: what this platform and mode set."""
        env = ", ".join(f"{k}={v}" for k, v in self.env.items())
        group = (
            f"; default group hccl_config {self.default_group_hccl_config}" if self.default_group_hccl_config else ""
        )
        mirror = "; a group's hccl_buffer_size also as HCCL_BUFFSIZE" if self.mirror_buffer_size else ""
        where = "" if backend_name() == "npu" else f" (not applied: this host computes on {backend_name()})"
        named = f" ({self.device_name})" if self.device_name else ""
        return f"platform {self.platform_version}{named}, {self.exe_mode}: {env}{group}{mirror}{where}"


_APPLIED: PlatformSettings | None = None


def applied_settings() -> PlatformSettings:
    """The settings this process applied (init_distributed), else those of $PLATFORM_VERSION in eager mode."""
    return _APPLIED if _APPLIED is not None else PlatformSettings.from_environment()
