"""Multi-process benchmark, on the same machine in one run (`python -m optimized bench --world-size N`): the
tensor-parallel prefill beside the sequence-parallel one with each MoE EP scheme, then the tensor-parallel decode
beside the expert-parallel MC2 decode and the attention data-parallel one.

`run(args) -> report dict`: N spawned processes build each layout of `PREFILL_LAYOUTS` (tp, sp-allgather,
sp-alltoall) and `DECODE_LAYOUTS` (tp, mc2, dp) in turn with `RandomWeights(seed)` at the preset's shapes (each rank
drawing only its shards), time `--warmup` discarded and `--repeats` timed runs (the slowest rank's time), and count
one more run's bytes per collective with `comm.count_bytes`, per MoE layer set beside the formulas of prefill_plan /
decode_plan (with the routing's slot counts they must be equal on every rank). `dp` needs an even N >= 4 and
`--batch` a multiple of 2, else its report line says why it was skipped. `formula(args)` (`--formula-only`) builds
nothing: the decode layouts' bytes and the MC2 window at the preset's full depth, and every DP split of N.
docs/parallel.md.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

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
    skip: Callable[[int, int], str | None] = lambda world, batch: None  # why it is not run, or None

    def config(self, world: int):
        from optimized.config import ParallelConfig

        return ParallelConfig(
            world_size=world,
            **{"embed_tp_size": world, "lmhead_tp_size": world, **self.sizes(world)},
            prefill_opt=False,
        ).validate()


DP_GROUPS = 2


def _dp_skip(world: int, batch: int) -> str | None:
    if world % DP_GROUPS:
        return (
            f"needs an even --world-size >= {2 * DP_GROUPS} (attention TP world/{DP_GROUPS} x DP {DP_GROUPS}); "
            f"{world} is odd"
        )
    if world < 2 * DP_GROUPS:
        return (
            f"needs an even --world-size >= {2 * DP_GROUPS} (attention TP world/{DP_GROUPS} x DP {DP_GROUPS}); "
            f"at {world} attention TP would be 1, no attention collectives to compare (--formula-only shows it)"
        )
    if batch % DP_GROUPS:
        return (
            f"--batch {batch} is not a multiple of attn_dp_size {DP_GROUPS} (the attention DP rule "
            f"scheduler_config.batch_size % attn_dp_size == 0)"
        )
    return None


DECODE_LAYOUTS = (
    DecodeLayout(
        "tp",
        "moe_infer_tp: experts split over moe_tp, all_reduce",
        lambda w: dict(attn_tp_size=w, moe_tp_size=w, moe_ep_size=1),
    ),
    DecodeLayout(
        "mc2",
        "MC2 dispatch / combine over moe_ep, all_gather",
        lambda w: dict(attn_tp_size=w, moe_tp_size=1, moe_ep_size=w),
    ),
    DecodeLayout(
        "dp",
        "attention DP: MC2 on own rows, no all_gather",
        lambda w: dict(
            attn_tp_size=w // DP_GROUPS, moe_tp_size=1, moe_ep_size=w, embed_tp_size=1, lmhead_tp_size=1, attn_dp=True
        ),
        _dp_skip,
    ),
)
DECODE_BY_NAME = {layout.name: layout for layout in DECODE_LAYOUTS}


def layout_config(name: str, world: int):
    from optimized.config import ParallelConfig

    sp = name != "tp"
    return ParallelConfig(
        world_size=world,
        attn_tp_size=world,
        moe_tp_size=1,
        moe_ep_size=world,
        embed_tp_size=world,
        lmhead_tp_size=world,
        prefill_opt=sp,
        moe_ep_scheme=name.split("-", 1)[1] if sp else "auto",
    ).validate()


def _moe_counted(exchange, log: list, act_bytes: int):
    """`exchange` (the SP prefill's MoE EP exchange) wrapped to count its bytes and the formula's, per call."""
    from optimized.distributed import collectives as comm
    from optimized.distributed.prefill_plan import allgather_volume, alltoall_volume

    ep = exchange.moe_ep

    def counted(experts, hidden, topk_idx, topk_weight):  # bf16 only: the bench's weights are BF16
        n, h, k, local = hidden.shape[0], hidden.shape[1], topk_idx.shape[1], experts.local_experts
        ids = comm.all_gather(topk_idx, ep.group)  # outside the counter
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


def _decode_moe_counted(exchange, log: list, parallel, mc2: bool, num_experts: int, act_bytes: int):
    """`exchange` (a decode step's MoE exchange) wrapped to log, per call, each collective's bytes beside the
    formula's (with this routing's slot counts) and the formula's under uniform routing. mc2: the plan's decode path
    is MC2."""
    from optimized.distributed import collectives as comm
    from optimized.distributed.decode_plan import decode_volume, tokens_per_rank

    def counted(experts, hidden, topk_idx, topk_weight):
        b, h, k = hidden.shape[0], hidden.shape[1], topk_idx.shape[1]
        slots_out = slots_in = None
        if mc2:  # every rank holds all B tokens' ids; EP rank s dispatches [s*n, (s+1)*n)
            me, n = exchange.moe_ep.rank, tokens_per_rank(b, exchange.moe_ep.size)
            owner = topk_idx.long() // experts.local_experts
            source = torch.arange(b, device=topk_idx.device)[:, None] // n
            slots_out = int(((source == me) & (owner != me)).sum())
            slots_in = int(((owner == me) & (source != me)).sum())
        with comm.count_bytes() as counter:
            out = exchange(experts, hidden, topk_idx, topk_weight)
        log.append(
            {
                "measured": dict(counter.bytes),
                "formula": decode_volume(parallel, b, h, k, num_experts, act_bytes, slots_out, slots_in).parts,
                "uniform": decode_volume(parallel, b, h, k, num_experts, act_bytes).parts,
            }
        )
        return out

    return counted


class _CountedOwnRows:
    """The attention-DP decode's MC2 exchange (`own_rows`) wrapped to log, per call, each collective's bytes beside
    the formula's (this routing's slot counts, the padding rows left out) and the formula's under uniform routing."""

    def __init__(self, exchange, log: list, parallel, num_experts: int, act_bytes: int):
        self.exchange, self.log, self.parallel = exchange, log, parallel
        self.num_experts, self.act_bytes = num_experts, act_bytes

    def own_rows(self, active: int):
        import torch.distributed as dist

        from optimized.distributed import collectives as comm
        from optimized.distributed.decode_plan import decode_volume

        inner, ep, parallel = self.exchange.own_rows(active), self.exchange.moe_ep, self.parallel

        def counted(experts, hidden, topk_idx, topk_weight):
            n, h, k = hidden.shape[0], hidden.shape[1], topk_idx.shape[1]
            # Every rank's ids and real-row count, through torch.distributed itself so no byte counter sees them
            # (the EP group is the whole job under attention DP, in rank order).
            ids = topk_idx.new_empty((ep.size * n, k))
            dist.all_gather_into_tensor(ids, topk_idx.contiguous(), group=ep.group)
            mine = torch.tensor([active], dtype=torch.int64, device=hidden.device)
            actives = mine.new_empty(ep.size)
            dist.all_gather_into_tensor(actives, mine, group=ep.group)
            owner = ids.view(ep.size, n, k).long() // experts.local_experts
            source = torch.arange(ep.size, device=ids.device)[:, None, None]
            real = (torch.arange(n, device=ids.device)[None, :] < actives[:, None])[:, :, None]
            slots_out = int((real & (source == ep.rank) & (owner != ep.rank)).sum())
            slots_in = int((real & (owner == ep.rank) & (source != ep.rank)).sum())
            b = parallel.attn_dp_size * parallel.attn_tp_size * n  # a batch with these rows (every row real)
            with comm.count_bytes() as counter:
                out = inner(experts, hidden, topk_idx, topk_weight)
            self.log.append(
                {
                    "measured": dict(counter.bytes),
                    "formula": decode_volume(
                        parallel, b, h, k, self.num_experts, self.act_bytes, slots_out, slots_in
                    ).parts,
                    "uniform": decode_volume(parallel, b, h, k, self.num_experts, self.act_bytes).parts,
                }
            )
            return out

        return counted


