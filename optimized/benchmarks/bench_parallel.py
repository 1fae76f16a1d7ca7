"""Multi-process benchmark, on the same machine in one run (`python -m optimized bench --world-size N`): the
tensor-parallel prefill beside the sequence-parallel one with each MoE EP scheme, then the tensor-parallel decode
beside the expert-parallel MC2 decode.

Prefill layouts (`PREFILL_LAYOUTS`), all over N ranks with attention TP N, MoE EP N, embedding and lm_head TP N:
- `tp`: prefill_opt off (every rank runs every token; MoE by expert range + all_reduce);
- `sp-allgather`, `sp-alltoall`: prefill_opt on with moe_ep_scheme allgather / alltoall.
N processes (spawned, gloo or the platform's backend through a file rendezvous) build each layout's model
in turn with `RandomWeights(seed)` at the preset's shapes (every rank draws only its shards), run
`--warmup` discarded and `--repeats` timed prefills of a batch of random prompts, and report the slowest
rank's time per prefill. One more prefill per SP layout counts the bytes each rank's collectives send
(`comm.count_bytes`) in the whole step and in each MoE layer, where it is set beside the formula of
`prefill_plan` (with the slot counts of the actual routing, and under uniform routing).

Decode layouts (`DECODE_LAYOUTS`), over N ranks with attention, embedding and lm_head TP N and the TP prefill:
- `tp`: moe_tp N, moe_ep 1, every expert split N ways (`moe_infer_tp`: the partial sums all-reduced);
- `mc2`: moe_tp 1, moe_ep N (`moe_infer_dispatch_combine`: npu_moe_distribute_dispatch_v2 / combine_v2, then the
  all_gather of each rank's share of the batch).
Each runs `--warmup` discarded and `--repeats` timed generations of `--decode-steps` decode steps over the same
prompts and reports the slowest rank's time per step. One more generation counts one decode step: the bytes of
every collective of the step, and per MoE layer the bytes of each collective of the exchange beside
`decode_plan.decode_volume` (with the routing's slot counts: equal to the byte, checked on every rank) and beside
it under uniform routing. The formula alone, at the preset's full depth, comes with the report (and with
`--formula-only`, which runs nothing). Another decode layout (attention data parallel) is one more `DecodeLayout`
entry.
"""
from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from optimized.benchmarks.latency import summarize

PREFILL_LAYOUTS = ("tp", "sp-allgather", "sp-alltoall")


@dataclass(frozen=True)
class DecodeLayout:
    """One decode layout of the report: its name, what its decode runs, and its sizes over N ranks (ParallelConfig
    keywords beside world_size; embedding and lm_head TP N and the TP prefill are common to all)."""

    name: str
    what: str
    sizes: Callable[[int], dict]

    def config(self, world: int):
        from optimized.config import ParallelConfig

        return ParallelConfig(world_size=world, embed_tp_size=world, lmhead_tp_size=world, prefill_opt=False,
                              **self.sizes(world)).validate()


DECODE_LAYOUTS = (
    DecodeLayout("tp", "moe_infer_tp: experts split over moe_tp, all_reduce",
                 lambda w: dict(attn_tp_size=w, moe_tp_size=w, moe_ep_size=1)),
    DecodeLayout("mc2", "MC2 dispatch / combine over moe_ep, all_gather",
                 lambda w: dict(attn_tp_size=w, moe_tp_size=1, moe_ep_size=w)),
)
DECODE_BY_NAME = {layout.name: layout for layout in DECODE_LAYOUTS}


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


