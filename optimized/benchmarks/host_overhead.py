"""The engine's host overhead per decode step: a step's wall time minus its model forward's.

`python -m optimized bench --host-overhead [--host-overhead-batches 1,16]` builds the optimized model alone (random
weights of the preset's shapes, `--layers` layers) and runs the engine (`ModelRunner.generate`) at each batch. Each
decode step's wall time is the engine's own (`Engine.last_timing`: from scheduling to the step's bookkeeping); the
forward's is timed around `runner.decode_forward` with a device sync. What is left is the engine's work on the host:
scheduling, metadata, sampling, the read back, the bookkeeping. Reported as medians over the timed steps, and as a
share of the step (the target: at most 5 %).
"""

from __future__ import annotations

import statistics

import torch

from optimized.platform import synchronize


def measure(runner, prompts: list[list[int]], decode_steps: int, rounds: int = 2) -> dict:
    """Median step, forward and host milliseconds of the decode steps of `rounds` generate runs (the first round
    discarded as warm-up)."""
    forward_s, step_s, forwards = [], [], []
    decode = runner.decode_forward

    def timed(ids, meta, caches):
        start = runner.clock()  # the engine's own clock, so both times share one base
        out = decode(ids, meta, caches)
        synchronize(runner.device)
        forward_s.append(runner.clock() - start)
        return out

    runner.decode_forward = timed
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
        runner.decode_forward = decode
    host = [s - f for s, f in zip(step_s, forwards)]
    step, forward, overhead = (1000 * statistics.median(x) for x in (step_s, forwards, host))
    return {
        "batch": len(prompts),
        "steps": len(step_s),
        "step_ms": step,
        "forward_ms": forward,
        "host_ms": overhead,
        "host_share": overhead / step if step else float("nan"),
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
    return out


def format_report(rows: list[dict], what: str) -> str:
    lines = [
        f"engine host overhead per decode step ({what}; medians):",
        f"  {'batch':>5}  {'step ms':>9}  {'forward ms':>10}  {'host ms':>8}  {'host share':>10}",
    ]
    for r in rows:
        lines.append(
            f"  {r['batch']:>5}  {r['step_ms']:>9.2f}  {r['forward_ms']:>10.2f}  {r['host_ms']:>8.3f}  "
            f"{100 * r['host_share']:>9.2f}%"
        )
    return "\n".join(lines)