def _count_calls(fn, log: list):
    """`fn` wrapped to log the bytes of each call's collectives (`comm.count_bytes`)."""
    from optimized.distributed import collectives as comm

    def counted(*a, **kw):
        with comm.count_bytes() as counter:
            out = fn(*a, **kw)
        log.append(dict(counter.bytes))
        return out

    return counted


def _add(parts: list[dict]) -> dict:
    out: dict = {}
    for p in parts:
        for op, b in p.items():
            out[op] = out.get(op, 0) + b
    return out


def _default_exchange(model):
    """The exchange a decode step without one uses: the MoE blocks' own `moe_infer_tp` (the same on every layer)."""
    return next(layer.mlp.moe_infer_tp for layer in model.layers if hasattr(layer.mlp, "moe_infer_tp"))


JOB_TIMEOUT_S = 1800  # a rank may wait this long for the others (a large preset builds slowly on a CPU)


def _build(config, parallel, args: dict, dtype, device):
    """A layout's model and runner through the assembly: the checkpoint's first --layers layers (--model-path), else
    random weights of the preset's shapes (args' seed), on the layout's plan (its paths, its MC2 window sized for the
    bench's batch; `model.paths` holds the paths)."""
    from optimized.executor import assembly

    if args["model_path"]:
        weights = assembly.WeightSource.from_checkpoint(
            args["model_path"], config, num_hidden_layers=config.num_hidden_layers
        )
    else:
        weights = assembly.WeightSource.random_weights(config, seed=args["seed"])
    plan = assembly.plan_for(weights, parallel, dtype=dtype, batch=args["batch"])
    return assembly.build_runner(
        weights, parallel, dtype=dtype, device=device, plan=plan, block_size=args["block_size"]
    )