def _decode_moe_counted(exchange, log: list, parallel, num_experts: int, act_bytes: int):
    """`exchange` (a decode step's MoE exchange) wrapped to log, per call, each collective's bytes beside the
    formula's (with this routing's slot counts) and the formula's under uniform routing."""
    from optimized.distributed import collectives as comm
    from optimized.distributed.decode_plan import decode_volume, tokens_per_rank, uses_mc2_decode

    def counted(experts, hidden, topk_idx, topk_weight):
        b, h, k = hidden.shape[0], hidden.shape[1], topk_idx.shape[1]
        slots_out = slots_in = None
        if uses_mc2_decode(parallel):   # every rank holds all B tokens' ids; EP rank s dispatches [s*n, (s+1)*n)
            me, n = exchange.moe_ep.rank, tokens_per_rank(b, exchange.moe_ep.size)
            owner = topk_idx.long() // experts.local_experts
            source = torch.arange(b, device=topk_idx.device)[:, None] // n
            slots_out = int(((source == me) & (owner != me)).sum())
            slots_in = int(((owner == me) & (source != me)).sum())
        with comm.count_bytes() as counter:
            out = exchange(experts, hidden, topk_idx, topk_weight)
        log.append({"measured": dict(counter.bytes),
                    "formula": decode_volume(parallel, b, h, k, num_experts, act_bytes, slots_out, slots_in).parts,
                    "uniform": decode_volume(parallel, b, h, k, num_experts, act_bytes).parts})
        return out
    return counted


def _default_exchange(model):
    """The exchange a decode step without one uses: the MoE blocks' own `moe_infer_tp` (the same on every layer)."""
    return next(layer.mlp.moe_infer_tp for layer in model.layers if hasattr(layer.mlp, "moe_infer_tp"))


def _bench_decode(layout: DecodeLayout, world: int, config, args: dict, prompts, device) -> dict:
    """Time one decode layout and count one decode step's bytes (every rank's, gathered on every rank)."""
    import torch.distributed as dist

    from optimized.benchmarks.common import DTYPES
    from optimized.distributed import ParallelState
    from optimized.distributed import collectives as comm
    from optimized.executor.model_runner import ModelRunner
    from optimized.model_loader.build import model_from_source
    from optimized.model_loader.loader import RandomWeights

    dtype = DTYPES[args["dtype"]]
    parallel = layout.config(world)
    state = ParallelState.build(parallel)
    t0 = time.perf_counter()
    model = model_from_source(config, RandomWeights(args["seed"]), parallel=state, dtype=dtype, device=device)
    runner = ModelRunner(model, args["block_size"], device)
    build_s = time.perf_counter() - t0
    times: list[float] = []
    for r in range(args["warmup"] + args["repeats"]):
        dist.barrier()
        steps = runner.generate(prompts, args["decode_steps"] + 1).decode_seconds
        seconds = torch.tensor(steps, dtype=torch.float32, device=device)       # float32: every backend reduces it
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)                          # the slowest rank's step
        if r >= args["warmup"]:
            times.extend(float(t) for t in seconds)
    # One decode step counted: the whole forward, and each MoE layer's exchange beside its formula.
    step, moe_log, step_log = model.decode.step, [], []
    exchange, forward = step.exchange, runner.decode_forward

    def counted_forward(*a, **kw):
        with comm.count_bytes() as counter:
            out = forward(*a, **kw)
        step_log.append(dict(counter.bytes))
        return out

    step.exchange = _decode_moe_counted(exchange or _default_exchange(model), moe_log, parallel,
                                        config.num_experts, dtype.itemsize)
    runner.decode_forward = counted_forward
    try:
        runner.generate(prompts, 2)                                              # one decode step
    finally:
        step.exchange, runner.decode_forward = exchange, forward
    gathered = [None] * world
    dist.all_gather_object(gathered, {"step": step_log[0], "moe": moe_log})
    exchange_name = type(exchange or _default_exchange(model)).__name__
    del runner, model
    return {"decode_ms": [1000 * t for t in times], "build_s": build_s, "what": layout.what,
            "exchange": exchange_name, "sizes": layout.sizes(world),
            "step_bytes": [g["step"] for g in gathered], "moe": [g["moe"] for g in gathered]}


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
        decode = {name: _bench_decode(DECODE_BY_NAME[name], world, config, args, prompts, device)
                  for name in args["decode_layouts"]}
        if rank == 0:
            queue.put(("ok", {"prefill": report, "decode": decode}))
    except BaseException as e:  # report instead of leaving the parent waiting
        import traceback
        queue.put(("error", f"rank {rank}: {e!r}\n{traceback.format_exc()}"))
        raise
    finally:
        dist.destroy_process_group()


