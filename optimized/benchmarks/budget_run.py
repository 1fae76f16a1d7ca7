"""Measuring a latency budget: in this process for the CPU relative budgets (`run_relative`), one
process per rank for the NPU budgets (`python -m optimized latency`, launched by `launch_command`).

Weights: a checkpoint when one is given, else `PooledRandomWeights` of the budget's real shapes (cheap to
build, every rank and layout reads one model), whose router sends more tokens to a few hot experts than to
the rest (`SKEWED_ROUTER`): random weights alone route near-uniformly, the best case of expert parallelism.
Prompts: seeded random ids. Every report says which weights were measured (`weights_label`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Callable

import torch

from optimized.benchmarks.budgets import (
    CHECKPOINT_ENV,
    DEFAULT_BUDGETS,
    DTYPES,
    Budget,
    load_budgets,
    phase_report,
    this_host,
)
from optimized.benchmarks.reference_timing import reference_model, time_reference
from optimized.benchmarks.latency import CLOCKS, collective_latency, copy_bandwidth, interleave
from optimized.model_loader.loader import RandomWeights


# ----------------------------------------------------------------------------------------- model building

# The router rows of the first 1/8 of the experts (contiguous: one EP rank holds them) scaled by 1.5 win top-k
# more often. Measured on random unit-variance inputs (Qwen3-235B shapes, E 128, top-8): the hottest expert gets
# 2.35x the mean load and the hot EP rank of 4 gets 1.51x (1.22x / 1.02x unscaled). A chosen skew, not a
# checkpoint's: the report names it beside the measured load (`routing_skew`).
SKEWED_ROUTER = {"hot_fraction": 1 / 8, "scale": 1.5}


class PooledRandomWeights(RandomWeights):
    """A weight source of the real shapes filled cheaply: tensor `name` is the stretch of one seeded
    N(0, std) pool repeated end to end that starts at an offset seeded by the name, so building a 30B-shaped
    layer costs copies, not a billion random draws. A slice reads the same values as the whole tensor at
    those positions (every rank and every layout sees one model). Each tensor owns its memory (timings
    read real bytes); norm weights are 1; router rows of the hot experts are scaled (`SKEWED_ROUTER`)."""

    def __init__(self, seed: int = 0, std: float = 0.02, pool: int = (1 << 22) + 1):
        super().__init__(seed, std)
        self.pool = torch.randn(pool, generator=torch.Generator().manual_seed(seed)) * std

    def _stretch(self, start: int, n: int) -> torch.Tensor:
        """Elements [start, start + n) of the pool repeated end to end (a new tensor)."""
        P, out, filled = self.pool.numel(), torch.empty(n), 0
        while filled < n:
            at = (start + filled) % P
            take = min(P - at, n - filled)
            out[filled : filled + take] = self.pool[at : at + take]
            filled += take
        return out

    def _values(self, name: str, shape: tuple[int, ...], index: tuple) -> torch.Tensor:
        start = zlib.crc32(f"{self.seed}:{name}".encode()) % self.pool.numel()
        rows = index[0] if index else slice(None)
        first, stop, step = rows.indices(shape[0])
        if step != 1:
            raise ValueError(f"{name}: only unit-step slices are supported, got {rows!r}")
        row = math.prod(shape[1:])
        t = self._stretch(start + first * row, (stop - first) * row).view(stop - first, *shape[1:])
        if name.endswith(".mlp.gate.weight"):  # [E, H] router: rows of the hot experts scaled
            hot = torch.arange(first, stop) < int(shape[0] * SKEWED_ROUTER["hot_fraction"])
            t[hot] *= SKEWED_ROUTER["scale"]
        return t[(slice(None),) + tuple(index[1:])].clone() if len(index) > 1 else t


def routing_skew(router_weight: torch.Tensor, top_k: int, ep_size: int, tokens: int = 2048, seed: int = 0) -> dict:
    """Load of the router `router_weight` [E, H] on random unit-variance inputs: the hottest expert's and the
    hottest of `ep_size` contiguous EP ranks' token slots over the mean (1.0 = perfectly balanced)."""
    w = router_weight.float().cpu()
    x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(seed))
    load = torch.bincount((x @ w.t()).topk(top_k, dim=-1).indices.flatten(), minlength=w.shape[0]).double()
    ranks = load.view(ep_size, -1).sum(1) if w.shape[0] % ep_size == 0 else load.sum(0, keepdim=True)
    return {
        "expert_max_over_mean": (load.max() / load.mean()).item(),
        "ep_rank_max_over_mean": (ranks.max() / ranks.mean()).item(),
        "ep_size": ep_size,
    }