def _bench_decode(layout: DecodeLayout, world: int, config, args: dict, prompts, device) -> dict:
    """Time one decode layout and count one decode step's bytes (every rank's, gathered on every rank)."""
    import torch.distributed as dist

    from optimized.benchmarks.common import DTYPES
    from optimized.path_plan import DP, MC2

    dtype = DTYPES[args["dtype"]]
    parallel = layout.config(world)
    t0 = time.perf_counter()
    model, runner = _build(config, parallel, args, dtype, device)
    build_s = time.perf_counter() - t0
    times: list[float] = []
    for r in range(args["warmup"] + args["repeats"]):
        dist.barrier()
        steps = runner.generate(prompts, args["decode_steps"] + 1).decode_seconds
        seconds = torch.tensor(steps, dtype=torch.float32, device=device)  # float32: every backend reduces it
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's step
        if r >= args["warmup"]:
            times.extend(float(t) for t in seconds)
    # One decode step counted: the whole forward, and each MoE layer's exchange beside its formula.
    step, moe_log, step_log = model.decode.step, [], []
    exchange, forward = step.exchange, runner.decode_forward
    dp = model.paths.decode == DP
    if dp:
        # The DP runner calls the model itself: the decode phase's layer loop and its logits are counted, and each
        # layer's attention on its own.
        phase, attn_log, logits_log = model.decode, [], []
        phase.run, phase.logits = _count_calls(phase.run, step_log), _count_calls(phase.logits, logits_log)
        for_step = step.for_step  # each step runs a per-step copy (`for_step`): count its attention

        def counted_step(*sizes, _for_step=for_step):
            copy = _for_step(*sizes)
            copy.attention = _count_calls(copy.attention, attn_log)
            return copy

        step.for_step = counted_step
        step.exchange = _CountedOwnRows(exchange, moe_log, parallel, config.num_experts, dtype.itemsize)
    else:
        step.exchange = _decode_moe_counted(
            exchange or _default_exchange(model),
            moe_log,
            parallel,
            model.paths.decode == MC2,
            config.num_experts,
            dtype.itemsize,
        )
        runner.decode_forward = _count_calls(forward, step_log)
    try:
        runner.generate(prompts, 2)  # one decode step
    finally:
        step.exchange, runner.decode_forward = exchange, forward
        if dp:
            del phase.run, phase.logits, step.for_step  # the class's methods again
    mine = {"step": step_log[0], "moe": moe_log}
    if dp:
        from optimized.distributed.decode_plan import by_collective, dp_step_volume

        mine["step"] = _add([step_log[0], logits_log[0]])
        mine["parts"] = {
            "attention": _add(attn_log),
            "moe": _add([m["measured"] for m in moe_log]),
            "lm_head": logits_log[0],
        }
        mine["step_formula"] = by_collective(
            dp_step_volume(config, parallel, len(prompts), dtype.itemsize, moe=_add([m["formula"] for m in moe_log]))
        )
        mine["attention_formula"] = dp_step_volume(config, parallel, len(prompts), dtype.itemsize)["attention"]
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    exchange_name = type(exchange or _default_exchange(model)).__name__
    del runner, model
    out = {
        "decode_ms": [1000 * t for t in times],
        "build_s": build_s,
        "what": layout.what,
        "exchange": exchange_name,
        "sizes": layout.sizes(world),
        "step_bytes": [g["step"] for g in gathered],
        "moe": [g["moe"] for g in gathered],
    }
    if dp:
        out.update({k: [g[k] for g in gathered] for k in ("parts", "step_formula", "attention_formula")})
    return out


