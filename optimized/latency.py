"""Latency budgets: the measuring harness, the budget table, and the per-rank run behind `pytest -m latency`.

Harness: `measure` times a callable with warm-up, a device sync around every sample and an injectable
clock; `interleave` runs several workloads round by round (so a change of background load hits all of
them alike); `summarize` gives p50 / p90 / p99 (nearest rank), min, max and mean in milliseconds.

Budgets (fixtures/budgets.yaml, loaded by `load_budgets`) are of two kinds:
- `absolute`: a seed latency target on named NPU hardware (SoC name pattern, device count), measured by
  `python -m optimized latency` with one process per rank (torchrun), beside the physical floor of
  `optimized.floor`. A budget skips, with a reason, where the hardware does not match or a feature it
  needs is not built yet (`FEATURES`): it never passes without being measured.
- `relative`: optimized vs reference in the same process and run, on this CPU: the optimized p50 may
  be at most `max_ratio` times the reference p50, per phase.
"""
from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

PHASES = ("prefill", "decode")
# wall: elapsed time (what a user waits). thread_cpu: CPU time of the calling thread, i.e. the work one
# step does with torch on one thread, unaffected by other processes preempting it on a shared machine.
CLOCKS = {"wall": time.perf_counter, "thread_cpu": time.thread_time}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
KINDS = ("absolute", "relative")
DEFAULT_BUDGETS = Path(__file__).resolve().parents[1] / "fixtures" / "budgets.yaml"
CHECKPOINT_ENV = "QWEN3_MOE_LATENCY_CHECKPOINT"


# ------------------------------------------------------------------------------------------ statistics

def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 100]): the smallest sample with at least q% of them <= it."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 < q <= 100:
        raise ValueError(f"percentile q must be in (0, 100], got {q}")
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(seconds: list[float]) -> dict:
    """p50 / p90 / p99 / min / max / mean in milliseconds, and the sample count."""
    ms = [1000 * s for s in seconds]
    return {"p50": percentile(ms, 50), "p90": percentile(ms, 90), "p99": percentile(ms, 99),
            "min": min(ms), "max": max(ms), "mean": statistics.fmean(ms), "n": len(ms)}