def run(args) -> dict:
    """Run the layouts over `args.world_size` processes; returns the report (printed by `format_report`)."""
    import multiprocessing as mp

    from optimized.benchmarks.common import DTYPES, progress
    from optimized.distributed.decode_plan import apply_hccl_buffsize
    from optimized.errors import UsageError

    world = args.world_size
    config = check_world(args)
    if args.prompt_len + args.decode_steps + 1 > config.max_position_embeddings:
        raise UsageError(f"--prompt-len + --decode-steps exceed max_position_embeddings "
                         f"({config.max_position_embeddings})")
    # Children inherit the environment: an MC2 decode on hccl gets its HCCL window before any group exists.
    parallels = [layout_config(n, world) for n in PREFILL_LAYOUTS] + [d.config(world) for d in DECODE_LAYOUTS]
    apply_hccl_buffsize(config, parallels, args.batch, DTYPES[args.dtype].itemsize)
    params = dict(preset=args.preset, layers=args.layers, dtype=args.dtype, seed=args.seed, batch=args.batch,
                  prompt_len=args.prompt_len, block_size=args.block_size, warmup=args.warmup, repeats=args.repeats,
                  decode_steps=args.decode_steps, layouts=list(PREFILL_LAYOUTS),
                  decode_layouts=[d.name for d in DECODE_LAYOUTS])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bench_rdzv_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        progress(f"{world} processes, prefill layouts {', '.join(PREFILL_LAYOUTS)}, decode layouts "
                 f"{', '.join(params['decode_layouts'])} ...")
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
    return {"setup": {**params, "world_size": world, "tokens": args.batch * args.prompt_len},
            "layouts": payload["prefill"], "decode": payload["decode"], "decode_formula": formula(args, config)}


def check_world(args):
    """The bench's model config, once `--world-size` fits every layout of it (UsageError otherwise)."""
    from optimized.benchmarks.common import bench_config
    from optimized.errors import UsageError

    world = args.world_size
    config = bench_config(args.preset, args.layers)
    for key, size in (("num_attention_heads", config.num_attention_heads), ("num_experts", config.num_experts),
                      ("vocab_size", config.vocab_size), ("moe_intermediate_size", config.moe_intermediate_size)):
        if size % world:
            raise UsageError(f"--world-size {world} must divide the model's {key} ({size})")
    if config.num_key_value_heads % world and world % config.num_key_value_heads:
        raise UsageError(f"--world-size {world} must divide num_key_value_heads ({config.num_key_value_heads}) or be "
                         f"a multiple of it")
    return config


def formula(args, config=None) -> dict:
    """Each decode layout's MoE bytes per rank and decode step under uniform routing, at the preset's full depth
    (`decode_plan.step_volume`), and the HCCL buffer an MC2 layout needs; nothing runs."""
    from optimized.benchmarks.common import DTYPES, full_layer_count
    from optimized.distributed import decode_plan

    config = config or check_world(args)
    act, world, layers = DTYPES[args.dtype].itemsize, args.world_size, full_layer_count(args.preset)
    out = {"preset": args.preset, "world_size": world, "batch": args.batch, "dtype": args.dtype,
           "moe_layers": decode_plan.moe_layer_count(config, layers), "layouts": {}}
    for layout in DECODE_LAYOUTS:
        p = layout.config(world)
        one = decode_plan.decode_volume(p, args.batch, config.hidden_size, config.num_experts_per_tok,
                                        config.num_experts, act)
        out["layouts"][layout.name] = {
            "per_layer": one.parts, "per_step": decode_plan.step_volume(config, p, args.batch, act, layers).parts,
            "hccl_buffer_mb": decode_plan.needed_buffer_mb(config, [p], args.batch, act)}
    return out


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
    return "\n".join(lines + format_decode(r))