def _worker(rank: int, world: int, init_file: str, args: dict, queue) -> None:
    import torch.distributed as dist

    from optimized import platform

    from optimized.benchmarks.common import DTYPES
    from optimized.distributed import collectives as comm
    from optimized.executor import assembly
    from optimized.path_plan import SP

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    assembly.join_job(init_method=f"file://{init_file}", rank=rank, world_size=world, timeout_s=JOB_TIMEOUT_S)
    device = platform.device(rank)
    try:
        dtype = DTYPES[args["dtype"]]
        config = model_config(args["preset"], args["layers"], args["model_path"])
        gen = torch.Generator().manual_seed(args["seed"])
        prompts = torch.randint(0, config.vocab_size, (args["batch"], args["prompt_len"]), generator=gen).tolist()
        report = {}
        for name in args["layouts"]:
            parallel = layout_config(name, world)
            t0 = time.perf_counter()
            model, runner = _build(config, parallel, args, dtype, device)
            build_s = time.perf_counter() - t0
            times = []
            for r in range(args["warmup"] + args["repeats"]):
                dist.barrier()
                seconds = torch.tensor([runner.generate(prompts, 1).prefill_seconds], device=device)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's prefill
                if r >= args["warmup"]:
                    times.append(float(seconds))
            with comm.count_bytes() as counter:
                runner.generate(prompts, 1)
            step_bytes = torch.tensor([counter.total], dtype=torch.float64, device=device)
            dist.all_reduce(step_bytes)
            moe_log: list = []
            if model.paths.prefill == SP:  # one more prefill with each MoE layer's bytes counted
                step = model.prefill.step
                exchange, step.exchange = step.exchange, _moe_counted(step.exchange, moe_log, dtype.itemsize)
                runner.generate(prompts, 1)
                step.exchange = exchange
            report[name] = {
                "prefill_ms": [1000 * t for t in times],
                "build_s": build_s,
                "scheme": model.ep_scheme,
                "bytes_per_rank": float(step_bytes) / world,
                "moe_rank0": moe_log,
            }
            del runner, model
        decode = {
            name: _bench_decode(DECODE_BY_NAME[name], world, config, args, prompts, device)
            for name in args["decode_layouts"]
        }
        if rank == 0:
            queue.put(("ok", {"prefill": report, "decode": decode}))
    except BaseException as e:  # report instead of leaving the parent waiting
        import traceback

        queue.put(("error", f"rank {rank}: {e!r}\n{traceback.format_exc()}"))
        raise
    finally:
        assembly.leave_job()