def measure(fn: Callable[[], object], *, warmup: int, repeats: int, sync: Callable[[], None] = lambda: None,
            clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds per call of `fn`: `warmup` discarded calls, then `repeats` timed ones, each between two syncs
    (the device finishes earlier work before the clock starts, and this call's work before it stops)."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    for _ in range(warmup):
        fn()
        sync()
    samples = []
    for _ in range(repeats):
        sync()
        start = clock()
        fn()
        sync()
        samples.append(clock() - start)
    return samples


def interleave(workloads: dict[str, Callable[[], dict[str, list[float]]]], *, warmup: int,
               repeats: int) -> dict[str, dict[str, list[float]]]:
    """Run every workload once per round, `warmup` discarded rounds then `repeats` timed ones.

    A workload returns its own samples per phase ({"prefill": [s], "decode": [s, s, ...]}); the timed
    rounds' samples are concatenated per workload and phase.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    out: dict[str, dict[str, list[float]]] = {name: {} for name in workloads}
    for r in range(warmup + repeats):
        for name, fn in workloads.items():
            samples = fn()
            if r >= warmup:
                for phase, values in samples.items():
                    out[name].setdefault(phase, []).extend(values)
    return out


# --------------------------------------------------------------------------------------------- budgets

class BudgetError(ValueError):
    """A malformed budget file: names the budget and key."""


@dataclass(frozen=True)
class HardwareRule:
    """Where an absolute budget runs: an NPU whose SoC name matches `soc`, with >= `devices` devices."""

    soc: str
    devices: int
    floor: str            # key of optimized.floor.HARDWARE
    name: str


@dataclass(frozen=True)
class Host:
    backend: str          # npu | cuda | cpu
    soc: str              # torch.npu.get_device_name(0) on NPU, else ""
    devices: int

    def describe(self) -> str:
        if self.backend == "npu":
            return f"{self.devices} NPU device(s), SoC {self.soc}"
        return f"backend {self.backend}, no NPU"


def this_host() -> Host:
    from .platform import backend_name
    backend = backend_name()
    if backend == "npu":
        return Host("npu", torch.npu.get_device_name(0), torch.npu.device_count())
    return Host(backend, "", torch.cuda.device_count() if backend == "cuda" else 0)


def _graph_mode_built() -> bool:
    from .config import EXE_MODES
    return "ge_graph" in EXE_MODES


def _w4a8_built() -> bool:
    return importlib.util.find_spec("optimized.quantize") is not None


def _sp_prefill_built() -> bool:
    from .config import ParallelConfig
    return "moe_ep_scheme" in ParallelConfig.__dataclass_fields__


# Features a budget may need, each with the probe that says whether this tree has it. A probe checks the
# entry point the feature is reached through (as named in the issue that builds it).
FEATURES: dict[str, tuple[str, Callable[[], bool]]] = {
    "graph_mode": ("graph mode (model_config.exe_mode: ge_graph; optimized.config accepts eager only)",
                   _graph_mode_built),
    "w4a8": ("W4A8 quantization (MXFP4 experts, MXFP8 attention; the optimized.quantize converter)", _w4a8_built),
    "sp_prefill": ("Attention SP+TP prefill with MoE EP by AllGather (parallel_config.moe_ep_scheme)",
                   _sp_prefill_built),
}


def missing_features(names) -> list[str]:
    return [FEATURES[n][0] for n in names if not FEATURES[n][1]()]


@dataclass(frozen=True)
class Budget:
    name: str
    kind: str
    description: str
    model: dict                              # preset / fixture, optional num_hidden_layers, vocab_size
    dtype: str = "bfloat16"
    precision: str = "bf16"                  # optimized.floor.PRECISIONS key
    batch: int = 1
    prompt_len: int = 128                    # prefill length; decode runs at this context and beyond
    decode_steps: int = 8
    warmup: int = 1
    repeats: int = 3
    seed: int = 0
    routing: str = "real"
    limits_ms: dict = field(default_factory=dict)      # absolute: phase -> ms (p50 must not exceed)
    max_ratio: dict = field(default_factory=dict)      # relative: phase -> optimized p50 / reference p50
    why: str = ""                                      # relative: what justifies the ratios
    clock: str = "wall"                                # relative: wall | thread_cpu (see CLOCKS)
    needs: dict = field(default_factory=dict)          # phase -> feature names (absolute)
    hardware: HardwareRule | None = None
    config: str | None = None                # absolute: inference config YAML (layout), repo-relative
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
                reasons.append(f"a CPU relative budget (optimized vs reference on the CPU); this host computes "
                               f"on {host.backend}")
        else:
            hw = self.hardware
            if host.backend != "npu" or not fnmatch.fnmatch(host.soc, hw.soc) or host.devices < hw.devices:
                reasons.append(f"needs {hw.name}: {hw.devices} NPU devices with SoC name matching {hw.soc!r} "
                               f"(torch_npu); this host: {host.describe()}")
        missing = missing_features(self.needs.get(phase, []))
        if missing:
            reasons.append("not built yet: " + "; ".join(missing))
        return " | ".join(reasons) or None

    @property
    def world_size(self) -> int:
        return self.inference_config().parallel_config.world_size if self.config else 1

    def inference_config(self):
        from .config import InferenceConfig
        path = Path(self.config)
        if not path.is_absolute():
            path = DEFAULT_BUDGETS.parents[1] / path
        return InferenceConfig.from_yaml(path)

    def hf_config(self):
        """The model's Qwen3MoeConfig: its preset or tiny fixture, with the budget's overrides."""
        spec = dict(self.model)
        if "preset" in spec:
            from fixtures.presets import preset_config
            config = preset_config(spec.pop("preset"))
        else:
            from fixtures.tiny import tiny_config
            config = tiny_config(spec.pop("fixture"))
        for key, value in spec.items():
            setattr(config, key, value)
        return config


_REQUIRED = {"kind", "description", "model"}
_ALLOWED = {f for f in Budget.__dataclass_fields__} - {"name"}


def load_budgets(path: str | os.PathLike | None = None) -> dict[str, Budget]:
    """Every budget of a budgets YAML (default fixtures/budgets.yaml), validated with clear errors."""
    import yaml
    path = Path(path or DEFAULT_BUDGETS)
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw.get("budgets"), dict):
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
        from .floor import PRECISIONS
        if spec.get("precision", "bf16") not in PRECISIONS:
            raise BudgetError(f"{where}.precision: must be one of {', '.join(PRECISIONS)}, got {spec['precision']!r}")
        if spec.get("clock", "wall") not in CLOCKS:
            raise BudgetError(f"{where}.clock: must be one of {', '.join(CLOCKS)}, got {spec['clock']!r}")
        if spec.get("routing", "real") != "real":
            raise BudgetError(f"{where}.routing: must be 'real' (the router decides; balanced routing is never "
                              f"forced), got {spec['routing']!r}")
        key, other = ("limits_ms", "max_ratio") if spec["kind"] == "absolute" else ("max_ratio", "limits_ms")
        limits = spec.get(key)
        if other in spec:
            raise BudgetError(f"{where}.{other}: {spec['kind']} budgets have {key}, not {other}")
        if (not isinstance(limits, dict) or not limits or set(limits) - set(PHASES)
                or not all(isinstance(v, (int, float)) and v > 0 for v in limits.values())):
            raise BudgetError(f"{where}.{key}: must map phases ({', '.join(PHASES)}) to positive numbers, "
                              f"got {limits!r}")
        for counter in ("batch", "prompt_len", "decode_steps", "repeats"):
            if counter in spec and (not isinstance(spec[counter], int) or spec[counter] < 1):
                raise BudgetError(f"{where}.{counter}: must be a positive integer, got {spec[counter]!r}")
        if not isinstance(spec.get("warmup", 1), int) or spec.get("warmup", 1) < 0:
            raise BudgetError(f"{where}.warmup: must be a non-negative integer, got {spec['warmup']!r}")
        for feature in (f for names in spec.get("needs", {}).values() for f in names):
            if feature not in FEATURES:
                raise BudgetError(f"{where}.needs: unknown feature {feature!r}; known: {sorted(FEATURES)}")
        if spec["kind"] == "absolute":
            for k in ("hardware", "config"):
                if k not in spec:
                    raise BudgetError(f"{where}: an absolute budget needs '{k}'")
            hw = spec["hardware"]
            if set(hw) != {"soc", "devices", "floor", "name"}:
                raise BudgetError(f"{where}.hardware: needs exactly soc, devices, floor, name; got {sorted(hw)}")
            from .floor import HARDWARE
            if hw["floor"] not in HARDWARE:
                raise BudgetError(f"{where}.hardware.floor: unknown {hw['floor']!r}; known: {sorted(HARDWARE)}")
            spec["hardware"] = HardwareRule(**hw)
        out[name] = Budget(name=name, **spec)
    return out


# ------------------------------------------------------------------------------------------------ floors

def budget_floor(budget: Budget, phase: str, collective_latency: float | None = None) -> dict:
    """The physical floor of one absolute budget phase (optimized.floor), in seconds with its parts."""
    from . import floor
    config = budget.hf_config()
    layout = floor.Layout.of(budget.inference_config().parallel_config)
    hw = floor.HARDWARE[budget.hardware.floor]
    if phase == "prefill":
        return floor.prefill_floor(config, hw, budget.precision, [budget.prompt_len] * budget.batch, layout,
                                   sp=budget.sp_prefill)
    context = budget.prompt_len + (budget.decode_steps + 1) / 2      # mean context of the timed steps
    return floor.decode_floor(config, hw, budget.precision, budget.batch, context, layout,
                              collective_latency=collective_latency)


def phase_report(budget: Budget, phase: str, seconds: list[float], floor_s: float | None = None,
                 reference_seconds: list[float] | None = None) -> dict:
    """Statistics, limit and verdict of one budget phase (what the JSON report records)."""
    stats = summarize(seconds)
    report = {"budget": budget.name, "phase": phase, "kind": budget.kind, "description": budget.description,
              "ms": stats}
    if budget.kind == "absolute":
        report["limit_ms"] = budget.limits_ms[phase]
        report["passed"] = stats["p50"] <= budget.limits_ms[phase]
        if floor_s is not None:
            report["floor_ms"] = 1000 * floor_s
            report["p50_over_floor"] = stats["p50"] / (1000 * floor_s)
    else:
        ref = summarize(reference_seconds)
        report["reference_ms"] = ref
        report["ratio_p50"] = stats["p50"] / ref["p50"]
        report["max_ratio"] = budget.max_ratio[phase]
        report["passed"] = report["ratio_p50"] <= budget.max_ratio[phase]
        report["why"], report["clock"] = budget.why, budget.clock
    return report


# ----------------------------------------------------------------------------------------- model building

class PooledRandomWeights:
    """A weight source of the real shapes filled cheaply: tensor `name` is the stretch of one seeded
    N(0, std) pool repeated end to end that starts at an offset seeded by the name, so building a 30B-shaped
    layer costs copies, not a billion random draws. A slice reads the same values as the whole tensor at
    those positions (every rank and every layout sees one model). Each tensor owns its memory (timings
    read real bytes); norm weights are 1. Routing stays real: router weights and inputs are random."""

    def __init__(self, seed: int = 0, std: float = 0.02, pool: int = (1 << 22) + 1):
        gen = torch.Generator().manual_seed(seed)
        self.pool = torch.randn(pool, generator=gen) * std
        self.seed, self.used, self.bytes_read = seed, set(), 0

    def _stretch(self, start: int, n: int) -> torch.Tensor:
        """Elements [start, start + n) of the pool repeated end to end (a new tensor)."""
        P, out, filled = self.pool.numel(), torch.empty(n), 0
        while filled < n:
            at = (start + filled) % P
            take = min(P - at, n - filled)
            out[filled:filled + take] = self.pool[at:at + take]
            filled += take
        return out

    def read(self, name: str, expected_shape: tuple[int, ...], index: tuple = ()) -> torch.Tensor:
        from .loader import _sliced_shape
        shape = tuple(expected_shape)
        self.used.add(name)
        if name.endswith("norm.weight"):
            return torch.ones(_sliced_shape(shape, index))
        start = zlib.crc32(f"{self.seed}:{name}".encode()) % self.pool.numel()
        rows = index[0] if index else slice(None)
        first, stop, step = rows.indices(shape[0])
        if step != 1:
            raise ValueError(f"{name}: only unit-step slices are supported, got {rows!r}")
        row = math.prod(shape[1:])
        t = self._stretch(start + first * row, (stop - first) * row).view(stop - first, *shape[1:])
        return t[(slice(None),) + tuple(index[1:])].clone() if len(index) > 1 else t

    def skip(self, name: str) -> None:
        pass

    def check_all_used(self) -> None:
        pass


def reference_and_optimized(config, dtype: torch.dtype, seed: int = 0, block_size: int = 128):
    """The reference model and an optimized ModelRunner (one process) computing the same function: the
    optimized model loads pooled random weights, the reference's experts are views of its expert storage
    (the recipe stores each expert's rows as the checkpoint does, so the views are contiguous) and its other
    weights are the same pooled values. One copy of the experts keeps a 30B-shaped layer cheap to build."""
    from reference.model import Qwen3MoeForCausalLM as Reference

    from .build import model_from_source
    from .runner import ModelRunner

    source = PooledRandomWeights(seed)
    opt = model_from_source(config, source, dtype=dtype)
    with torch.device("meta"):
        ref = Reference(config)
    weights = {}
    for name, t in ref.state_dict().items():
        if ".mlp.experts." in name:    # model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
            parts = name.split(".")
            experts, e, proj = opt.layers[int(parts[2])].mlp.experts, int(parts[5]), parts[6]
            i = experts.inter_per_rank
            w = {"gate_proj": experts.w13[e, :, :i], "up_proj": experts.w13[e, :, i:],
                 "down_proj": experts.w2[e]}[proj].t()
            assert w.is_contiguous() and w.shape == t.shape, name
            weights[name] = w
        else:
            weights[name] = source.read(name, tuple(t.shape)).to(dtype)
    ref.load_state_dict(weights, strict=True, assign=True)
    return ref.eval(), ModelRunner(opt, block_size)


def copy_bandwidth(clock: Callable[[], float] = time.perf_counter, nbytes: int = 128 * 2**20) -> float:
    """Bytes moved per second (read + write) by a large tensor copy on this CPU, median of 3, timed by `clock`."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / statistics.median(measure(lambda: dst.copy_(src), warmup=1, repeats=3, clock=clock))


def random_prompts(budget: Budget, vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(budget.seed)
    return torch.randint(0, vocab_size, (budget.batch, budget.prompt_len), generator=gen).tolist()


def generation_samples(runner, prompts: list[list[int]], decode_steps: int) -> dict[str, list[float]]:
    """One prefill and `decode_steps` decode steps of the optimized runner (it syncs the device per phase)."""
    result = runner.generate(prompts, decode_steps + 1)
    return {"prefill": [result.prefill_seconds], "decode": list(result.decode_seconds)}


@torch.no_grad()
def reference_samples(model, prompts: list[list[int]], decode_steps: int,
                      clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """The same for the reference model (its own contiguous KV cache, CPU only), timed as the runner times."""
    ids = torch.tensor(prompts)
    cache = model.new_cache()
    start = clock()
    token = model(ids, cache)[:, -1].argmax(-1, keepdim=True)
    prefill, decode = clock() - start, []
    for _ in range(decode_steps):
        start = clock()
        token = model(token, cache)[:, -1].argmax(-1, keepdim=True)
        decode.append(clock() - start)
    return {"prefill": [prefill], "decode": decode}


def run_relative(budget: Budget) -> dict[str, dict]:
    """Measure a relative budget on this CPU: {phase: phase_report}. Thread CPU time counts only the
    calling thread, so torch runs single-threaded for it."""
    if budget.clock == "thread_cpu" and torch.get_num_threads() != 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run_relative(budget)
        finally:
            torch.set_num_threads(threads)
    dtype = DTYPES[budget.dtype]
    config = budget.hf_config()
    ref, runner = reference_and_optimized(config, dtype, budget.seed)
    prompts = random_prompts(budget, config.vocab_size)
    clock = runner.clock = CLOCKS[budget.clock]
    samples = interleave({"reference": lambda: reference_samples(ref, prompts, budget.decode_steps, clock),
                          "optimized": lambda: generation_samples(runner, prompts, budget.decode_steps)},
                         warmup=budget.warmup, repeats=budget.repeats)
    reports = {phase: phase_report(budget, phase, samples["optimized"][phase],
                                   reference_seconds=samples["reference"][phase]) for phase in budget.phases}
    if "decode" in reports:   # for scale: the CPU memory floor at the bandwidth of a copy measured now
        from .floor import cpu_hardware, decode_floor
        context = budget.prompt_len + (budget.decode_steps + 1) / 2
        bandwidth = copy_bandwidth(clock)
        floor_s = decode_floor(config, cpu_hardware(bandwidth), dtype, budget.batch, context)["floor_s"]
        reports["decode"].update(copy_bandwidth_gb_s=bandwidth / 1e9, floor_ms=1000 * floor_s,
                                 p50_over_floor=reports["decode"]["ms"]["p50"] / (1000 * floor_s))
    return reports


# ---------------------------------------------------------------------------------- NPU: one process per rank

def launch_command(budget: Budget, json_path: str | os.PathLike, budgets_path: str | os.PathLike | None = None,
                   model_path: str | None = None) -> list[str]:
    """torchrun (torch.distributed.run) over `python -m optimized latency`, one process per rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(budget.world_size), "-m", "optimized", "latency", "--budget", budget.name,
           "--budgets", str(budgets_path or DEFAULT_BUDGETS), "--json", str(json_path)]
    return cmd + (["--model-path", model_path] if model_path else [])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", required=True, help="budget name in the budgets file")
    p.add_argument("--budgets", default=str(DEFAULT_BUDGETS), help="budgets YAML (default fixtures/budgets.yaml)")
    p.add_argument("--model-path", help=f"checkpoint directory (else ${CHECKPOINT_ENV}, else random weights "
                                        f"of the budget's model shapes)")
    p.add_argument("--json", required=True, metavar="PATH", help="rank 0 writes the raw samples here")


def collective_latency(group=None, repeats: int = 50) -> float:
    """Median seconds of a small (one hidden row) all-reduce over the world, synced per call."""
    import torch.distributed as dist

    from .platform import device
    from .runner import synchronize
    dev = device(int(os.environ.get("LOCAL_RANK", 0)))
    x = torch.ones(4096, dtype=torch.bfloat16, device=dev)
    return statistics.median(measure(lambda: dist.all_reduce(x, group=group), warmup=5, repeats=repeats,
                                     sync=lambda: synchronize(dev)))


def run(args) -> int:
    """`python -m optimized latency`: measure one absolute budget on this rank (the optimized runner's
    phase timings, device-synced); each sample becomes the slowest rank's, and rank 0 writes them."""
    from .bench import UsageError
    from .build import load_model, model_from_source
    from .comm import ParallelState, init_distributed
    from .platform import device
    from .runner import ModelRunner

    try:
        budget = load_budgets(args.budgets)[args.budget]
    except KeyError:
        raise UsageError(f"--budget: no budget named {args.budget!r} in {args.budgets}") from None
    except (BudgetError, OSError) as e:
        raise UsageError(str(e)) from None
    if budget.kind != "absolute":
        raise UsageError(f"--budget {budget.name} is a relative budget: it runs in-process under pytest -m latency")
    # What this run applies today: eager BF16/FP32 on the TP path. A budget asking for more fails here
    # (never measures something else under its name) until the feature exists and is applied below.
    asks = [what for what, applies in ((f"exe_mode {budget.exe_mode}", budget.exe_mode == "eager"),
                                       (f"precision {budget.precision}", budget.precision in ("bf16", "fp32")),
                                       ("SP prefill", not budget.sp_prefill)) if not applies]
    if asks:
        missing = missing_features({f for names in budget.needs.values() for f in names})
        raise UsageError(f"budget {budget.name} runs {', '.join(asks)}: " + (
            f"not built yet: {'; '.join(missing)}" if missing else
            "built, but not applied by `python -m optimized latency` yet (optimized/latency.py run)"))
    cfg = budget.inference_config()
    dtype = DTYPES[budget.dtype]
    env = init_distributed()
    try:
        state = ParallelState.build(cfg.parallel_config)
        dev = device(env.local_rank)
        model_path = args.model_path or os.environ.get(CHECKPOINT_ENV)
        if model_path:
            model = load_model(model_path, parallel=state, dtype=dtype, device=dev)
        else:
            model = model_from_source(budget.hf_config(), PooledRandomWeights(budget.seed), parallel=state,
                                      dtype=dtype, device=dev)
        runner = ModelRunner(model, cfg.scheduler_config.block_size, dev)
        prompts = random_prompts(budget, model.config.vocab_size)
        samples = interleave({"optimized": lambda: generation_samples(runner, prompts, budget.decode_steps)},
                             warmup=budget.warmup, repeats=budget.repeats)["optimized"]
        measured_latency = None
        if env.world_size > 1:   # a step lasts until its slowest rank is done: keep each sample's max over ranks
            import torch.distributed as dist
            for phase, values in samples.items():
                t = torch.tensor(values, dtype=torch.float64, device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                samples[phase] = t.tolist()
            measured_latency = collective_latency()
        if env.rank == 0:
            Path(args.json).write_text(json.dumps({
                "budget": budget.name, "world_size": env.world_size, "device": str(dev),
                "soc": this_host().soc, "model": model_path or "random weights", "samples_s": samples,
                "collective_latency_s": measured_latency}, indent=1) + "\n")
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