def _kb(n: float) -> str:
    return f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.2f} MB"


def _parts(parts: dict) -> str:
    return ", ".join(f"{op} {b:,d} B" for op, b in parts.items())


def format_decode(r: dict) -> list[str]:
    s, dec = r["setup"], r["decode"]
    lines = ["", f"decode over {s['world_size']} processes: batch {s['batch']}, prompt {s['prompt_len']}, "
                 f"{s['decode_steps']} decode steps per round; warm-up {s['warmup']}, repeats {s['repeats']}; time "
                 f"per step of the slowest rank", "",
             f"{'layout':<8}{'sizes':<32}{'median ms':>10}{'best ms':>10}{'vs tp (best)':>14}"
             f"{'MoE sent/rank/step':>20}{'all sent/rank/step':>20}   decode MoE path"]
    best = {name: summarize([m / 1000 for m in v["decode_ms"]])["min"] for name, v in dec.items()}
    for name, v in dec.items():
        st = summarize([m / 1000 for m in v["decode_ms"]])
        sizes = ", ".join(f"{k.replace('_size', '')} {n}" for k, n in v["sizes"].items())
        moe = sum(sum(m["measured"].values()) for m in v["moe"][0])
        step = sum(v["step_bytes"][0].values())
        lines.append(f"{name:<8}{sizes:<32}{st['median']:>10.2f}{st['min']:>10.2f}"
                     f"{best.get('tp', math.nan) / st['min']:>13.2f}x{_kb(moe):>20}{_kb(step):>20}   {v['what']}")
    lines += ["", "bytes of one decode step sent by rank 0, per collective (comm.count_bytes; MoE, attention, "
                  "embedding, lm_head):"]
    for name, v in dec.items():
        lines.append(f"  {name:<6} {_parts(v['step_bytes'][0])}")
    lines += ["", "MoE bytes per layer of one decode step, per collective: measured (comm.count_bytes) vs formula "
                  "(decode_plan.decode_volume with the routing's slot counts) vs formula under uniform routing; "
                  "rank 0 shown, every rank compared"]
    for name, v in dec.items():
        for i, m in enumerate(v["moe"][0]):
            for op, want in m["formula"].items():
                lines.append(f"  {name:<6} MoE layer {i}  {op:<32} measured {m['measured'].get(op, 0):>12,d} B   "
                             f"formula {want:>12,d} B   uniform {m['uniform'][op]:>12,d} B")
        bad = [(rank, i) for rank, logs in enumerate(v["moe"]) for i, m in enumerate(logs)
               if m["measured"] != m["formula"]]
        lines.append(f"  {name:<6} every rank, every MoE layer: measured == formula: "
                     + ("yes" if not bad else f"NO (rank, layer) {bad}"))
    return lines + format_formula(r["decode_formula"])


def format_formula(f: dict) -> list[str]:
    lines = ["", f"formula (decode_plan, uniform routing), {f['preset']} at full depth ({f['moe_layers']} MoE layers), "
                 f"batch {f['batch']}, {f['dtype']}, {f['world_size']} ranks: MoE bytes per rank"]
    for name, v in f["layouts"].items():
        buffer = "" if v["hccl_buffer_mb"] is None else f"; HCCL buffer >= {v['hccl_buffer_mb']} MB (HCCL_BUFFSIZE)"
        lines.append(f"  {name:<6} per layer: {_parts(v['per_layer'])} = {sum(v['per_layer'].values()):,d} B; "
                     f"per decode step: {sum(v['per_step'].values()):,d} B{buffer}")
    return lines