def weights_label(model_path: str | None, config, ep_size: int = 1, seed: int = 0) -> dict:
    """What a budget measured: the checkpoint, or random weights with their routing skew (first sparse layer)."""
    if model_path:
        return {"weights": model_path}
    source = PooledRandomWeights(seed)
    layer = next(
        (
            i
            for i in range(config.num_hidden_layers)
            if i not in (config.mlp_only_layers or []) and (i + 1) % config.decoder_sparse_step == 0
        ),
        0,
    )
    gate = source.read(f"model.layers.{layer}.mlp.gate.weight", (config.num_experts, config.hidden_size))
    return {
        "weights": f"random (PooledRandomWeights), skewed routing {SKEWED_ROUTER}",
        "routing_skew": routing_skew(gate, config.num_experts_per_tok, ep_size),
    }


def reference_and_optimized(config, dtype: torch.dtype, seed: int = 0, block_size: int = 128):
    """The reference model and an optimized ModelRunner (one process) computing the same function: the
    optimized model loads pooled random weights, the reference's experts are views of its expert storage
    (the recipe stores each expert's rows as the checkpoint does, so the views are contiguous) and its other
    weights are the same pooled values. One copy of the experts keeps a 30B-shaped layer cheap to build."""
    from optimized.executor.assembly import WeightSource, build_model
    from optimized.executor.model_runner import ModelRunner

    source = PooledRandomWeights(seed)
    # The NZ cast (an NPU layout; on the CPU a contiguous copy) would give the experts storage of their own: the
    # reference's views below need the checkpoint layout the loader wrote.
    opt = build_model(WeightSource.random_weights(config, source), dtype=dtype, weight_nz=False)

    def weights(name: str, shape: tuple) -> torch.Tensor:
        if ".mlp.experts." not in name:
            return source.read(name, shape)
        parts = name.split(".")  # model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
        experts, e, proj = opt.layers[int(parts[2])].mlp.experts, int(parts[5]), parts[6]
        i = experts.inter_per_rank
        w = {"gate_proj": experts.w13[e, :, :i], "up_proj": experts.w13[e, :, i:], "down_proj": experts.w2[e]}[proj].t()
        assert w.is_contiguous() and tuple(w.shape) == shape, name
        return w

    return reference_model(config, weights, dtype), ModelRunner(opt, block_size)


