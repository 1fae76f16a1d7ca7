"""The engine's host overhead per decode step: a step's wall time minus its model forward's.

`python -m optimized bench --host-overhead [--host-overhead-batches 1,16] [--host-overhead-overlap]` builds the
optimized model alone (random weights of the preset's shapes, `--layers` layers) and runs the engine
(`ModelRunner.generate`) at each batch. Each decode step's wall time is the engine's own (`Engine.last_timing`: from
scheduling to the step's bookkeeping); the forward's is timed around `runner.decode_forward` with a device sync. What
is left is the engine's work on the host: scheduling, metadata, sampling, the read back, the bookkeeping. Reported as
medians over the timed steps, and as a share of the step (the target: at most 5 %).

With `--host-overhead-overlap` each batch is run again with overlapped scheduling (scheduler_config.async_scheduling):
a step's wall time is then the engine's cycle per decode step (its host work runs while the previous step's forward
is on the device), timed without a sync around the forward, which would undo the overlap; what the step takes
beyond the synchronous run's forward is the host time left exposed. On a CPU the forward is host work itself, so the
two figures can only agree.
"""

from __future__ import annotations

import statistics

import torch

from optimized.platform import synchronize


def measure(runner, prompts: list[list[int]], decode_steps: int, rounds: int = 2) -> dict:
    """Median step, forward and host milliseconds of the decode steps of `rounds` generate runs (the first round
    discarded as warm-up), scheduled synchronously."""
    forward_s, step_s, forwards = [], [], []
    decode, overlap = runner.decode_forward, runner.async_scheduling

    def timed(ids, meta, caches):
        start = runner.clock()  # the engine's own clock, so both times share one base
        out = decode(ids, meta, caches)
        synchronize(runner.device)
        forward_s.append(runner.clock() - start)
        return out

    runner.decode_forward, runner.async_scheduling = timed, False
    try:
        for r in range(rounds):
            forward_s.clear()
            steps = runner.generate(prompts, decode_steps + 1).decode_seconds
            if len(forward_s) != len(steps):
                raise RuntimeError(f"{len(steps)} decode steps but {len(forward_s)} forwards were timed")
            if r:
                step_s.extend(steps)
                forwards.extend(forward_s)
    finally:
        runner.decode_forward, runner.async_scheduling = decode, overlap
    host = [s - f for s, f in zip(step_s, forwards)]
    step, forward, overhead = (1000 * statistics.median(x) for x in (step_s, forwards, host))
    return _row(len(prompts), len(step_s), step, forward, overhead, overlap=False)


def measure_overlapped(runner, prompts: list[list[int]], decode_steps: int, forward_ms: float, rounds: int = 2) -> dict:
    """The same decode steps with overlapped scheduling: the median step (the engine's cycle per decode step), and
    what it takes beyond `forward_ms` (the synchronous run's forward) as the exposed host time."""
    step_s, overlap = [], runner.async_scheduling
    runner.async_scheduling = True
    try:
        for r in range(rounds):
            steps = runner.generate(prompts, decode_steps + 1).decode_seconds
            if r:
                step_s.extend(steps)
    finally:
        runner.async_scheduling = overlap
    step = 1000 * statistics.median(step_s)
    return _row(len(prompts), len(step_s), step, forward_ms, step - forward_ms, overlap=True)


def _row(batch: int, steps: int, step: float, forward: float, host: float, overlap: bool) -> dict:
    return {
        "batch": batch,
        "overlap": overlap,
        "steps": steps,
        "step_ms": step,
        "forward_ms": forward,
        "host_ms": host,
        "host_share": host / step if step else float("nan"),
    }


def run(config, dtype, args, batches: list[int], progress) -> list[dict]:
    from optimized.executor.assembly import WeightSource, build_model
    from optimized.executor.model_runner import ModelRunner

    progress(f"host overhead: building the optimized model ({args.layers} layer(s), {args.dtype}) ...")
    model = build_model(WeightSource.random_weights(config, seed=args.seed), dtype=dtype)
    runner = ModelRunner(model, args.block_size)
    gen = torch.Generator().manual_seed(args.seed)
    out = []
    for batch in batches:
        prompts = torch.randint(0, config.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
        progress(f"  batch {batch}: {args.decode_steps} decode steps x {args.repeats} timed round(s) ...")
        out.append(measure(runner, prompts, args.decode_steps, rounds=1 + args.repeats))
        if getattr(args, "host_overhead_overlap", False):
            forward = out[-1]["forward_ms"]
            out.append(measure_overlapped(runner, prompts, args.decode_steps, forward, rounds=1 + args.repeats))
    return out


def format_report(rows: list[dict], what: str) -> str:
    lines = [
        f"engine host overhead per decode step ({what}; medians):",
        f"  {'batch':>5}  {'overlap':>7}  {'step ms':>9}  {'forward ms':>10}  {'host ms':>8}  {'host share':>10}",
    ]
    for r in rows:
        lines.append(
            f"  {r['batch']:>5}  {'on' if r['overlap'] else 'off':>7}  {r['step_ms']:>9.2f}  {r['forward_ms']:>10.2f}  "
            f"{r['host_ms']:>8.3f}  {100 * r['host_share']:>9.2f}%"
        )
    return "\n".join(lines)