def run(args) -> dict:
    """Run the layouts over `args.world_size` processes; returns the report (printed by `format_report`)."""
    import multiprocessing as mp

    from optimized.benchmarks.common import progress
    from optimized.errors import UsageError

    world = args.world_size
    config = check_world(args)
    if args.prompt_len + args.decode_steps + 1 > config.max_position_embeddings:
        raise UsageError(
            f"--prompt-len + --decode-steps exceed max_position_embeddings ({config.max_position_embeddings})"
        )
    # A subset of the layouts (`args.prefill_layouts` / `args.decode_layouts`, names) is for library callers such as
    # the tests; the command line runs them all.
    prefill_layouts = list(getattr(args, "prefill_layouts", PREFILL_LAYOUTS))
    wanted = [DECODE_BY_NAME[n] for n in getattr(args, "decode_layouts", DECODE_BY_NAME)]
    skipped = {d.name: why for d in wanted if (why := d.skip(world, args.batch))}
    decode_layouts = [d for d in wanted if d.name not in skipped]
    params = dict(
        preset=args.preset,
        layers=args.layers,
        dtype=args.dtype,
        seed=args.seed,
        batch=args.batch,
        prompt_len=args.prompt_len,
        block_size=args.block_size,
        warmup=args.warmup,
        repeats=args.repeats,
        decode_steps=args.decode_steps,
        layouts=prefill_layouts,
        decode_layouts=[d.name for d in decode_layouts],
        model_path=getattr(args, "model_path", None),
    )
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bench_rdzv_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        progress(
            f"{world} processes, prefill layouts {', '.join(prefill_layouts) or 'none'}, decode layouts "
            f"{', '.join(params['decode_layouts'])} ..."
        )
        procs = [
            ctx.Process(target=_worker, args=(r, world, init_file, params, queue), daemon=True) for r in range(world)
        ]
        for p in procs:
            p.start()
        status, payload = queue.get()
        for p in procs:
            p.join(60 if status == "ok" else 5)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(f"multi-process bench failed: {payload}")
    return {
        "setup": {
            **params,
            "world_size": world,
            "tokens": args.batch * args.prompt_len,
            "weights": params["model_path"] or f"random (seed {args.seed})",
        },
        "layouts": payload["prefill"],
        "decode": payload["decode"],
        "decode_skipped": skipped,
        "decode_formula": formula(args, config),
    }


def check_world(args):
    """The bench's model config, once `--world-size` fits every layout of it (UsageError otherwise)."""
    from optimized.errors import UsageError

    world = args.world_size
    config = model_config(args.preset, args.layers, getattr(args, "model_path", None))
    for key, size in (
        ("num_attention_heads", config.num_attention_heads),
        ("num_experts", config.num_experts),
        ("vocab_size", config.vocab_size),
        ("moe_intermediate_size", config.moe_intermediate_size),
    ):
        if size % world:
            raise UsageError(f"--world-size {world} must divide the model's {key} ({size})")
    if config.num_key_value_heads % world and world % config.num_key_value_heads:
        raise UsageError(
            f"--world-size {world} must divide num_key_value_heads ({config.num_key_value_heads}) or be "
            f"a multiple of it"
        )
    return config


def model_config(preset: str, layers: int, model_path: str | None = None):
    """The shapes the bench runs: the checkpoint's config.json cut to `layers` (--model-path), else the preset's."""
    from optimized.benchmarks.common import bench_config
    from optimized.errors import UsageError

    if not model_path:
        return bench_config(preset, layers)
    from optimized.model_loader.hf_config import load_hf_config

    config = load_hf_config(model_path)  # a UsageError naming the file
    if not 1 <= layers <= config.num_hidden_layers:
        raise UsageError(f"--layers {layers} must be in [1, {config.num_hidden_layers}] for {model_path}")
    config.num_hidden_layers = layers
    return config


