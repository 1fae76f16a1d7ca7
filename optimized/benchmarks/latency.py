"""The latency harness: timing with warm-up, device sync and an injectable clock, percentiles, and the
hardware figures measured in the same run (copy bandwidth, collective latency).

`measure` times a callable (warm-up calls discarded, a sync before the clock starts and before it stops);
`interleave` runs several workloads round by round, so a change of background load hits all of them
alike; `summarize` gives p50 / p90 / p99 (nearest rank), min, max and mean in milliseconds. The budgets
that use it are in `optimized.benchmarks.budgets` (the table) and `optimized.benchmarks.budget_run` (the measurements).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

# wall: elapsed time (what a user waits). thread_cpu: CPU time of the calling thread, i.e. the work one
# step does with torch on one thread, unaffected by other processes preempting it on a shared machine.
CLOCKS = {"wall": time.perf_counter, "thread_cpu": time.thread_time}


# ------------------------------------------------------------------------------------------ statistics


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 100]): the smallest sample with at least q% of them <= it."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 < q <= 100:
        raise ValueError(f"percentile q must be in (0, 100], got {q}")
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered) / 100) - 1)]  # q * n first: 7 / 100 * 100 > 7


def summarize(seconds: list[float]) -> dict:
    """Milliseconds: p50 / p90 / p99 (nearest rank), median, min / max / mean, the count and the sorted samples
    (the one summary bench, the parallel bench and the budgets report); NaNs when there are no samples."""
    ms = sorted(1000 * s for s in seconds)
    if not ms:
        nan = float("nan")
        return {
            "p50": nan,
            "p90": nan,
            "p99": nan,
            "median": nan,
            "min": nan,
            "max": nan,
            "mean": nan,
            "n": 0,
            "samples": [],
        }
    return {
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
        "median": statistics.median(ms),
        "min": ms[0],
        "max": ms[-1],
        "mean": statistics.fmean(ms),
        "n": len(ms),
        "samples": ms,
    }


def measure(
    fn: Callable[[], object],
    *,
    warmup: int,
    repeats: int,
    sync: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
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


def interleave(
    workloads: dict[str, Callable[[], dict[str, list[float]]]], *, warmup: int, repeats: int
) -> dict[str, dict[str, list[float]]]:
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


# ------------------------------------------------------------------------------------- hardware now


def copy_bandwidth(
    clock: Callable[[], float] = time.perf_counter, nbytes: int = 128 * 2**20, repeats: int = 3
) -> float:
    """Bytes moved per second (read + write) by a large tensor copy on this CPU, median of `repeats` after one
    warm-up copy, timed by `clock`."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / statistics.median(measure(lambda: dst.copy_(src), warmup=1, repeats=repeats, clock=clock))


def collective_latency(group=None, repeats: int = 50) -> float:
    """Median seconds of a small (one hidden row) all-reduce over the world, synced per call."""
    import torch.distributed as dist

    from optimized.platform import device
    from optimized.platform import synchronize
    from optimized import envs

    dev = device(envs.local_rank() or 0)
    x = torch.ones(4096, dtype=torch.bfloat16, device=dev)
    return statistics.median(
        measure(lambda: dist.all_reduce(x, group=group), warmup=5, repeats=repeats, sync=lambda: synchronize(dev))
    )
