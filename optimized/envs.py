"""Every environment variable the package reads or sets, in one table, with one typed accessor each.

No other module of `optimized` touches `os.environ` (tests/test_envs.py checks it): they call the accessors below,
which read the environment at every call (a test's monkeypatch takes effect at once), treat an empty value as
unset, and refuse a value they cannot use with one `EnvError` (a `UsageError`, and a `ValueError` for library
callers) naming the variable, the value and what is allowed:

    environment variable NPU_GOLDEN_SOC='910'; allowed: 'a2a3', '950'

(torchrun's WORLD_SIZE / RANK / LOCAL_RANK keep the launch's wording, `LaunchEnvError`, also a RuntimeError.)

`READ` is the table of the variables read (name, type, default, meaning, readers); `WRITTEN` those the package sets
for the NPU runtime (never overriding the user's value: `set_default`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from optimized.errors import UsageError


class EnvError(UsageError, ValueError):
    """An environment variable whose value cannot be used: names the variable, the value and what is allowed."""

    def __init__(self, name: str, value: str, allowed: str, message: str | None = None):
        self.name, self.value, self.allowed = name, value, allowed
        super().__init__(message or f"environment variable {name}={value!r}; allowed: {allowed}")


class LaunchEnvError(EnvError, RuntimeError):
    """A bad WORLD_SIZE / RANK / LOCAL_RANK (torchrun's variables): also a RuntimeError, like the launch's other errors
    (distributed/parallel_state.py's LaunchError), worded as they always were:

        environment variable RANK must be an integer >= 0, got 'x' (torchrun sets it)
    """

    def __init__(self, name: str, value: str, allowed: str):
        super().__init__(
            name, value, allowed, f"environment variable {name} must be {allowed}, got {value!r} (torchrun sets it)"
        )


@dataclass(frozen=True)
class Variable:
    name: str
    type: str  # what the accessor returns
    default: str  # what an unset (or empty) variable means
    meaning: str
    readers: str  # who reads it


# ------------------------------------------------------------------------------------------------- the table

WORLD_SIZE, RANK, LOCAL_RANK = "WORLD_SIZE", "RANK", "LOCAL_RANK"
MASTER_ADDR, MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
COLLECTIVE_TIMEOUT_S = "QWEN3_MOE_COLLECTIVE_TIMEOUT_S"
PLATFORM_VERSION = "PLATFORM_VERSION"
FORCE_PORTABLE = "QWEN3_MOE_FORCE_PORTABLE"
CPU_PREPACK = "QWEN3_MOE_CPU_PREPACK"
STRICT_NPU_LIMITS = "QWEN3_MOE_STRICT_NPU_LIMITS"
NPU_GOLDEN_SOC = "NPU_GOLDEN_SOC"
PRESET_CACHE = "QWEN3_MOE_PRESET_CACHE"
COMPILE_CACHE_KEY = "QWEN3_MOE_COMPILE_CACHE_KEY"
CASE_NAME = "CASE_NAME"
LATENCY_CHECKPOINT = "QWEN3_MOE_LATENCY_CHECKPOINT"

READ: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable(
            WORLD_SIZE,
            "int >= 1 | None",
            "unset: a single process",
            "the job's number of processes (torchrun sets it); must equal parallel_config.world_size",
            "executor/assembly.py (launch check), distributed/parallel_state.py (init_distributed, ParallelState)",
        ),
        Variable(
            RANK,
            "int >= 0 | None",
            "unset: rank 0 of a single process",
            "this process's rank (torchrun sets it); required when WORLD_SIZE > 1; only rank 0 prints start-up lines",
            "distributed/parallel_state.py (init_distributed), executor/assembly.py (say)",
        ),
        Variable(
            LOCAL_RANK,
            "int >= 0 | None",
            "unset: the rank",
            "this process's device index on its host (torchrun sets it)",
            "distributed/parallel_state.py (init_distributed), benchmarks/latency.py",
        ),
        Variable(
            MASTER_ADDR,
            "str | None",
            "unset: an error when WORLD_SIZE > 1",
            "host of the job's rendezvous store (torchrun sets it)",
            "distributed/parallel_state.py",
        ),
        Variable(
            MASTER_PORT,
            "str | None",
            "unset: an error when WORLD_SIZE > 1",
            "port of the job's rendezvous store (torchrun sets it)",
            "distributed/parallel_state.py",
        ),
        Variable(
            TORCHELASTIC_USE_AGENT_STORE,
            "bool ('True' | 'False')",
            "False",
            "torchrun's agent hosts the store (rank 0 does not): only changes a rendezvous timeout's explanation",
            "distributed/parallel_state.py",
        ),
        Variable(
            COLLECTIVE_TIMEOUT_S,
            "float > 0 | None",
            "unset: parallel_config.collective_timeout_s (120 s)",
            "overrides how long a collective or the rendezvous may wait before failing, naming the rank",
            "distributed/guard.py, executor/assembly.py",
        ),
        Variable(
            PLATFORM_VERSION,
            "'A2' | 'A3' | '950'",
            "A3",
            "the NPU generation when model_config.platform_version is not set (per-platform runtime settings)",
            "config.py (ModelConfig.platform), platform.py (PlatformSettings.from_environment)",
        ),
        Variable(
            FORCE_PORTABLE,
            "bool ('0' | '1')",
            "0",
            "1: ignore an installed torch_npu and run the portable kernels",
            "platform.py",
        ),
        Variable(
            CPU_PREPACK,
            "bool ('0' | '1')",
            "1",
            "0: plain F.linear on CPU, no oneDNN-packed bf16 weight copies (half the CPU weight memory); read at "
            "import",
            "ops/cpu_gemm.py",
        ),
        Variable(
            STRICT_NPU_LIMITS,
            "'0' | '1' | 'route'",
            "0",
            "which NPU operator caps the portable kernels enforce: 0 none, 1 all, route only the route caps",
            "ops/validation.py",
        ),
        Variable(
            NPU_GOLDEN_SOC,
            "'a2a3' | '950'",
            "a2a3",
            "whose rounding the portable norm kernels reproduce: Atlas A2/A3 or Ascend 950",
            "ops/validation.py",
        ),
        Variable(
            PRESET_CACHE,
            "path",
            "~/.cache/qwen3-moe-npu/presets",
            "where model_path preset:NAME writes its config.json",
            "model_loader/model_path.py",
        ),
        Variable(
            COMPILE_CACHE_KEY,
            "path",
            "~/.config/qwen3-moe-npu/compile_cache.key",
            "the per-user key that authenticates compile cache entries",
            "executor/compile_cache.py",
        ),
        Variable(
            CASE_NAME,
            "plain directory name | None",
            "unset: derived from the config (model-dtype-layout-exe_mode)",
            "the compile cache's case directory ./compile_cache/<CASE_NAME>",
            "executor/assembly.py",
        ),
        Variable(
            LATENCY_CHECKPOINT,
            "path | None",
            "unset: --model-path, else random weights where the budget allows",
            "the checkpoint `python -m optimized latency` measures",
            "benchmarks/budget_run.py",
        ),
    )
}

# Set (`set_default`: the user's own value wins) for the NPU runtime before the process groups exist; NPU only.
WRITTEN: dict[str, str] = {
    "TASK_QUEUE_ENABLE": "1 for npugraph_ex / acl_graph or on a 950, else 2 (the recipe's table: platform.py)",
    "HCCL_OP_EXPANSION_MODE": "AIV on A2 / A3: collectives expanded on the AI vector cores (platform.py, "
    "distributed/parallel_state.py)",
    "HCCL_BUFFSIZE": "on 950, the MC2 group's window in MB (platform.py)",
}


# ----------------------------------------------------------------------------------------------- raw access


def _raw(name: str) -> str | None:
    """The variable's value, None when unset or empty; only variables of the table."""
    if name not in READ:
        raise KeyError(f"{name} is not in optimized.envs.READ: add it to the table first")
    value = os.environ.get(name)
    return value if value else None


def _launch_int(name: str, minimum: int) -> int | None:
    raw = _raw(name)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise LaunchEnvError(name, raw, f"an integer >= {minimum}")
    return value


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = _raw(name)
    if raw is None:
        return default
    if raw not in choices:
        raise EnvError(name, raw, ", ".join(map(repr, choices)))
    return raw


def _flag(name: str, default: bool) -> bool:
    return _choice(name, "1" if default else "0", ("0", "1")) == "1"


def _path(name: str, default: Path) -> Path:
    raw = _raw(name)
    return Path(raw).expanduser() if raw is not None else default


def set_default(name: str, value: str) -> str:
    """Set `name` for the NPU runtime unless the environment already has it; returns the value now in effect."""
    if name not in WRITTEN:
        raise KeyError(f"{name} is not in optimized.envs.WRITTEN: add it to the table first")
    return os.environ.setdefault(name, value)


# ------------------------------------------------------------------------------------------------ accessors
# The launch (torchrun)


def world_size() -> int | None:
    """WORLD_SIZE (None: unset, a single process)."""
    return _launch_int(WORLD_SIZE, 1)


def rank() -> int | None:
    """RANK (None: unset)."""
    return _launch_int(RANK, 0)


def local_rank() -> int | None:
    """LOCAL_RANK (None: unset)."""
    return _launch_int(LOCAL_RANK, 0)


def master_addr() -> str | None:
    return _raw(MASTER_ADDR)


def master_port() -> str | None:
    return _raw(MASTER_PORT)


def torchelastic_agent_store() -> bool:
    """TORCHELASTIC_USE_AGENT_STORE == 'True' (torchrun's agent hosts the rendezvous store)."""
    return _choice(TORCHELASTIC_USE_AGENT_STORE, "False", ("True", "False")) == "True"


def collective_timeout_s() -> float | None:
    """QWEN3_MOE_COLLECTIVE_TIMEOUT_S in seconds (None: unset, the config's collective_timeout_s applies)."""
    raw = _raw(COLLECTIVE_TIMEOUT_S)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise EnvError(COLLECTIVE_TIMEOUT_S, raw, "a positive number of seconds")
    return value


# The platform and the kernels

PLATFORM_VERSIONS = ("A2", "A3", "950")  # the recipe's platform_version values (config.py's too)


def platform_version() -> str:
    """PLATFORM_VERSION (default A3): the NPU generation when the config names none."""
    return _choice(PLATFORM_VERSION, "A3", PLATFORM_VERSIONS)


def force_portable() -> bool:
    """QWEN3_MOE_FORCE_PORTABLE=1: ignore torch_npu, use the portable kernels."""
    return _flag(FORCE_PORTABLE, False)


def cpu_prepack() -> bool:
    """QWEN3_MOE_CPU_PREPACK (default 1): oneDNN-packed bf16 weights on CPU; 0: plain F.linear."""
    return _flag(CPU_PREPACK, True)


STRICT_LEVELS = ("0", "1", "route")


def strict_npu_limits() -> str:
    """QWEN3_MOE_STRICT_NPU_LIMITS: '0' (default), '1' or 'route' (ops/validation.py maps it to the caps)."""
    return _choice(STRICT_NPU_LIMITS, "0", STRICT_LEVELS)


def npu_golden_soc() -> str:
    """NPU_GOLDEN_SOC: 'a2a3' (default) or '950'."""
    return _choice(NPU_GOLDEN_SOC, "a2a3", ("a2a3", "950"))


# Files


def preset_cache() -> Path:
    return _path(PRESET_CACHE, Path.home() / ".cache" / "qwen3-moe-npu" / "presets")


def compile_cache_key() -> Path:
    return _path(COMPILE_CACHE_KEY, Path.home() / ".config" / "qwen3-moe-npu" / "compile_cache.key")


def case_name() -> str | None:
    """CASE_NAME (None: unset); executor/assembly.py checks it is a plain directory name (compile_cache's rule)."""
    return _raw(CASE_NAME)


def latency_checkpoint() -> str | None:
    return _raw(LATENCY_CHECKPOINT)