def formula(args, config=None) -> dict:
    """Each decode layout's MoE bytes per rank and decode step under uniform routing, at the model's full depth
    (`decode_plan.step_volume`), and the MC2 window an MC2 layout needs; nothing runs."""
    from optimized.benchmarks.common import DTYPES, full_layer_count
    from optimized.distributed import decode_plan

    config = config or check_world(args)
    model_path = getattr(args, "model_path", None)
    if model_path:  # the checkpoint's full depth
        from optimized.model_loader.hf_config import load_hf_config

        depth = load_hf_config(model_path).num_hidden_layers
    else:
        depth = full_layer_count(args.preset)
    act, world, layers = DTYPES[args.dtype].itemsize, args.world_size, depth
    out = {
        "preset": args.preset,
        "world_size": world,
        "batch": args.batch,
        "dtype": args.dtype,
        "moe_layers": decode_plan.moe_layer_count(config, layers),
        "layouts": {},
    }
    for layout in (d for d in DECODE_LAYOUTS if not d.sizes(world).get("attn_dp")):
        out["layouts"][layout.name] = _formula_entry(config, layout.config(world), args.batch, act, layers)
    # Attention DP: every split of the world into D >= 2 groups of attention TP world / D (the bench runs D = 2;
    # the recipe's attn4tp8dp_32ep is D = 8 at world 32).
    from optimized.config import ParallelConfig

    out["dp"], out["dp_skipped"] = {}, {}
    for d in (d for d in range(2, world + 1) if world % d == 0):
        name = f"dp-tp{world // d}x{d}"
        if args.batch % d:
            out["dp_skipped"][name] = f"--batch {args.batch} is not a multiple of attn_dp_size {d}"
            continue
        p = ParallelConfig(
            world_size=world,
            attn_tp_size=world // d,
            moe_tp_size=1,
            moe_ep_size=world,
            embed_tp_size=1,
            lmhead_tp_size=1,
            attn_dp=True,
        ).validate()
        entry = _formula_entry(config, p, args.batch, act, layers)
        parts = decode_plan.dp_step_volume(config, p, args.batch, act, layers)
        entry.update(
            rows=decode_plan.dp_rows(args.batch, p),
            step_parts=parts,
            step_total=sum(decode_plan.by_collective(parts).values()),
            attention_per_layer=decode_plan.attention_dp_volume(p, args.batch, config.hidden_size, act),
        )
        out["dp"][name] = entry
    # Expert load imbalance on a skewed routing, with and without expert load balancing, beside force_eplb's.
    from optimized.benchmarks import eplb_imbalance

    k = config.num_experts_per_tok
    out["eplb"] = eplb_imbalance.measure(config.num_experts, k, world, args.batch, (0, world, 2 * world))
    return out


def _formula_entry(config, p, batch: int, act: int, layers: int) -> dict:
    """A layout's bytes under uniform routing, and the MC2 window its plan (eager, `batch`) builds the group with."""
    from optimized.distributed import decode_plan
    from optimized.executor.plan import ExecutionPlan
    from optimized.layers.quantization.schemes import quant_scheme

    plan = ExecutionPlan.for_layout(config, p, quant=quant_scheme(config), batch=batch, act_bytes=act)
    one = decode_plan.decode_volume(p, batch, config.hidden_size, config.num_experts_per_tok, config.num_experts, act)
    return {
        "per_layer": one.parts,
        "per_step": decode_plan.step_volume(config, p, batch, act, layers).parts,
        "mc2_window_mb": plan.mc2_window_mb,
    }


