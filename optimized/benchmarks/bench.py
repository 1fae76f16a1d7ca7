"""Latency of one device: the reference, the optimized model and HF transformers on the same weights,
beside the memory-bandwidth floor. `python -m optimized bench --help`.

`run(args)` (single process, greedy, a batch of random prompts of `--prompt-len` ids): per model, a prefill to the
first token's logits and `--decode-steps` decode steps, each with a device sync; `--warmup` discarded and `--repeats`
timed rounds, the models interleaved round by round so background load hits all alike; median, p90 and best, and the
ratios of medians and of best samples. Weights: `RandomWeights(seed)` at the preset's shapes, loaded into the
reference; the optimized model reads its state_dict and transformers shares the same tensors (experts stacked into
its fused layout). Beside the timings: the decode floor (optimized/benchmarks/floor.py at the copy bandwidth measured
in every round), the lm_head GEMV's own bandwidth, and the token agreement judged tie-aware (greedy_ties.py).
`--host-overhead`, `--exe-mode`, the sweeps and `--world-size N` (bench_parallel.py) are modes of the same command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from optimized import platform
from optimized.benchmarks import graph_gain
from optimized.benchmarks.latency import summarize
from optimized.benchmarks.reference_timing import reference_model, reference_shapes, time_reference
from optimized.config import EXE_MODES
from optimized.ops import cpu_gemm
from optimized.errors import UsageError
from optimized.benchmarks.common import BENCH_PRESETS, DTYPES, GB, bench_config, full_layer_count, progress


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default="qwen3_30b_a3b",
        choices=sorted(BENCH_PRESETS),
        help="model shapes: a released model's, or the tiny fixture's (default qwen3_30b_a3b)",
    )
    p.add_argument("--layers", type=int, default=2, help="decoder layers to build (default 2)")
    p.add_argument("--batch", type=int, default=1, help="requests per step (default 1)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length in tokens (default 128)")
    p.add_argument("--decode-steps", type=int, default=8, help="timed decode steps per round (default 8)")
    p.add_argument("--warmup", type=int, default=1, help="discarded rounds (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--block-size", type=int, default=128, help="optimized model's KV block size (multiple of 16)")
    p.add_argument("--seed", type=int, default=0, help="random weights and prompts")
    p.add_argument("--skip-hf", action="store_true", help="do not build HF transformers' model")
    p.add_argument(
        "--no-weight-nz",
        dest="weight_nz",
        action="store_false",
        help="build the optimized model with ND weights (model_config.enable_weight_nz: false; default: NZ, as every "
        "recipe file)",
    )
    p.add_argument(
        "--exe-mode",
        choices=EXE_MODES,
        default="eager",
        help="also time the optimized model's decode as a compiled graph (ge_graph / acl_graph), "
        "with its cold vs cached start-up (default eager: no graph)",
    )
    p.add_argument(
        "--kv-pool-blocks",
        type=int,
        default=None,
        metavar="N",
        help="KV pool of the optimized model: N blocks per layer, the null block included (default: the "
        "blocks the requests need)",
    )
    p.add_argument(
        "--pool-sweep",
        type=_int_list("--pool-sweep"),
        default=None,
        metavar="X,Y,...",
        help="also time the optimized decode with the KV pool at these multiples of the needed blocks "
        "(e.g. 1,8): decode should not depend on the pool size",
    )
    p.add_argument(
        "--context-sweep",
        type=_int_list("--context-sweep"),
        default=None,
        metavar="L1,L2,...",
        help="also time the optimized decode at these prompt lengths (e.g. 128,1024,4096): decode grows "
        "with the KV bytes read, beside the floor at each length",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="also time the optimized model in model_config.batch_invariant mode (row-by-row GEMMs: a request's "
        "logits do not depend on its batch), its cost in the ratios beside the default mode",
    )
    p.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    p.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="> 1: over this many processes, the prefill tensor-parallel vs sequence-parallel with each "
        "MoE EP scheme, and the decode tensor-parallel vs MC2 expert-parallel, with the bytes of "
        "each collective beside the formula (optimized/benchmarks/bench_parallel.py; --skip-hf and "
        "--exe-mode do not apply)",
    )
    p.add_argument(
        "--model-path",
        metavar="DIR",
        help="with --world-size > 1: the first --layers layers of this checkpoint instead of random weights of "
        "--preset's shapes",
    )
    p.add_argument(
        "--host-overhead",
        action="store_true",
        help="measure only the engine's host overhead per decode step (step wall time minus the model "
        "forward's) at --host-overhead-batches; builds the optimized model alone "
        "(optimized/benchmarks/host_overhead.py)",
    )
    p.add_argument(
        "--host-overhead-batches",
        type=_int_list("--host-overhead-batches"),
        default=[1, 16],
        metavar="B1,B2,...",
        help="batches of --host-overhead (default 1,16)",
    )
    p.add_argument(
        "--host-overhead-overlap",
        action="store_true",
        help="with --host-overhead: each batch also with overlapped scheduling (scheduler_config.async_scheduling), "
        "side by side",
    )
    p.add_argument(
        "--formula-only",
        action="store_true",
        help="with --world-size > 1: print only the decode layouts' MoE bytes per rank and the MC2 "
        "MC2 window from the formula, at the preset's full depth; builds and runs nothing",
    )


def _int_list(flag: str):
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated integers >= 1; got {text!r}") from None
        if not values or any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated integers >= 1; got {text!r}")
        return values

    return parse


def synchronize() -> None:
    platform.synchronize(platform.device())


# ----------------------------------------------------------------------------------------------- models


def hf_model(config, reference, dtype: torch.dtype):
    """transformers' Qwen3MoeForCausalLM on the reference's tensors (experts stacked, the rest shared)."""
    import transformers
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

    sd = reference.state_dict()
    out: dict[str, torch.Tensor] = {}
    experts = {}
    for name, t in sd.items():
        parts = name.split(".")
        if ".mlp.experts." in name:  # model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
            experts.setdefault(".".join(parts[:5]), {})[(int(parts[5]), parts[6])] = t
        else:
            out[name] = t
    for prefix, tensors in experts.items():
        n = 1 + max(e for e, _ in tensors)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[(e, "gate_proj")], tensors[(e, "up_proj")]]) for e in range(n)]
        )  # [E, 2I, H]
        out[f"{prefix}.down_proj"] = torch.stack([tensors[(e, "down_proj")] for e in range(n)])  # [E, H, I]
    config = type(config).from_dict(config.to_dict())
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    model.load_state_dict(out, strict=True, assign=True)
    model.model.rotary_emb = hf.Qwen3MoeRotaryEmbedding(config)  # its buffers are not in the state dict
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"transformers model buffers left on the meta device: {left}")
    return model.to(dtype).eval()


# --------------------------------------------------------------------------------------------- timing


def run_reference(model, ids: torch.Tensor, steps: int):
    return time_reference(model, ids, steps, sync=synchronize)


def run_optimized(runner, ids: torch.Tensor, steps: int):
    result = runner.generate(ids.tolist(), steps + 1)
    return result.prefill_seconds, list(result.decode_seconds), result.tokens


@torch.no_grad()
def run_hf(model, ids: torch.Tensor, steps: int):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    synchronize()
    prefill, decode, tokens = time.perf_counter() - start, [], [token]
    for _ in range(steps):
        start = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        synchronize()
        decode.append(time.perf_counter() - start)
        tokens.append(token)
    return prefill, decode, torch.cat(tokens, 1).tolist()


# ------------------------------------------------------------------------------------------------ run


def _available_memory() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _agreement(reference, ids: torch.Tensor, a: list[list[int]], b: list[list[int]], dtype: torch.dtype) -> str:
    """'same', or how many leading tokens agree and whether the first difference is a near-tie or a divergence:
    the reference teacher-forced on b's own tokens, judged by optimized.benchmarks.greedy_ties (the reference's
    top-2 margin there against the logit noise of `dtype`, and the agreement after teacher forcing)."""
    if a == b:
        return "same"
    from optimized.benchmarks.greedy_ties import LOGIT_NOISE, judge_tokens, merge

    lead = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra)) for ra, rb in zip(a, b)]
    device = next(reference.parameters()).device
    cand = torch.tensor(b, device=device)  # [B, N]
    with torch.no_grad():
        logits = reference(torch.cat([ids.to(device), cand[:, :-1]], 1), None)[:, ids.shape[1] - 1 :]  # [B, N, V]
    atol, rtol = LOGIT_NOISE[dtype]
    judged = merge([judge_tokens(logits[i], cand[i], atol, rtol) for i in range(cand.shape[0])])
    return f"differ (first {min(lead)} of {len(a[0])} tokens agree): {judged.verdict()}"


def run(args) -> int:
    for name in ("layers", "batch", "prompt_len", "decode_steps", "repeats", "block_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0; got {args.warmup}")
    if args.kv_pool_blocks is not None and args.kv_pool_blocks < 2:
        raise UsageError(f"--kv-pool-blocks must be >= 2 (block 0 is the null block); got {args.kv_pool_blocks}")
    if args.block_size % 16:
        raise UsageError(f"--block-size must be a multiple of 16; got {args.block_size}")
    if args.json:
        json_path = Path(args.json)
        if not json_path.parent.is_dir():
            raise UsageError(f"--json: directory {str(json_path.parent)!r} does not exist")
    if args.world_size < 1:
        raise UsageError(f"--world-size must be >= 1; got {args.world_size}")
    if args.formula_only and args.world_size < 2:
        raise UsageError(f"--formula-only needs --world-size > 1; got {args.world_size}")
    if args.host_overhead_overlap and not args.host_overhead:
        raise UsageError("--host-overhead-overlap is a mode of --host-overhead: give both")
    if args.model_path and (args.world_size < 2 or args.formula_only):
        raise UsageError(
            "--model-path is for the parallel bench's runs (--world-size > 1, not --formula-only); the "
            "single-process bench compares random weights with the reference's"
        )
    if args.world_size > 1:
        from optimized.benchmarks import bench_parallel

        if args.formula_only:
            f = bench_parallel.formula(args)
            print("\n".join(bench_parallel.format_formula(f)).lstrip("\n"))
            if args.json:
                Path(args.json).write_text(json.dumps(f, indent=2) + "\n")
            return 0
        report = bench_parallel.run(args)
        print(bench_parallel.format_report(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        return 0

    from optimized.executor.model_runner import ModelRunner
    from optimized.executor.assembly import WeightSource, build_model
    from optimized.model_loader.loader import StateDictSource

    dtype = DTYPES[args.dtype]
    config = bench_config(args.preset, args.layers)
    if args.host_overhead:
        from optimized.benchmarks import host_overhead

        rows = host_overhead.run(config, dtype, args, args.host_overhead_batches, progress)
        what = f"{BENCH_PRESETS[args.preset]}, {args.layers} layer(s), {args.dtype}, prompt {args.prompt_len}"
        print(host_overhead.format_report(rows, what))
        if args.json:
            Path(args.json).write_text(json.dumps({"host_overhead": rows, "what": what}, indent=2) + "\n")
        return 0
    full_layers = full_layer_count(args.preset)
    for length in [args.prompt_len] + list(args.context_sweep or []):
        if length + args.decode_steps + 1 > config.max_position_embeddings:
            raise UsageError(
                f"--prompt-len / --context-sweep {length} + --decode-steps exceed max_position_embeddings "
                f"({config.max_position_embeddings})"
            )
    needed = 1 + args.batch * -(-(args.prompt_len + args.decode_steps + 1) // args.block_size)
    if args.kv_pool_blocks is not None and args.kv_pool_blocks < needed:
        raise UsageError(
            f"--kv-pool-blocks {args.kv_pool_blocks} is too small: batch {args.batch} x (prompt "
            f"{args.prompt_len} + {args.decode_steps + 1} new tokens) needs {needed} blocks of "
            f"{args.block_size} (the null block included)"
        )
    size = torch.finfo(dtype).bits // 8
    shapes = reference_shapes(config)
    params = sum(t.numel() for t in shapes.values())
    expert_params = sum(t.numel() for n, t in shapes.items() if ".mlp.experts." in n)
    model_bytes, expert_bytes = params * size, expert_params * size
    # On a CPU the optimized model's bf16 weights also get oneDNN's packed copies as they run (ops/cpu_gemm.py).
    packed = model_bytes if platform.backend_name() == "cpu" and dtype == torch.bfloat16 and cpu_gemm.ONEDNN_BF16 else 0
    need = 2 * model_bytes + packed + (0 if args.skip_hf else expert_bytes)
    avail = _available_memory()
    hf_note, hf_impl = None, None
    if avail is not None and 1.1 * (2 * model_bytes + packed) > avail:
        raise UsageError(
            f"reference + optimized models need ~{(2 * model_bytes + packed) / GB:.1f} GB"
            f"{' (packed CPU weights included)' if packed else ''}, only {avail / GB:.1f} GB available; "
            f"use fewer --layers"
        )
    if not args.skip_hf and avail is not None and 1.1 * need > avail:
        args.skip_hf = True
        hf_note = f"HF transformers skipped: all three models need ~{need / GB:.1f} GB, {avail / GB:.1f} GB available"
        progress(hf_note)

    name = BENCH_PRESETS[args.preset]
    progress(
        f"{name}: {args.layers} layer(s), {args.dtype}, ~{model_bytes / GB:.2f} GB per model "
        f"({expert_bytes / GB:.2f} GB experts); {torch.get_num_threads()} threads"
    )
    t0 = time.perf_counter()
    progress("building the reference model (random weights, seed %d) ..." % args.seed)
    from optimized.model_loader.loader import RandomWeights

    ref = reference_model(config, RandomWeights(args.seed).read, dtype)
    progress(f"  done in {time.perf_counter() - t0:.1f} s; building the optimized model from its state_dict ...")
    t0 = time.perf_counter()
    weights = WeightSource(config, source=StateDictSource(ref.state_dict(), label="reference state_dict"))
    opt = build_model(weights, dtype=dtype, weight_nz=args.weight_nz)
    runner = ModelRunner(opt, args.block_size, kv_pool_blocks=args.kv_pool_blocks)
    progress(f"  done in {time.perf_counter() - t0:.1f} s")
    models = {"reference": (run_reference, ref), "optimized": (run_optimized, runner)}
    if args.batch_invariant:
        invariant = ModelRunner(opt, args.block_size, kv_pool_blocks=args.kv_pool_blocks, batch_invariant=True)
        models["batch_invariant"] = (run_optimized, invariant)
    startup = None
    if args.exe_mode != "eager":
        graph_runner, startup = graph_startup(opt, args, config)
        models["graph"] = (run_optimized, graph_runner)
    if not args.skip_hf:
        t0 = time.perf_counter()
        progress("building HF transformers' model (experts stacked, other tensors shared) ...")
        hf = hf_model(config, ref, dtype)
        models["hf"] = (run_hf, hf)
        hf_impl = (
            f"experts {getattr(hf.config, '_experts_implementation', None)}, "
            f"attention {getattr(hf.config, '_attn_implementation', None)}"
        )
        progress(
            f"  done in {time.perf_counter() - t0:.1f} s (experts implementation: "
            f"{getattr(hf.config, '_experts_implementation', None)}, attention: "
            f"{getattr(hf.config, '_attn_implementation', None)})"
        )

    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len), generator=gen)
    samples = {m: {"prefill": [], "decode": []} for m in models}
    tokens: dict[str, list] = {}
    rounds = args.warmup + args.repeats
    opt_device = next(opt.parameters()).device
    bandwidths, gemv_seconds = [], []
    for r in range(rounds):
        timed = r >= args.warmup
        if timed:
            # The floor's bandwidth and the GEMV ceiling, measured beside this round's timings (the same load).
            bandwidths.append(device_copy_bandwidth(opt_device))
            gemv_seconds.append(lm_head_seconds(opt, args.batch, dtype))
        for m, (fn, model) in models.items():
            t0 = time.perf_counter()
            prefill, decode, toks = fn(model, ids, args.decode_steps)
            tokens[m] = toks
            if timed:
                samples[m]["prefill"].append(prefill)
                samples[m]["decode"].extend(decode)
            progress(
                f"round {r + 1}/{rounds} ({'timed' if timed else 'warm-up'}) {m}: prefill "
                f"{1000 * prefill:.1f} ms, decode {1000 * statistics.median(decode):.1f} ms/token "
                f"({time.perf_counter() - t0:.1f} s)"
            )

    # The floor is the optimized model's: bytes over the bandwidth of the memory its weights are in (HBM on an
    # accelerator, timed with a device sync; the CPU's copy bandwidth on the CPU).
    bandwidth = statistics.median(bandwidths)
    lm_head_bytes = sum(t.numel() * t.element_size() for t in opt.lm_head.parameters())
    gemv_bandwidth = lm_head_bytes / statistics.median(gemv_seconds)
    context = args.prompt_len + (args.decode_steps + 1) / 2

    results = {
        m: {"prefill_ms": summarize(s["prefill"]), "decode_ms_per_token": summarize(s["decode"])}
        for m, s in samples.items()
    }
    ratios = {}
    for m in models:
        if m == "optimized":
            continue
        ratios[f"{m}/optimized"] = {
            f"{phase}{suffix}": results[m][key][stat] / results["optimized"][key][stat]
            for stat, suffix in (("median", ""), ("min", "_best"))
            for phase, key in (("prefill", "prefill_ms"), ("decode", "decode_ms_per_token"))
        }
    from optimized.benchmarks.floor import cpu_hardware, decode_floor

    hardware = cpu_hardware(bandwidth)
    floor = decode_floor(config, hardware, dtype, args.batch, context)
    full = decode_floor(config, hardware, dtype, args.batch, context, num_layers=full_layers)
    floor_ms = 1000 * floor["floor_s"]
    report = {
        "setup": {
            "preset": name,
            "layers": args.layers,
            "full_layers": full_layers,
            "dtype": args.dtype,
            "weight_nz": args.weight_nz,
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "decode_steps": args.decode_steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "block_size": args.block_size,
            "seed": args.seed,
            "threads": torch.get_num_threads(),
            "device": str(opt_device),
            "torch": torch.__version__,
            "hf": "skipped" if args.skip_hf else "measured",
            "batch_invariant": bool(args.batch_invariant),
            "hf_note": hf_note,
            "hf_implementation": hf_impl,
        },
        "results": results,
        "ratios": ratios,
        "tokens": {
            m: _agreement(ref, ids, tokens["reference"], t, dtype) for m, t in tokens.items() if m != "reference"
        },
        "floor": {
            "copy_bandwidth_gb_s": bandwidth / GB,
            "bytes_per_decode_step": floor["bytes"],
            "floor_ms_per_token": floor_ms,
            "optimized_over_floor": results["optimized"]["decode_ms_per_token"]["median"] / floor_ms,
            "copy_bandwidth_gb_s_per_round": [b / GB for b in bandwidths],
            "lm_head_gemv_gb_s": gemv_bandwidth / GB,
            "floor_at_gemv_bandwidth_ms_per_token": floor_ms * bandwidth / gemv_bandwidth,
            "full_model_bytes_per_decode_step": full["bytes"]["total"],
            "full_model_floor_ms_per_token": 1000 * full["floor_s"],
        },
    }
    if startup is not None:
        report["graph"] = graph_report(report, startup, args.exe_mode)
        progress("graph gain bound: profiling one round of graph decode ...")
        bound = graph_gain.measure(
            models["graph"][1],
            ids.tolist(),
            args.decode_steps,
            eager_ms=results["optimized"]["decode_ms_per_token"]["median"],
            graph_ms=results["graph"]["decode_ms_per_token"]["median"],
        )
        if bound is not None:
            report["graph"]["gain_bound"] = bound
    if args.pool_sweep or args.context_sweep:
        decoders = {"optimized": runner.decode_forward}
        if "graph" in models:
            decoders["graph"] = models["graph"][1].decode_forward
        report["sweeps"] = sweeps(opt, decoders, args, config, dtype, hardware)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        progress(f"wrote {args.json}")
    return 0


def lm_head_seconds(model, batch: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """Median seconds of the model's lm_head alone on `batch` hidden rows (a decode step's largest GEMV)."""
    from optimized.benchmarks.latency import measure

    weight = next(model.lm_head.parameters())
    x = torch.zeros(batch, model.lm_head.in_features, dtype=dtype, device=weight.device)
    with torch.no_grad():
        seconds = measure(lambda: model.lm_head(x), warmup=1, repeats=repeats, sync=synchronize)
    return statistics.median(seconds)


def device_copy_bandwidth(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 3) -> float:
    """Bytes moved per second (read + write) by a large copy on `device`, median of `repeats`."""
    from optimized.benchmarks.latency import copy_bandwidth, measure

    if device.type == "cpu":
        return copy_bandwidth(nbytes=nbytes, repeats=repeats)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = measure(lambda: dst.copy_(src), warmup=1, repeats=repeats, sync=lambda: platform.synchronize(device))
    return 2 * nbytes / statistics.median(seconds)


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def _mb(n: float) -> str:
    if n < 1e6:
        return f"{n / 1e3:.1f} kB"
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.3f} GB"


def format_report(r: dict) -> str:
    s, res, fl = r["setup"], r["results"], r["floor"]
    labels = {
        "reference": "reference",
        "optimized": "optimized",
        "hf": "HF transformers",
        "graph": f"optimized {r.get('graph', {}).get('exe_mode', 'graph')}",
        "batch_invariant": "batch_invariant",
    }
    lines = [
        f"{s['preset']} shapes, {s['layers']} of {s['full_layers']} layers, {s['dtype']}, "
        f"{'NZ' if s.get('weight_nz', True) else 'ND'} weights, batch {s['batch']}, "
        f"prompt {s['prompt_len']}, {s['decode_steps']} decode steps; warm-up {s['warmup']}, repeats "
        f"{s['repeats']}; {s['device']}, {s['threads']} threads",
        "",
        f"{'':<18}{'prefill ms':>32}{'decode ms/token':>34}",
        f"{'model':<18}{'median':>12}{'p90':>10}{'best':>10}{'median':>14}{'p90':>10}{'best':>10}",
    ]
    for m, v in res.items():
        p, d = v["prefill_ms"], v["decode_ms_per_token"]
        lines.append(
            f"{labels[m]:<18}{p['median']:>12.2f}{p['p90']:>10.2f}{p['min']:>10.2f}"
            f"{d['median']:>14.2f}{d['p90']:>10.2f}{d['min']:>10.2f}"
        )
    if s["hf_implementation"]:
        lines.append(f"(HF transformers {transformers_version()}: {s['hf_implementation']})")
    if s["hf_note"]:
        lines.append(f"({s['hf_note']})")
    elif s["hf"] == "skipped":
        lines.append("(HF transformers skipped: --skip-hf)")
    lines += [
        "",
        "ratios (time of the other model / optimized, this run; > 1 means the optimized model is faster;"
        " 'best' uses the fastest samples, robust to background load)",
    ]
    for name, v in r["ratios"].items():
        lines.append(
            f"  {name:<20} prefill {v['prefill']:>6.2f}x (best {v['prefill_best']:.2f}x)   "
            f"decode {v['decode']:>6.2f}x (best {v['decode_best']:.2f}x)"
        )
    for m, verdict in r["tokens"].items():
        lines.append(f"  generated tokens, {labels[m]} vs reference: {verdict}")
    b = fl["bytes_per_decode_step"]
    lines += [
        "",
        "memory-bandwidth floor (decode reads every active weight once per step)",
        f"  bytes per decode step: {_mb(b['total'])} (attention {_mb(b['attention'])}, router {_mb(b['router'])}, "
        f"experts {_mb(b['experts'])} [{b['active_experts_per_layer']:.1f} per layer], dense MLP "
        f"{_mb(b['dense_mlp'])}, lm_head+norm+embedding {_mb(b['lm_head_norm_embedding'])}, "
        f"KV cache {_mb(b['kv_cache'])})",
        f"  copy bandwidth (read+write, median of the timed rounds): {fl['copy_bandwidth_gb_s']:.1f} GB/s "
        f"(rounds {min(fl['copy_bandwidth_gb_s_per_round']):.1f}-{max(fl['copy_bandwidth_gb_s_per_round']):.1f})",
        f"  floor: {fl['floor_ms_per_token']:.2f} ms/token; optimized decode / floor = "
        f"{fl['optimized_over_floor']:.2f}x",
        f"  kernel ceiling: the lm_head GEMV alone reads {fl['lm_head_gemv_gb_s']:.1f} GB/s "
        f"({fl['lm_head_gemv_gb_s'] / fl['copy_bandwidth_gb_s']:.0%} of the copy bandwidth); the floor at that "
        f"bandwidth is {fl['floor_at_gemv_bandwidth_ms_per_token']:.2f} ms/token, optimized decode / that = "
        f"{res['optimized']['decode_ms_per_token']['median'] / fl['floor_at_gemv_bandwidth_ms_per_token']:.2f}x",
    ]
    if "graph" in r:
        lines += format_graph(r["graph"])
    if "sweeps" in r:
        lines += format_sweeps(r["sweeps"])
    if s["full_layers"] != s["layers"]:
        lines.append(
            f"  full model ({s['full_layers']} layers): {_mb(fl['full_model_bytes_per_decode_step'])} "
            f"per decode step, floor {fl['full_model_floor_ms_per_token']:.1f} ms/token at this bandwidth"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ graph mode


def graph_startup(model, args, config):
    """A runner whose decode is the compiled graph, and its start-up: the first decode call compiling
    from nothing (a fresh compile cache, hence a fresh inductor cache directory), then, after a dynamo
    reset, loading what that compile cached. Both in this process (imports are already paid)."""
    import tempfile

    from optimized.executor.compile_cache import CompileCache
    from optimized.forward_metadata import batch_bucket
    from optimized.executor.model_runner import ModelRunner

    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len), generator=gen).tolist()
    cache = CompileCache(Path(tempfile.mkdtemp(prefix="bench_compile_cache_")))
    times = {}
    for phase in ("cold", "cached"):
        torch._dynamo.reset()
        runner = ModelRunner(model, args.block_size, exe_mode=args.exe_mode, compile_cache=cache)
        progress(f"graph start-up, {phase}: first decode call ({'compiling' if phase == 'cold' else 'from cache'}) ...")
        runner.generate(ids, 2)
        times[phase] = runner.decode_forward.startup[batch_bucket(args.batch)]
        progress(f"  {times[phase].source} in {times[phase].seconds:.1f} s")
    return runner, {
        "cold": times["cold"],
        "cached": times["cached"],
        "cache_dir": str(cache.root),
        "decoder": runner.decode_forward,
    }


def graph_report(report: dict, startup: dict, exe_mode: str) -> dict:
    res, floor_ms = report["results"], report["floor"]["floor_ms_per_token"]
    g = res["graph"]["decode_ms_per_token"]
    out = {
        "exe_mode": exe_mode,
        "lines": startup["decoder"].describe(),
        "startup_s": {
            "cold": startup["cold"].seconds,
            "cached": startup["cached"].seconds,
            "cold_source": startup["cold"].source,
            "cached_source": startup["cached"].source,
        },
        "cold_over_cached": startup["cold"].seconds / startup["cached"].seconds,
        "graph_over_floor": g["median"] / floor_ms,
    }
    for m in ("optimized", "hf", "reference"):
        if m in res:
            d = res[m]["decode_ms_per_token"]
            out[f"{m}_over_graph"] = {"decode": d["median"] / g["median"], "decode_best": d["min"] / g["min"]}
    return out


def format_graph(g: dict) -> list[str]:
    lines = ["", f"graph mode ({g['exe_mode']}): decode as one compiled graph, prefill eager"]
    lines += [f"  {line.strip()}" for line in g["lines"]]
    names = {"optimized": "eager optimized", "hf": "HF transformers", "reference": "reference"}
    for m, label in names.items():
        v = g.get(f"{m}_over_graph")
        if v:
            lines.append(f"  {label} / graph decode: {v['decode']:.2f}x (best {v['decode_best']:.2f}x)")
    st = g["startup_s"]
    lines += [
        f"  graph decode / floor = {g['graph_over_floor']:.2f}x",
        *(graph_gain.format_lines(g["gain_bound"]) if "gain_bound" in g else []),
        f"  start-up (first decode call): cold {st['cold']:.1f} s ({st['cold_source']}), cached "
        f"{st['cached']:.1f} s ({st['cached_source']}): {g['cold_over_cached']:.1f}x faster from the cache",
    ]
    return lines


# ----------------------------------------------------------------------------------------------- sweeps


def sweeps(model, decoders: dict, args, config, dtype: torch.dtype, hardware) -> dict:
    """Decode time of the optimized model (eager, and the graph when built) against the KV pool size (multiples
    of the blocks the requests need, same prompts) and against the context (prompt lengths, each with the pool
    it needs): every point timed `--repeats` rounds, interleaved round by round like the main comparison."""
    from optimized.benchmarks.floor import decode_floor
    from optimized.executor.model_runner import ModelRunner

    def blocks(prompt_len: int) -> int:
        return 1 + args.batch * -(-(prompt_len + args.decode_steps + 1) // args.block_size)

    points = []  # (sweep, value, prompt_len, pool blocks)
    for factor in args.pool_sweep or []:
        points.append(("pool", factor, args.prompt_len, factor * blocks(args.prompt_len)))
    for length in args.context_sweep or []:
        points.append(("context", length, length, blocks(length)))
    gen = torch.Generator().manual_seed(args.seed + 2)
    prompts = {
        n: torch.randint(0, config.vocab_size, (args.batch, n), generator=gen).tolist()
        for n in sorted({p[2] for p in points})
    }
    runners = {}
    for point in points:
        for name, decoder in decoders.items():
            r = ModelRunner(model, args.block_size, kv_pool_blocks=point[3])
            r.decode_forward = decoder  # the graph decoder's compiled step: the pool's block count is symbolic
            runners[(point, name)] = r
    samples = {key: [] for key in runners}
    for rnd in range(args.warmup + args.repeats):
        for key, r in runners.items():
            decode = r.generate(prompts[key[0][2]], args.decode_steps + 1).decode_seconds
            if rnd >= args.warmup:
                samples[key].extend(decode)
        progress(f"sweep round {rnd + 1}/{args.warmup + args.repeats} done")
    out = {"pool": [], "context": []}
    for (point, name), s in samples.items():
        sweep, value, prompt_len, pool = point
        context = prompt_len + (args.decode_steps + 1) / 2
        fl = decode_floor(config, hardware, dtype, args.batch, context)
        out[sweep].append(
            {
                "model": name,
                "value": value,
                "prompt_len": prompt_len,
                "pool_blocks": pool,
                "decode_ms_per_token": summarize(s),
                "kv_bytes": fl["bytes"]["kv_cache"],
                "floor_ms_per_token": 1000 * fl["floor_s"],
            }
        )
    return out


def format_sweeps(sw: dict) -> list[str]:
    lines = []
    titles = {
        "pool": "decode vs KV pool size (same prompts; the pool at x times the blocks they need)",
        "context": "decode vs context length (prompt length; the pool each needs)",
    }
    for sweep, rows in sw.items():
        if not rows:
            continue
        lines += [
            "",
            titles[sweep],
            f"  {'model':<10}{'point':>8}{'blocks':>8}{'KV read':>11}{'median ms':>11}{'best ms':>10}"
            f"{'median/first':>14}{'best/first':>12}{'floor ms':>10}",
        ]
        first = {}
        for row in rows:
            d = row["decode_ms_per_token"]
            f = first.setdefault(row["model"], d)
            label = f"{row['value']}x" if sweep == "pool" else str(row["value"])
            lines.append(
                f"  {row['model']:<10}{label:>8}{row['pool_blocks']:>8}{_mb(row['kv_bytes']):>11}"
                f"{d['median']:>11.2f}{d['min']:>10.2f}{d['median'] / f['median']:>14.3f}"
                f"{d['min'] / f['min']:>12.3f}{row['floor_ms_per_token']:>10.2f}"
            )
    return lines
