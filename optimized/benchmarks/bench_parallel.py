"""Multi-process prefill benchmark: the tensor-parallel prefill beside the sequence-parallel one with each MoE
EP scheme, on the same machine in one run (`python -m optimized bench --world-size N`).

Layouts, all over N ranks with attention TP N, MoE EP N, embedding and lm_head TP N:
- `tp`: prefill_opt off (every rank runs every token; MoE by expert range + all_reduce);
- `sp-allgather`, `sp-alltoall`: prefill_opt on with moe_ep_scheme allgather / alltoall.
N processes (spawned, gloo or the platform's backend through a file rendezvous) build each layout's model
in turn with `RandomWeights(seed)` at the preset's shapes (every rank draws only its shards), run
`--warmup` discarded and `--repeats` timed prefills of a batch of random prompts, and report the slowest
rank's time per prefill. One more prefill per SP layout counts the bytes each rank's collectives send
(`comm.count_bytes`) in the whole step and in each MoE layer, where it is set beside the formula of
`prefill_plan` (with the slot counts of the actual routing, and under uniform routing).
"""
from __future__ import annotations

import math
import os
import tempfile
import time
from datetime import timedelta

import torch

from optimized.benchmarks.latency import summarize

LAYOUTS = ("tp", "sp-allgather", "sp-alltoall")


def layout_config(name: str, world: int):
    from optimized.config import ParallelConfig

    sp = name != "tp"
    return ParallelConfig(world_size=world, attn_tp_size=world, moe_tp_size=1, moe_ep_size=world,
                          embed_tp_size=world, lmhead_tp_size=world, prefill_opt=sp,
                          moe_ep_scheme=name.split("-", 1)[1] if sp else "auto").validate()


def _moe_counted(exchange, log: list, act_bytes: int):
    """`exchange` (the SP prefill's MoE EP exchange) wrapped to count its bytes and the formula's, per call."""
    from optimized.distributed import collectives as comm
    from optimized.distributed.prefill_plan import allgather_volume, alltoall_volume

    ep = exchange.moe_ep

    def counted(experts, hidden, topk_idx, topk_weight):   # bf16 only: the bench's weights are BF16
        n, h, k, local = hidden.shape[0], hidden.shape[1], topk_idx.shape[1], experts.local_experts
        ids = comm.all_gather(topk_idx, ep.group)                              # outside the counter
        owner_expert = ids.long() // local
        owner_token = torch.arange(ids.shape[0], device=ids.device)[:, None] // n
        remote = owner_expert != owner_token
        slots_out = int((remote & (owner_token == ep.rank)).sum())
        slots_in = int((remote & (owner_expert == ep.rank)).sum())
        with comm.count_bytes() as counter:
            out = exchange(experts, hidden, topk_idx, topk_weight)
        if exchange.name == "allgather":
            exact = uniform = allgather_volume(n, h, k, ep.size, act_bytes)
        else:
            exact = alltoall_volume(n, h, k, ep.size, exchange.num_experts, act_bytes, slots_out, slots_in)
            uniform = alltoall_volume(n, h, k, ep.size, exchange.num_experts, act_bytes)
        log.append({"measured": counter.total, "formula": exact.total, "uniform": uniform.total})
        return out
    return counted


