"""Latency budgets (optimized/benchmarks/budgets.yaml): the table, the skip rules, the floors and the verdicts.

Two kinds:
- `absolute`: a seed latency target on named NPU hardware (SoC name pattern, device count), measured by
  `python -m optimized latency` with one process per rank (torchrun; `optimized.benchmarks.budget_run`), beside the
  physical floor of `optimized.benchmarks.floor`. A budget skips, with a reason, where the hardware does not match;
  on matching hardware a budget that names a `checkpoint` kind fails when none is given (`missing_checkpoint`).
- `relative`: optimized vs reference in the same process and run, on this CPU: the optimized p50 may
  be at most `max_ratio` times the reference p50, per phase (a limit wide enough for a loaded machine).
Either kind fails a broken measurement (`broken_measurement`): a p50 below the phase's physical floor (a lost
device sync, an asynchronous replay timed as launched) or fewer samples than the budget's rounds produce.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from optimized import envs
from optimized.errors import UsageError

from optimized.benchmarks.common import DTYPES
from optimized.benchmarks.latency import CLOCKS, summarize
from optimized.model_loader.model_path import fixture_config
from optimized.model_loader.presets import preset_config

PHASES = ("prefill", "decode")
KINDS = ("absolute", "relative")
DEFAULT_BUDGETS = Path(__file__).with_name("budgets.yaml")  # package data
CHECKPOINT_ENV = envs.LATENCY_CHECKPOINT


# --------------------------------------------------------------------------------------------- budgets


class BudgetError(UsageError, ValueError):
    """A malformed budget file: names the budget and key."""


@dataclass(frozen=True)
class HardwareRule:
    """Where an absolute budget runs: an NPU whose SoC name matches `soc`, with >= `devices` devices
    (`soc: "*"`: any host, NPU or not; for test budgets)."""

    soc: str
    devices: int
    floor: str  # key of optimized.benchmarks.floor.HARDWARE
    name: str

    def mismatch(self, host: "Host") -> str | None:
        """Why `host` is not this hardware (the pytest skip's reason and the latency CLI's error), or None."""
        if self.soc == "*" or (
            host.backend == "npu" and fnmatch.fnmatch(host.soc, self.soc) and host.devices >= self.devices
        ):
            return None
        return (
            f"needs {self.name}: {self.devices} NPU devices with SoC name matching {self.soc!r} (torch_npu); "
            f"this host: {host.describe()}"
        )


@dataclass(frozen=True)
class Host:
    backend: str  # npu | cuda | cpu
    soc: str  # torch.npu.get_device_name(0) on NPU, else ""
    devices: int

    def describe(self) -> str:
        if self.backend == "npu":
            return f"{self.devices} NPU device(s), SoC {self.soc}"
        return f"backend {self.backend}, no NPU"


def this_host() -> Host:
    from optimized.platform import backend_name

    backend = backend_name()
    if backend == "npu":
        return Host("npu", torch.npu.get_device_name(0), torch.npu.device_count())
    return Host(backend, "", torch.cuda.device_count() if backend == "cuda" else 0)


@dataclass(frozen=True)
class Budget:
    name: str
    kind: str
    description: str
    model: dict  # preset / fixture, optional num_hidden_layers, vocab_size
    dtype: str = "bfloat16"
    precision: str = "bf16"  # optimized.benchmarks.floor.PRECISIONS key
    batch: int = 1
    prompt_len: int = 128  # prefill length; decode runs at this context and beyond
    decode_steps: int = 8
    warmup: int = 1
    repeats: int = 3
    seed: int = 0
    routing: str = "skewed"  # random weights: hot experts (budget_run.SKEWED_ROUTER)
    checkpoint: str | None = None  # absolute: kind of checkpoint it must measure (e.g. w4a8)
    limits_ms: dict = field(default_factory=dict)  # absolute: phase -> ms (p50 must not exceed)
    max_ratio: dict = field(default_factory=dict)  # relative: phase -> optimized p50 / reference p50
    why: str = ""  # relative: what justifies the ratios
    clock: str = "wall"  # relative: wall | thread_cpu (see CLOCKS)
    hardware: HardwareRule | None = None
    config: str | None = None  # absolute: inference config YAML (layout), repo-relative
    exe_mode: str = "eager"
    sp_prefill: bool = False

    @property
    def phases(self) -> list[str]:
        return list(self.limits_ms or self.max_ratio)

    def skip_reason(self, phase: str, host: Host) -> str | None:
        """Why this budget phase cannot be measured here, or None."""
        reasons = []
        if self.kind == "relative":
            if host.backend != "cpu":
                reasons.append(
                    f"a CPU relative budget (optimized vs reference on the CPU); this host computes on {host.backend}"
                )
        elif self.hardware.mismatch(host):
            reasons.append(self.hardware.mismatch(host))
        return " | ".join(reasons) or None

    def missing_checkpoint(self, given: str | None) -> str | None:
        """Why this budget cannot be measured without a checkpoint (random weights are not its kind), or None."""
        if self.checkpoint is None or given:
            return None
        return (
            f"budget {self.name} measures a {self.checkpoint} checkpoint: pass one with --latency-checkpoint "
            f"DIR (pytest), --model-path DIR (python -m optimized latency) or ${CHECKPOINT_ENV}"
            + (" (`python -m optimized convert --quant w4a8 SRC DST` makes one)" if self.checkpoint == "w4a8" else "")
        )

    def expected_samples(self, phase: str) -> int:
        """Samples one measurement yields: one prefill per timed round, `decode_steps` decodes per round."""
        return self.repeats * (self.decode_steps if phase == "decode" else 1)

    @property
    def world_size(self) -> int:
        return self.inference_config().parallel_config.world_size if self.config else 1

    def inference_config(self):
        from optimized.config import InferenceConfig

        path = Path(self.config)
        if not path.is_absolute():
            path = DEFAULT_BUDGETS.parent / path  # beside the budgets YAML (package data)
        return InferenceConfig.from_yaml(path)

    def hf_config(self):
        """The model's Qwen3MoeConfig: its preset or tiny fixture, with the budget's overrides."""
        spec = dict(self.model)
        if "preset" in spec:
            config = preset_config(spec.pop("preset"))
        else:
            config = fixture_config(spec.pop("fixture"), f"budget {self.name!r}")
        for key, value in spec.items():
            setattr(config, key, value)
        return config


_REQUIRED = {"kind", "description", "model"}
_ALLOWED = {f for f in Budget.__dataclass_fields__} - {"name"}


def load_budgets(path: str | os.PathLike | None = None) -> dict[str, Budget]:
    """Every budget of a budgets YAML (default optimized/benchmarks/budgets.yaml), validated with clear errors."""
    import yaml

    from optimized.config import load_yaml

    path = Path(path or DEFAULT_BUDGETS)
    try:
        raw = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as e:  # a syntax error or a repeated key: one line naming the file and the place
        raise BudgetError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("budgets"), dict):
        raise BudgetError(f"{path}: needs a top-level mapping 'budgets: {{NAME: {{...}}}}'")
    out = {}
    for name, spec in raw["budgets"].items():
        where = f"{path}: budgets.{name}"
        if not isinstance(spec, dict):
            raise BudgetError(f"{where}: must be a mapping")
        unknown = sorted(set(spec) - _ALLOWED)
        if unknown:
            raise BudgetError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_ALLOWED)}")
        missing = sorted(_REQUIRED - set(spec))
        if missing:
            raise BudgetError(f"{where}: missing key(s) {missing}")
        spec = dict(spec)
        if spec["kind"] not in KINDS:
            raise BudgetError(f"{where}.kind: must be one of {KINDS}, got {spec['kind']!r}")
        if spec.get("dtype", "bfloat16") not in DTYPES:
            raise BudgetError(f"{where}.dtype: must be one of {', '.join(DTYPES)}, got {spec['dtype']!r}")
        from optimized.benchmarks.floor import PRECISIONS

        if spec.get("precision", "bf16") not in PRECISIONS:
            raise BudgetError(f"{where}.precision: must be one of {', '.join(PRECISIONS)}, got {spec['precision']!r}")
        if spec.get("clock", "wall") not in CLOCKS:
            raise BudgetError(f"{where}.clock: must be one of {', '.join(CLOCKS)}, got {spec['clock']!r}")
        if spec.get("routing", "skewed") != "skewed":
            raise BudgetError(
                f"{where}.routing: must be 'skewed' (random weights route to hot experts; uniform "
                f"routing is the best case of expert parallelism), got {spec['routing']!r}"
            )
        key, other = ("limits_ms", "max_ratio") if spec["kind"] == "absolute" else ("max_ratio", "limits_ms")
        limits = spec.get(key)
        if other in spec:
            raise BudgetError(f"{where}.{other}: {spec['kind']} budgets have {key}, not {other}")
        if (
            not isinstance(limits, dict)
            or not limits
            or set(limits) - set(PHASES)
            or not all(isinstance(v, (int, float)) and v > 0 for v in limits.values())
        ):
            raise BudgetError(
                f"{where}.{key}: must map phases ({', '.join(PHASES)}) to positive numbers, got {limits!r}"
            )
        for counter in ("batch", "prompt_len", "decode_steps", "repeats"):
            if counter in spec and (not isinstance(spec[counter], int) or spec[counter] < 1):
                raise BudgetError(f"{where}.{counter}: must be a positive integer, got {spec[counter]!r}")
        if not isinstance(spec.get("warmup", 1), int) or spec.get("warmup", 1) < 0:
            raise BudgetError(f"{where}.warmup: must be a non-negative integer, got {spec['warmup']!r}")
        if spec.get("checkpoint") not in (None, "w4a8", "bf16"):
            raise BudgetError(
                f"{where}.checkpoint: must be w4a8 or bf16 (the kind it must measure), got {spec['checkpoint']!r}"
            )
        if spec["kind"] == "absolute":
            for k in ("hardware", "config"):
                if k not in spec:
                    raise BudgetError(f"{where}: an absolute budget needs '{k}'")
            hw = spec["hardware"]
            if set(hw) != {"soc", "devices", "floor", "name"}:
                raise BudgetError(f"{where}.hardware: needs exactly soc, devices, floor, name; got {sorted(hw)}")
            from optimized.benchmarks.floor import HARDWARE

            if hw["floor"] not in HARDWARE:
                raise BudgetError(f"{where}.hardware.floor: unknown {hw['floor']!r}; known: {sorted(HARDWARE)}")
            spec["hardware"] = HardwareRule(**hw)
        out[name] = Budget(name=name, **spec)
    return out


# ------------------------------------------------------------------------------------------------ floors


def budget_floor(budget: Budget, phase: str, collective_latency: float | None = None) -> dict:
    """The physical floor of one absolute budget phase (optimized.benchmarks.floor), in seconds with its parts."""
    from optimized.benchmarks import floor

    config = budget.hf_config()
    layout = floor.Layout.of(budget.inference_config().parallel_config)
    hw = floor.HARDWARE[budget.hardware.floor]
    if phase == "prefill":
        return floor.prefill_floor(
            config, hw, budget.precision, [budget.prompt_len] * budget.batch, layout, sp=budget.sp_prefill
        )
    context = budget.prompt_len + (budget.decode_steps + 1) / 2  # mean context of the timed steps
    return floor.decode_floor(
        config, hw, budget.precision, budget.batch, context, layout, collective_latency=collective_latency
    )


def broken_measurement(budget: Budget, phase: str, stats: dict, floor_ms: float | None, who: str = "") -> str | None:
    """Why these samples cannot be a measurement of the phase, or None: fewer samples than the budget's rounds
    produce, or a p50 below the physical floor (work that was not waited for: a lost sync, an async replay)."""
    label = f"{who} " if who else ""
    want = budget.expected_samples(phase)
    if stats["n"] < want:
        return (
            f"broken measurement: {label}{phase} has {stats['n']} samples, the budget's {budget.repeats} rounds "
            f"make {want}"
        )
    if floor_ms is not None and stats["p50"] < floor_ms:
        return (
            f"broken measurement: {label}{phase} p50 {stats['p50']:.3f} ms is below the physical floor "
            f"{floor_ms:.3f} ms (the timed work was not waited for: a lost device sync or an asynchronous replay)"
        )
    return None


def phase_report(
    budget: Budget,
    phase: str,
    seconds: list[float],
    floor_s: float | None = None,
    reference_seconds: list[float] | None = None,
) -> dict:
    """Statistics, limit and verdict of one budget phase (what the JSON report records). A broken measurement
    (`broken_measurement`) fails whatever the limit says; `floor_s` bounds the optimized and reference p50."""
    stats = summarize(seconds)
    floor_ms = None if floor_s is None else 1000 * floor_s
    report = {
        "budget": budget.name,
        "phase": phase,
        "kind": budget.kind,
        "description": budget.description,
        "ms": stats,
    }
    if floor_ms is not None:
        report["floor_ms"] = floor_ms
        report["p50_over_floor"] = stats["p50"] / floor_ms
    broken = [broken_measurement(budget, phase, stats, floor_ms, "optimized" if reference_seconds else "")]
    if budget.kind == "absolute":
        report["limit_ms"] = budget.limits_ms[phase]
        within = stats["p50"] <= budget.limits_ms[phase]
    else:
        ref = summarize(reference_seconds)
        broken.append(broken_measurement(budget, phase, ref, floor_ms, "reference"))
        report["reference_ms"] = ref
        report["ratio_p50"] = stats["p50"] / ref["p50"]
        report["max_ratio"] = budget.max_ratio[phase]
        within = report["ratio_p50"] <= budget.max_ratio[phase]
        report["why"], report["clock"] = budget.why, budget.clock
    report["broken"] = "; ".join(b for b in broken if b) or None
    report["passed"] = within and report["broken"] is None
    return report