def random_prompts(budget: Budget, vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(budget.seed)
    return torch.randint(0, vocab_size, (budget.batch, budget.prompt_len), generator=gen).tolist()


def generation_samples(runner, prompts: list[list[int]], decode_steps: int) -> dict[str, list[float]]:
    """One prefill and `decode_steps` decode steps of the optimized runner (it syncs the device per phase)."""
    result = runner.generate(prompts, decode_steps + 1)
    return {"prefill": [result.prefill_seconds], "decode": list(result.decode_seconds)}


def reference_samples(
    model, prompts: list[list[int]], decode_steps: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, list[float]]:
    """The same for the reference model (its own contiguous KV cache, CPU only), timed as the runner times."""
    prefill, decode, _ = time_reference(model, torch.tensor(prompts), decode_steps, clock)
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
    samples = interleave(
        {
            "reference": lambda: reference_samples(ref, prompts, budget.decode_steps, clock),
            "optimized": lambda: generation_samples(runner, prompts, budget.decode_steps),
        },
        warmup=budget.warmup,
        repeats=budget.repeats,
    )
    # The CPU floors at the bandwidth of a copy measured now (same clock): neither model's p50 may be below. The
    # prefill one is a one-token prefill's (top_k experts read): the uniform-routing expectation of the experts a
    # whole prompt hits would overstate what a skewed routing reads (measured 59 ms vs 80 ms on the 30B layer).
    from optimized.benchmarks.floor import cpu_hardware, decode_floor, prefill_floor

    bandwidth = copy_bandwidth(clock)
    hw = cpu_hardware(bandwidth)
    floors = {
        "prefill": prefill_floor(config, hw, dtype, [1])["floor_s"],
        "decode": decode_floor(config, hw, dtype, budget.batch, budget.prompt_len + (budget.decode_steps + 1) / 2)[
            "floor_s"
        ],
    }
    label = weights_label(None, config, seed=budget.seed)
    reports = {}
    for phase in budget.phases:
        reports[phase] = phase_report(
            budget,
            phase,
            samples["optimized"][phase],
            floor_s=floors[phase],
            reference_seconds=samples["reference"][phase],
        )
        reports[phase].update(copy_bandwidth_gb_s=bandwidth / 1e9, **label)
    return reports


# ---------------------------------------------------------------------------------- NPU: one process per rank


def launch_command(
    budget: Budget,
    json_path: str | os.PathLike,
    budgets_path: str | os.PathLike | None = None,
    model_path: str | None = None,
) -> list[str]:
    """torchrun (torch.distributed.run) over `python -m optimized latency`, one process per rank."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(budget.world_size),
        "-m",
        "optimized",
        "latency",
        "--budget",
        budget.name,
        "--budgets",
        str(budgets_path or DEFAULT_BUDGETS),
        "--json",
        str(json_path),
    ]
    return cmd + (["--model-path", model_path] if model_path else [])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", required=True, help="budget name in the budgets file")
    p.add_argument(
        "--budgets", default=str(DEFAULT_BUDGETS), help="budgets YAML (default optimized/benchmarks/budgets.yaml)"
    )
    p.add_argument(
        "--model-path",
        help=f"checkpoint directory (else ${CHECKPOINT_ENV}, else random weights of the budget's model shapes)",
    )
    p.add_argument("--json", required=True, metavar="PATH", help="rank 0 writes the raw samples here")


def check_applied(budget: Budget, plan) -> None:
    """The plan runs what the budget names (its precision's quantization scheme, its prefill path), or a UsageError
    saying what differs; exe_mode is applied by the runner."""
    from optimized.errors import UsageError
    from optimized.layers.quantization.schemes import SCHEMES
    from optimized.path_plan import SP

    wanted = budget.precision if budget.precision in SCHEMES else None  # bf16 / fp32: a 16-bit checkpoint
    if plan.quant != wanted:
        raise UsageError(
            f"budget {budget.name} is {budget.precision} but the model is "
            f"{plan.scheme.label if plan.quant else 'not quantized'}: pass a matching checkpoint"
        )
    sp = plan.paths.prefill == SP
    if sp != budget.sp_prefill:
        raise UsageError(
            f"budget {budget.name} {'needs' if budget.sp_prefill else 'does not use'} the sequence-"
            f"parallel prefill, but its config {budget.config} builds the "
            f"{'SP' if sp else 'TP'} prefill (parallel_config.prefill_opt)"
        )


def weight_source(budget: Budget, model_path: str | None):
    """The budget's checkpoint when one is given, else pooled random weights of its shapes; either way the MC2
    window is sized for the budget's shapes."""
    from optimized.executor.assembly import WeightSource

    if model_path:
        return WeightSource.from_checkpoint(model_path, budget.hf_config())
    return WeightSource.random_weights(budget.hf_config(), PooledRandomWeights(budget.seed))


def run(args) -> int:
    """`python -m optimized latency`: measure one absolute budget on this rank (the optimized runner's
    phase timings, device-synced); each sample becomes the slowest rank's, and rank 0 writes them."""
    from optimized.errors import UsageError
    from optimized.executor import assembly
    from optimized.executor.model_runner import ModelRunner
    from optimized.platform import device

    try:
        budget = load_budgets(args.budgets)[args.budget]
    except KeyError:
        raise UsageError(f"--budget: no budget named {args.budget!r} in {args.budgets}") from None
    except OSError as e:  # (a BudgetError is a UsageError already)
        raise UsageError(str(e)) from None
    if budget.kind != "absolute":
        raise UsageError(f"--budget {budget.name} is a relative budget: it runs in-process under pytest -m latency")
    from optimized import envs

    model_path = args.model_path or envs.latency_checkpoint()
    missing = budget.missing_checkpoint(model_path)
    if missing:  # never measure random weights under the name of a checkpoint's budget
        raise UsageError(missing)
    unfit = budget.hardware.mismatch(this_host())
    if unfit:  # the pytest skip's reason, before any process group or model (a 235B model on a CPU ...)
        raise UsageError(f"budget {budget.name} {unfit}")
    cfg = budget.inference_config()
    dtype = DTYPES[budget.dtype]
    env = assembly.join_job()
    try:
        dev = device(env.local_rank)
        weights = weight_source(budget, model_path)
        plan = assembly.plan_for(
            weights, cfg.parallel_config, dtype=dtype, batch=budget.batch, exe_mode=budget.exe_mode
        )
        check_applied(budget, plan)  # before the build: a mismatch costs no weight read
        model = assembly.build_model(weights, cfg.parallel_config, dtype=dtype, device=dev, plan=plan)
        runner = ModelRunner(model, cfg.scheduler_config.block_size, dev, exe_mode=budget.exe_mode)
        prompts = random_prompts(budget, model.config.vocab_size)
        samples = interleave(
            {"optimized": lambda: generation_samples(runner, prompts, budget.decode_steps)},
            warmup=budget.warmup,
            repeats=budget.repeats,
        )["optimized"]
        measured_latency = None
        if env.world_size > 1:  # a step lasts until its slowest rank is done: keep each sample's max over ranks
            import torch.distributed as dist

            for phase, values in samples.items():
                t = torch.tensor(values, dtype=torch.float64, device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                samples[phase] = t.tolist()
            measured_latency = collective_latency()
        if env.rank == 0:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "budget": budget.name,
                        "world_size": env.world_size,
                        "device": str(dev),
                        "soc": this_host().soc,
                        "model": model_path or "random weights",
                        "samples_s": samples,
                        **weights_label(model_path, model.config, cfg.parallel_config.moe_ep_size, budget.seed),
                        "collective_latency_s": measured_latency,
                    },
                    indent=1,
                )
                + "\n"
            )
    finally:
        assembly.leave_job()
    return 0