def _worker(rank: int, world: int, init_file: str, args: dict, queue) -> None:
    import torch.distributed as dist

    from optimized import platform

    from optimized.distributed import collectives as comm
    from optimized.benchmarks.common import DTYPES, bench_config
    from optimized.model_loader.build import model_from_source
    from optimized.distributed import ParallelState, init_distributed
    from optimized.model_loader.loader import RandomWeights
    from optimized.executor.model_runner import ModelRunner

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_distributed(init_method=f"file://{init_file}", rank=rank, world_size=world,
                     timeout=timedelta(seconds=1800))
    device = platform.device(rank)
    try:
        dtype = DTYPES[args["dtype"]]
        config = bench_config(args["preset"], args["layers"])
        gen = torch.Generator().manual_seed(args["seed"])
        prompts = torch.randint(0, config.vocab_size, (args["batch"], args["prompt_len"]), generator=gen).tolist()
        report = {}
        for name in args["layouts"]:
            state = ParallelState.build(layout_config(name, world))
            t0 = time.perf_counter()
            model = model_from_source(config, RandomWeights(args["seed"]), parallel=state, dtype=dtype,
                                      device=device)
            runner = ModelRunner(model, args["block_size"], device)
            build_s = time.perf_counter() - t0
            times = []
            for r in range(args["warmup"] + args["repeats"]):
                dist.barrier()
                seconds = torch.tensor([runner.generate(prompts, 1).prefill_seconds], device=device)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)                   # the slowest rank's prefill
                if r >= args["warmup"]:
                    times.append(float(seconds))
            with comm.count_bytes() as counter:
                runner.generate(prompts, 1)
            step_bytes = torch.tensor([counter.total], dtype=torch.float64, device=device)
            dist.all_reduce(step_bytes)
            moe_log: list = []
            if model.ep_scheme:   # one more prefill with each MoE layer's bytes counted
                step = model.prefill.step
                exchange, step.exchange = step.exchange, _moe_counted(step.exchange, moe_log, dtype.itemsize)
                runner.generate(prompts, 1)
                step.exchange = exchange
            report[name] = {"prefill_ms": [1000 * t for t in times], "build_s": build_s, "scheme": model.ep_scheme,
                            "bytes_per_rank": float(step_bytes) / world, "moe_rank0": moe_log}
            del runner, model
        if rank == 0:
            queue.put(("ok", report))
    except BaseException as e:  # report instead of leaving the parent waiting
        import traceback
        queue.put(("error", f"rank {rank}: {e!r}\n{traceback.format_exc()}"))
        raise
    finally:
        dist.destroy_process_group()


def run(args) -> dict:
    """Run the layouts over `args.world_size` processes; returns the report (printed by `format_report`)."""
    import multiprocessing as mp

    from optimized.benchmarks.common import bench_config, progress
    from optimized.errors import UsageError

    world = args.world_size
    config = bench_config(args.preset, args.layers)
    for key, size in (("num_attention_heads", config.num_attention_heads), ("num_experts", config.num_experts),
                      ("vocab_size", config.vocab_size)):
        if size % world:
            raise UsageError(f"--world-size {world} must divide the model's {key} ({size})")
    if config.num_key_value_heads % world and world % config.num_key_value_heads:
        raise UsageError(f"--world-size {world} must divide num_key_value_heads ({config.num_key_value_heads}) or be "
                         f"a multiple of it")
    params = dict(preset=args.preset, layers=args.layers, dtype=args.dtype, seed=args.seed, batch=args.batch,
                  prompt_len=args.prompt_len, block_size=args.block_size, warmup=args.warmup, repeats=args.repeats,
                  layouts=list(LAYOUTS))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bench_rdzv_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        progress(f"{world} processes, layouts {', '.join(LAYOUTS)} ...")
        procs = [ctx.Process(target=_worker, args=(r, world, init_file, params, queue), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        status, payload = queue.get()
        for p in procs:
            p.join(60 if status == "ok" else 5)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(f"multi-process bench failed: {payload}")
    return {"setup": {**params, "world_size": world, "tokens": args.batch * args.prompt_len}, "layouts": payload}


def format_report(r: dict) -> str:
    s, lay = r["setup"], r["layouts"]
    lines = [f"prefill over {s['world_size']} processes: {s['preset']} shapes, {s['layers']} layer(s), {s['dtype']}, "
             f"batch {s['batch']} x {s['prompt_len']} tokens ({s['tokens']} packed); warm-up {s['warmup']}, "
             f"repeats {s['repeats']}; time of the slowest rank", "",
             f"{'layout':<16}{'EP scheme':>12}{'median ms':>12}{'best ms':>10}{'vs tp (best)':>14}"
             f"{'sent/rank/prefill':>20}"]
    tp_best = summarize([m / 1000 for m in lay["tp"]["prefill_ms"]])["min"] if "tp" in lay else math.nan
    for name, v in lay.items():
        st = summarize([m / 1000 for m in v["prefill_ms"]])
        lines.append(f"{name:<16}{v['scheme'] or '-':>12}{st['median']:>12.2f}{st['min']:>10.2f}"
                     f"{tp_best / st['min']:>13.2f}x{v['bytes_per_rank'] / 1e6:>17.2f} MB")
    lines += ["", "MoE EP bytes per layer sent by rank 0: measured (comm.count_bytes) vs formula (prefill_plan, with "
                  "the routing's slot counts) vs formula under uniform routing"]
    for name, v in lay.items():
        for i, m in enumerate(v["moe_rank0"]):
            lines.append(f"  {name:<14} MoE layer {i}: measured {m['measured']:>12,d} B   formula "
                         f"{m['formula']:>12,d} B   uniform {m['uniform']:>12,d} B")
    return "\n".join(lines)