def format_report(r: dict) -> str:
    s, lay = r["setup"], r["layouts"]
    if not lay:  # a decode-only subset (library callers)
        return "\n".join(format_decode(r)).lstrip("\n")
    lines = [
        f"prefill over {s['world_size']} processes: {s['preset']} shapes, {s['layers']} layer(s), {s['dtype']}, "
        f"batch {s['batch']} x {s['prompt_len']} tokens ({s['tokens']} packed); warm-up {s['warmup']}, "
        f"repeats {s['repeats']}; time of the slowest rank",
        "",
        f"{'layout':<16}{'EP scheme':>12}{'median ms':>12}{'best ms':>10}{'vs tp (best)':>14}{'sent/rank/prefill':>20}",
    ]
    tp_best = summarize([m / 1000 for m in lay["tp"]["prefill_ms"]])["min"] if "tp" in lay else math.nan
    for name, v in lay.items():
        st = summarize([m / 1000 for m in v["prefill_ms"]])
        lines.append(
            f"{name:<16}{v['scheme'] or '-':>12}{st['median']:>12.2f}{st['min']:>10.2f}"
            f"{tp_best / st['min']:>13.2f}x{v['bytes_per_rank'] / 1e6:>17.2f} MB"
        )
    lines += [
        "",
        "MoE EP bytes per layer sent by rank 0: measured (comm.count_bytes) vs formula (prefill_plan, with "
        "the routing's slot counts) vs formula under uniform routing",
    ]
    for name, v in lay.items():
        for i, m in enumerate(v["moe_rank0"]):
            lines.append(
                f"  {name:<14} MoE layer {i}: measured {m['measured']:>12,d} B   formula "
                f"{m['formula']:>12,d} B   uniform {m['uniform']:>12,d} B"
            )
    return "\n".join(lines + format_decode(r))


def _kb(n: float) -> str:
    return f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.2f} MB"


def _parts(parts: dict) -> str:
    return ", ".join(f"{op} {b:,d} B" for op, b in parts.items())


def _sizes(sizes: dict, world: int) -> str:
    if sizes.get("attn_dp"):
        t = sizes["attn_tp_size"]
        return f"attn_tp {t} x dp {world // t}, moe_tp {sizes['moe_tp_size']}, moe_ep {sizes['moe_ep_size']}, lm 1"
    return ", ".join(f"{k.replace('_size', '')} {n}" for k, n in sizes.items())


def format_decode(r: dict) -> list[str]:
    s, dec = r["setup"], r["decode"]
    lines = [
        "",
        f"decode over {s['world_size']} processes: batch {s['batch']}, prompt {s['prompt_len']}, "
        f"{s['decode_steps']} decode steps per round; warm-up {s['warmup']}, repeats {s['repeats']}; time "
        f"per step of the slowest rank",
        "",
        f"{'layout':<8}{'sizes':<40}{'median ms':>10}{'best ms':>10}{'vs tp (best)':>14}"
        f"{'MoE sent/rank/step':>20}{'all sent/rank/step':>20}   decode MoE path",
    ]
    best = {name: summarize([m / 1000 for m in v["decode_ms"]])["min"] for name, v in dec.items()}
    for name, v in dec.items():
        st = summarize([m / 1000 for m in v["decode_ms"]])
        sizes = _sizes(v["sizes"], s["world_size"])
        moe = sum(sum(m["measured"].values()) for m in v["moe"][0])
        step = sum(v["step_bytes"][0].values())
        lines.append(
            f"{name:<8}{sizes:<40}{st['median']:>10.2f}{st['min']:>10.2f}"
            f"{best.get('tp', math.nan) / st['min']:>13.2f}x{_kb(moe):>20}{_kb(step):>20}   {v['what']}"
        )
    for name, why in r.get("decode_skipped", {}).items():
        lines.append(f"{name:<8}skipped: {why}")
    lines += [
        "",
        "bytes of one decode step sent by rank 0, per collective (comm.count_bytes; MoE, attention, "
        "embedding, lm_head):",
    ]
    for name, v in dec.items():
        lines.append(f"  {name:<6} {_parts(v['step_bytes'][0])}")
        if "parts" in v:
            for part, ops in v["parts"][0].items():
                lines.append(f"  {'':<6}   {part}: {_parts(ops) or 'nothing'}")
    lines += [
        "",
        "MoE bytes per layer of one decode step, per collective: measured (comm.count_bytes) vs formula "
        "(decode_plan.decode_volume with the routing's slot counts) vs formula under uniform routing; "
        "rank 0 shown, every rank compared",
    ]
    for name, v in dec.items():
        for i, m in enumerate(v["moe"][0]):
            for op, want in m["formula"].items():
                lines.append(
                    f"  {name:<6} MoE layer {i}  {op:<32} measured {m['measured'].get(op, 0):>12,d} B   "
                    f"formula {want:>12,d} B   uniform {m['uniform'][op]:>12,d} B"
                )
        bad = [
            (rank, i) for rank, logs in enumerate(v["moe"]) for i, m in enumerate(logs) if m["measured"] != m["formula"]
        ]
        lines.append(
            f"  {name:<6} every rank, every MoE layer: measured == formula: "
            + ("yes" if not bad else f"NO (rank, layer) {bad}")
        )
    for name, v in dec.items():
        if "step_formula" not in v:
            continue
        lines += [
            "",
            f"{name}: attention per decode step (all layers), rank 0: measured {_parts(v['parts'][0]['attention'])}"
            f"; formula (decode_plan.attention_dp_volume) {_parts(v['attention_formula'][0])}",
            f"{name}: whole decode step, rank 0: measured {_parts(v['step_bytes'][0])}; formula "
            f"(decode_plan.dp_step_volume, the routing's slot counts) {_parts(v['step_formula'][0])}",
        ]
        bad = [
            rank
            for rank in range(len(v["step_bytes"]))
            if v["parts"][rank]["attention"] != v["attention_formula"][rank]
            or v["step_bytes"][rank] != v["step_formula"][rank]
        ]
        lines.append(
            f"  {name:<6} every rank: attention and whole step measured == formula: "
            + ("yes" if not bad else f"NO ranks {bad}")
        )
    return lines + format_formula(r["decode_formula"])


def format_formula(f: dict) -> list[str]:
    lines = [
        "",
        f"formula (decode_plan, uniform routing), {f['preset']} at full depth ({f['moe_layers']} MoE layers), "
        f"batch {f['batch']}, {f['dtype']}, {f['world_size']} ranks: MoE bytes per rank",
    ]
    for name, v in f["layouts"].items():
        buffer = "" if v["mc2_window_mb"] is None else f"; MC2 window {v['mc2_window_mb']} MB (its own HCCL group)"
        lines.append(
            f"  {name:<6} per layer: {_parts(v['per_layer'])} = {sum(v['per_layer'].values()):,d} B; "
            f"per decode step: {sum(v['per_step'].values()):,d} B{buffer}"
        )
    if f.get("dp") or f.get("dp_skipped"):
        lines += [
            "",
            "attention DP (attention TP x DP groups, embedding / lm_head TP 1, MC2 over every rank on its "
            "own rows, no all_gather): MoE bytes per rank, and the whole decode step's (attention "
            "all_gather + reduce_scatter per layer, MoE, lm_head's hidden-state all_gather)",
        ]
    for name, v in f.get("dp", {}).items():
        per = sum(v["per_layer"].values())
        lines.append(
            f"  {name:<11} {v['rows']} row(s) per rank; MoE per layer: {_parts(v['per_layer'])} = {per:,d} B; "
            f"attention per layer: {_parts(v['attention_per_layer']) or 'nothing'}; per decode step: MoE "
            f"{sum(v['per_step'].values()):,d} B + attention {sum(v['step_parts']['attention'].values()):,d} B"
            f" + lm_head {sum(v['step_parts']['lm_head'].values()):,d} B = {v['step_total']:,d} B; "
            f"MC2 window {v['mc2_window_mb']} MB"
        )
    for name, why in f.get("dp_skipped", {}).items():
        lines.append(f"  {name:<11} skipped: {why}")
    if f.get("eplb"):
        from optimized.benchmarks import eplb_imbalance

        lines += eplb_imbalance.format_lines(f["eplb"], f["world_size"], f["batch"])
    return lines
