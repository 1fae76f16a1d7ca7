"""Find the first diverging layer: where the optimized model leaves the reference.

    python -m equivalence.report --config fixtures/configs/tiny_single.yaml [--prompt TEXT ...] [--decode-steps N]
                                 [--out DIR]

Runs the optimized model of an inference config on its device (eager, or graph-mode decode) and the reference on
the CPU on the same prompts: a prefill, then N greedy decode steps whose tokens (the optimized model's choice) are
teacher-forced into the reference. The reference replays the optimized model's expert ids in every sparse layer
(`test_e2e_parallel.replayed_routing`); a token whose expert set differs from the reference's own top-k is a flip,
allowed only on a near-tie (`routing_check`), and counted. Every layer's checkpoints
(equivalence/support/checkpoints.py)
are compared on the host: cosine, max abs / rel error, rel_l2, the share of elements within 1e-3 and 5e-3
relative error, and the tolerance ratio max(|a - e| / (atol + rtol |e|), rel_l2 / max_rel_l2) against the entry
`checkpoint.<kind>.<dtype>` of the tolerance table (equivalence/support/compare.py); a checkpoint passes at ratio <= 1.
The first divergence is the first (step, layer, kind) in execution order that does not. Output: DIR/report.json
and DIR/report.html (self-contained, inline SVG; equivalence/report/html.py).

Layouts: one process on the model's device, or parallel_config.world_size gloo ranks (the equivalence.support.dist
worker pool, devices as in the model tests: $QWEN3_MOE_TEST_DEVICE, default the CPU) with attention TP, MoE TP /
EP, embedding / lm_head TP, each rank's qkv and kv_write (its heads) gathered over the attention TP group to full
tensors; not yet the sequence-parallel prefill or attention DP (refused with a clear error). 16-bit or fp32
checkpoints. Eager or graph decode (graph decode steps: the per-layer activations live inside the compiled graph,
so those steps check each layer's KV-cache write, read back from the cache, and the logits).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from equivalence.support.checkpoints import (
    FINAL_KINDS,
    KINDS,
    Capture,
    optimized_hooks,
    read_kv_writes,
    reference_hooks,
)
from equivalence.support.compare import Tolerance, cosine, max_abs, rel_l2, tolerance

RELATIVE_SHARES = (1e-3, 5e-3)


class ReportError(ValueError):
    """Bad input to the report (the message says what to change)."""


# ------------------------------------------------------------------------------------------------ metrics


def tolerance_name(kind: str, dtype: torch.dtype) -> str:
    return f"checkpoint.{kind}.{str(dtype).removeprefix('torch.')}"


def tolerance_ratio(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> float:
    """How far past its tolerance a checkpoint is: <= 1 passes (elementwise atol + rtol |e|, and rel_l2)."""
    a, e = actual.double(), expected.double()
    diff, bound = (a - e).abs(), tol.atol + tol.rtol * e.abs()
    ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / bound)  # bound 0 and diff > 0: inf
    worst = float(ratio.max()) if ratio.numel() else 0.0
    if tol.max_rel_l2:
        worst = max(worst, rel_l2(actual, expected) / tol.max_rel_l2)
    return worst


def metrics(actual: torch.Tensor, expected: torch.Tensor) -> dict:
    a, e = actual.double(), expected.double()
    diff, scale = (a - e).abs(), e.abs()
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / scale)
    # compare.cosine calls two zero vectors aligned (1.0); one zero side (an unwritten cache slot) is not
    one_zero = (a.norm() == 0) != (e.norm() == 0)
    out = {
        "cosine": 0.0 if one_zero else cosine(actual, expected),
        "max_abs": max_abs(actual, expected),
        "max_rel": float(rel.max()) if rel.numel() else 0.0,
        "rel_l2": rel_l2(actual, expected),
    }
    for share in RELATIVE_SHARES:
        out[f"within_{share:g}"] = float((diff <= share * scale).double().mean()) if diff.numel() else 1.0
    return out


@dataclass
class Checkpoint:
    step: str
    layer: int | str
    kind: str
    tolerance: str
    ratio: float
    ok: bool
    metrics: dict
    note: str = ""

    @property
    def where(self) -> str:
        return f"{self.step} layer {self.layer} {self.kind}"


@dataclass
class Report:
    meta: dict
    checkpoints: list[Checkpoint] = field(default_factory=list)
    routing: dict = field(default_factory=dict)

    @property
    def first_divergence(self) -> Checkpoint | None:
        return next((c for c in self.checkpoints if not c.ok), None)

    def to_json(self) -> dict:
        first = self.first_divergence
        return {
            "meta": self.meta,
            "routing": self.routing,
            "first_divergence": None if first is None else asdict(first),
            "checkpoints": [asdict(c) for c in self.checkpoints],
        }

    def summary(self) -> str:
        first = self.first_divergence
        flips = self.routing
        route = (
            f"; routing flips {flips['flips']}/{flips['tokens']} tokens, {flips['clear_flips']} not near-ties"
            if flips
            else ""
        )
        if first is None:
            return f"no divergence: {len(self.checkpoints)} checkpoints within their tolerance{route}"
        m = first.metrics
        return (
            f"first divergence: {first.where} ({first.tolerance} exceeded {first.ratio:.3g}x; rel_l2 "
            f"{m['rel_l2']:.3e}, max_abs {m['max_abs']:.3e}, cosine {m['cosine']:.6f}"
            f"{'; ' + first.note if first.note else ''}){route}"
        )


# ---------------------------------------------------------------------------------------- optimized run


@dataclass
class OptimizedRun:
    captures: dict[str, Capture]  # step -> what the optimized model produced
    tokens: list[list[int]]  # per step after the prefill: the decode input of each request [B]
    graph_steps: set = field(default_factory=set)  # decode steps run as a compiled graph (no layer hooks)


@torch.no_grad()
def run_optimized(
    model, prompts: list[list[int]], decode_steps: int, *, exe_mode: str = "eager", block_size: int = 16, progress=None
) -> OptimizedRun:
    """Prefill the packed prompts, then `decode_steps` greedy steps, capturing every checkpoint of each step."""
    from equivalence.support.parallel_support import decode_metadata, paged_cache
    from optimized.executor.model_runner import ModelRunner

    say = progress or (lambda msg: None)
    runner = ModelRunner(model, block_size, exe_mode=exe_mode)
    cache, table = paged_cache(model, [len(p) + decode_steps for p in prompts], dtype=runner.kv_cache_dtype)
    captures: dict[str, Capture] = {}
    step = {"name": "prefill"}
    run = OptimizedRun(captures, [])
    with optimized_hooks(model, lambda: captures[step["name"]]):
        captures["prefill"] = Capture()
        say("optimized prefill")
        ids, meta, last = runner.prefill_inputs(prompts, table)
        logits = model(ids, meta, cache.layers)
    captures["prefill"].put("final", "logits", logits)
    read_kv_writes(model, cache.layers, meta.slot_mapping, captures["prefill"])
    tokens = logits[last].argmax(-1)
    lengths = [len(p) for p in prompts]
    for s in range(decode_steps):
        name = step["name"] = f"decode{s}"
        captures[name] = cap = Capture()
        say(f"optimized decode step {s + 1}/{decode_steps}")
        run.tokens.append(tokens.tolist())
        meta = decode_metadata(lengths, table, block_size)
        if exe_mode == "eager":
            with optimized_hooks(model, lambda: captures[step["name"]]):
                logits = model(tokens, meta, cache.layers)
        else:
            logits = runner.decode_forward(tokens, meta, cache.layers)
            run.graph_steps.add(name)
        cap.put("final", "logits", logits)
        read_kv_writes(model, cache.layers, meta.slot_mapping, cap)
        tokens = logits.argmax(-1)
        lengths = [n + 1 for n in lengths]
    return run


# ------------------------------------------------------------------------------------- several ranks


def gather_heads(run: OptimizedRun, model) -> None:
    """Per-rank qkv / kv_write captures (this rank's heads) -> full tensors, every head in order, on every rank:
    gathered over the attention TP group; replicated KV heads (fewer KV heads than ranks) taken once."""
    from optimized.distributed import collectives as comm
    from optimized.layers.linear import first_kv_head

    tp, cfg = model.groups.attn_tp, model.config
    if tp.size == 1:
        return
    attn = model.layers[0].self_attn
    d, nq, nkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    device = next(model.parameters()).device
    firsts = [first_kv_head(cfg.num_key_value_heads, tp.size, r) for r in range(tp.size)]

    def kv_full(parts):  # parts[r]: [T, nkv*d] of rank r -> [T, Nkv*d]
        out = [None] * cfg.num_key_value_heads
        for r, part in enumerate(parts):
            for h in range(nkv):
                out[firsts[r] + h] = part[:, h * d : (h + 1) * d]
        return torch.cat(out, dim=-1)

    for cap in run.captures.values():
        for (layer, kind), value in list(cap.values.items()):
            if kind not in ("qkv", "kv_write"):
                continue
            ranks = comm.all_gather(value.to(device)[None], tp.group).cpu()  # [P, T, F_r]
            if kind == "qkv":
                q = torch.cat([r[:, : nq * d] for r in ranks], dim=-1)
                k = kv_full([r[:, nq * d : (nq + nkv) * d] for r in ranks])
                v = kv_full([r[:, (nq + nkv) * d :] for r in ranks])
                cap.values[(layer, kind)] = torch.cat([q, k, v], dim=-1)
            else:
                k = kv_full([r[:, : nkv * d] for r in ranks])
                v = kv_full([r[:, nkv * d :] for r in ranks])
                cap.values[(layer, kind)] = torch.cat([k, v], dim=-1)


def _rank_report_task(
    rank, world, model_dir, parallel, dtype_name, prompts, decode_steps, exe_mode, block_size, plant=None
):
    """One rank of a multi-rank report (equivalence.support.dist pool): its run, heads gathered; rank 0's is used.
    plant(model, rank): a test's planted bug, applied to this rank's model (built for this task only)."""
    from equivalence.support.parallel_support import dtype_of, test_device
    from optimized.executor.assembly import WeightSource, build_model

    weights, dtype = WeightSource.from_checkpoint(model_dir), dtype_of(dtype_name)
    plan = layout_plan(weights, parallel, dtype, len(prompts), exe_mode)
    model = build_model(weights, parallel, dtype=dtype, device=test_device(), plan=plan)
    if plant is not None:
        plant(model, rank)
    try:
        run = run_optimized(model, prompts, decode_steps, exe_mode=exe_mode, block_size=block_size)
        gather_heads(run, model)
    finally:
        model.close()
    return {"run": run, "num_layers": len(model.layers), "device": str(next(model.parameters()).device)}


def layout_plan(weights, parallel, dtype: torch.dtype, batch: int, exe_mode: str = "eager"):
    """The layout's execution plan on these weights (`assembly.plan_for`); a layout the checkpoint cannot run is a
    ReportError naming the key."""
    from optimized.errors import UsageError
    from optimized.executor.assembly import plan_for

    try:
        return plan_for(weights, parallel, dtype=dtype, batch=batch, exe_mode=exe_mode)
    except UsageError as e:  # QuantConfigError / PathPlanError: the key to change
        raise ReportError(str(e)) from None


def check_layout(plan) -> None:
    """The report hooks the tensor-parallel prefill: the plan must take it (whatever the layout asks for)."""
    from optimized.path_plan import TP

    if plan.paths.prefill != TP:
        raise ReportError(
            f"the report hooks the tensor-parallel data flow, but this run's prefill is {plan.paths.prefill} "
            f"({plan.paths.why}): parallel_config with prefill_opt (sequence-parallel prefill) or attn_dp is not "
            "covered yet; run the same model with prefill_opt: false and attn_dp: false"
        )


def check_checkpoint(plan, model_path) -> None:
    """The report covers 16-bit and fp32 checkpoints (no checkpoint tolerances for a quantization scheme yet)."""
    if plan.quant is not None:
        raise ReportError(
            f"{model_path} is a quantized checkpoint ({plan.scheme.label}): the report covers 16-bit and fp32 "
            "checkpoints so far (no checkpoint tolerances for W4A8 / W8A8 / W4A4 yet)"
        )


# ---------------------------------------------------------------------------------------- reference run


def _step_rows(prompts, decode_steps):
    """{step: [(request, row in that request's sequence), ...]} in the optimized model's token order."""
    rows = {"prefill": [(b, j) for b, p in enumerate(prompts) for j in range(len(p))]}
    for s in range(decode_steps):
        rows[f"decode{s}"] = [(b, len(p) + s) for b, p in enumerate(prompts)]
    return rows


@torch.no_grad()
def run_reference(ref, prompts, run: OptimizedRun, progress=None) -> tuple[dict[str, Capture], dict]:
    """The reference on each request's whole sequence (prompt + the optimized model's decode inputs), replaying
    the optimized expert ids; -> its captures per step (rows in the optimized order) and its own router
    probabilities per step and layer."""
    from equivalence.support.logits_runs import replayed_routing

    say = progress or (lambda msg: None)
    steps = len(run.tokens)
    step_rows = _step_rows(prompts, steps)
    sparse = sorted(i for (i, kind) in run.captures["prefill"].extra if kind == "router_ids")
    per_request = []
    for b, p in enumerate(prompts):
        say(f"reference request {b + 1}/{len(prompts)}")
        seq = torch.tensor([p + [run.tokens[s][b] for s in range(steps)]])
        # this request's optimized expert ids, rows in sequence order: its prompt rows, then one per step
        offset = sum(len(q) for q in prompts[:b])
        own = _own_expert_ids(ref, seq) if run.graph_steps else {}
        ids = {}
        for i in sparse:
            rows = [run.captures["prefill"].extra[(i, "router_ids")][offset : offset + len(p)]]
            for s in range(steps):
                opt = run.captures[f"decode{s}"].extra.get((i, "router_ids"))
                # a graph step recorded no ids: the reference keeps its own choice for that row
                rows.append(opt[b : b + 1] if opt is not None else own[i][len(p) + s : len(p) + s + 1])
            ids[i] = torch.cat(rows)
        capture = Capture()
        with reference_hooks(ref, capture), replayed_routing(ref, ids, 0.0, []):
            ref(seq)
        per_request.append(capture)
    out: dict[str, Capture] = {}
    for step, rows in step_rows.items():
        cap = out[step] = Capture()
        for key in per_request[0].values:
            cap.values[key] = torch.stack([per_request[b].values[key][j] for b, j in rows])
        for key in per_request[0].extra:
            cap.extra[key] = torch.stack([per_request[b].extra[key][j] for b, j in rows])
    return out, {}


def _own_expert_ids(ref, seq) -> dict[int, torch.Tensor]:
    """The reference's own top-k expert ids [S, K] per sparse layer on `seq` (its tie rule: lower id first)."""
    capture = Capture()
    with reference_hooks(ref, capture):
        ref(seq)
    return {
        i: probs.sort(dim=-1, descending=True, stable=True).indices[:, : ref.model.layers[i].mlp.top_k]
        for (i, kind), probs in capture.extra.items()
        if kind == "router_probs"
    }


# ----------------------------------------------------------------------------------------------- compare


def compare(
    run: OptimizedRun, reference: dict[str, Capture], num_layers: int, dtype: torch.dtype, near_tie: float
) -> tuple[list[Checkpoint], dict]:
    """Every checkpoint both sides captured, in execution order, judged against the table."""
    from equivalence.support.parallel_support import RoutingStats, routing_check

    out, total = [], RoutingStats()
    for step, opt in run.captures.items():
        ref = reference[step]
        order = [(i, kind) for i in range(num_layers) for kind in KINDS] + [("final", k) for k in FINAL_KINDS]
        for layer, kind in order:
            if (layer, kind) not in opt.values:
                continue
            a, e = opt.values[(layer, kind)], ref.values[(layer, kind)]
            name = tolerance_name(kind, dtype)
            tol = tolerance(name)
            if a.shape != e.shape:
                out.append(
                    Checkpoint(
                        step,
                        layer,
                        kind,
                        name,
                        float("inf"),
                        False,
                        {},
                        f"shape {tuple(a.shape)} != reference {tuple(e.shape)}",
                    )
                )
                continue
            ratio, note = tolerance_ratio(a, e, tol), ""
            ok = ratio <= 1.0
            if kind == "router":
                stats = routing_check(
                    ref.extra[(layer, "router_probs")], a.shape[-1], opt.extra[(layer, "router_ids")], near_tie
                )
                total = total + stats
                note = str(stats)
                ok = ok and stats.clear_flips == 0
            out.append(Checkpoint(step, layer, kind, name, ratio, ok, metrics(a, e), note))
    routing = {
        "tokens": total.tokens,
        "flips": total.flips,
        "clear_flips": total.clear_flips,
        "worst_margin": total.worst_margin,
    }
    return out, routing


# ----------------------------------------------------------------------------------------------- driver


def near_tie_of(dtype: torch.dtype) -> float:
    return tolerance("router_tie.float32" if dtype == torch.float32 else "router_tie.model.bfloat16").rtol


def build_report(
    model,
    ref,
    prompts: list[list[int]],
    decode_steps: int,
    *,
    exe_mode: str = "eager",
    block_size: int = 16,
    meta: dict | None = None,
    progress=None,
) -> Report:
    """The report of `model` (optimized, any device, one process) against `ref` (the reference, on the CPU)."""
    say = progress or (lambda msg: None)
    run = run_optimized(model, prompts, decode_steps, exe_mode=exe_mode, block_size=block_size, progress=say)
    return report_of_run(
        run,
        ref,
        prompts,
        len(model.layers),
        model.dtype,
        exe_mode,
        dict(meta or {}, device=str(next(model.parameters()).device)),
        say,
    )


def build_parallel_report(
    model_dir,
    parallel,
    ref,
    prompts,
    decode_steps: int,
    *,
    dtype: torch.dtype,
    exe_mode: str = "eager",
    block_size: int = 16,
    meta: dict | None = None,
    progress=None,
    plant=None,
) -> Report:
    """The report of a multi-rank layout: parallel_config.world_size gloo ranks (equivalence.support.dist), each
    capturing
    its checkpoints, per-rank heads gathered to full tensors; rank 0's run compared with the reference."""
    from equivalence.support.dist import get_pool

    from optimized.executor.assembly import WeightSource

    say = progress or (lambda msg: None)
    plan = layout_plan(WeightSource.from_checkpoint(model_dir), parallel, dtype, len(prompts), exe_mode)
    check_layout(plan)
    check_checkpoint(plan, model_dir)
    say(f"optimized run on {parallel.world_size} ranks")
    results = get_pool(parallel.world_size).run(
        _rank_report_task,
        str(model_dir),
        parallel,
        str(dtype).removeprefix("torch."),
        prompts,
        decode_steps,
        exe_mode,
        block_size,
        plant,
        timeout=600,
    )
    first = results[0]
    return report_of_run(
        first["run"],
        ref,
        prompts,
        first["num_layers"],
        dtype,
        exe_mode,
        dict(meta or {}, device=first["device"], world_size=parallel.world_size),
        say,
    )


def report_of_run(
    run: OptimizedRun, ref, prompts, num_layers: int, dtype: torch.dtype, exe_mode: str, meta: dict, say
) -> Report:
    decode_steps = len(run.tokens)
    reference, _ = run_reference(ref, prompts, run, progress=say)
    say("comparing")
    checkpoints, routing = compare(run, reference, num_layers, dtype, near_tie_of(dtype))
    info = dict(meta)
    info.update(
        dtype=str(dtype).removeprefix("torch."),
        exe_mode=exe_mode,
        decode_steps=decode_steps,
        prompts=prompts,
        decode_inputs=run.tokens,
        num_layers=num_layers,
        kinds=list(KINDS),
        graph_steps=sorted(run.graph_steps),
    )
    if run.graph_steps:
        info["not_captured"] = (
            "graph-mode decode steps: per-layer activations are inside the compiled graph; "
            "checked there: each layer's kv_write (read from the cache) and the logits"
        )
    return Report(info, checkpoints, routing)


def write_report(report: Report, out_dir: str | Path) -> tuple[Path, Path]:
    from equivalence.report.html import render_html

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = report.to_json()
    json_path, html_path = out / "report.json", out / "report.html"
    json_path.write_text(json.dumps(data, indent=1, default=float))
    html_path.write_text(render_html(data))
    return json_path, html_path


def load_config(path: str | Path):
    from optimized.config import ConfigError, InferenceConfig

    path = Path(path)
    if not path.is_file():
        raise ReportError(
            f"config file {str(path)!r} not found (give an inference config YAML, e.g. "
            "fixtures/configs/tiny_single.yaml)"
        )
    try:
        return InferenceConfig.from_yaml(path)
    except ConfigError as e:
        raise ReportError(f"invalid inference config {path}: " + "; ".join(f"{k}: {m}" for k, m in e.errors)) from None


def models_of_config(cfg, dtype: str | None = None, device: str | None = None):
    """(optimized model on its device, reference on the CPU, model directory) for a single-process config."""
    from optimized import platform
    from optimized.executor.assembly import WeightSource, build_model
    from optimized.model_loader.hf_config import load_hf_config
    from optimized.model_loader.model_path import resolve_model_path
    from reference.checkpoint import load_model as load_reference

    m, p = cfg.model_config, cfg.parallel_config
    if dtype is not None:
        m.dtype = dtype
    if m.scheme[0] == "preset" or not m.with_ckpt:
        raise ReportError(
            "the report compares real weights: model_config needs a checkpoint (with_ckpt: true, "
            "a directory or fixture:NAME), not random weights"
        )
    model_dir = resolve_model_path(m.model_path, *m.scheme)
    weights, torch_dtype = WeightSource.from_checkpoint(model_dir, load_hf_config(model_dir)), m.torch_dtype
    plan = layout_plan(weights, p, torch_dtype, cfg.scheduler_config.batch_size, m.exe_mode)
    check_layout(plan)
    check_checkpoint(plan, m.model_path)
    ref = load_reference(model_dir, torch_dtype, router_dtype="float32")
    if p.world_size > 1:  # built on the ranks (equivalence.support.dist), not here
        return None, ref, model_dir
    model = build_model(weights, p, dtype=torch_dtype, device=device or platform.device(), plan=plan)
    return model, ref, model_dir


def prompts_of(args, cfg, model_dir, vocab_size: int) -> list[list[int]]:
    from optimized.cli.generate import build_prompts
    from optimized.errors import UsageError
    from optimized.model_loader.tokenizer import CheckpointTokenizer

    ns = argparse.Namespace(prompt=args.prompt, prompt_ids=args.prompt_ids, chat=False)
    try:
        prompts = build_prompts(ns, cfg, vocab_size, CheckpointTokenizer.load(model_dir))
    except (UsageError, ValueError) as e:
        raise ReportError(str(e)) from None
    for i, p in enumerate(prompts):
        if not p:
            raise ReportError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ReportError(f"prompt {i} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})")
    return prompts


def parse_args(argv=None):
    from optimized.cli.common import parse_prompt_ids

    ap = argparse.ArgumentParser(
        prog="python -m equivalence.report",
        description="run the optimized model and the reference on the same prompts and "
        "name the first checkpoint where they diverge (report.json + .html)",
    )
    ap.add_argument("--config", required=True, help="inference config YAML (optimized/config.py)")
    prompt = ap.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt; repeat for a batch")
    prompt.add_argument(
        "--prompt-ids",
        action="append",
        type=parse_prompt_ids,
        metavar="IDS",
        help="comma-separated token ids; repeat for a batch",
    )
    ap.add_argument("--decode-steps", type=int, default=2, help="greedy decode steps after the prefill (default 2)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="overrides model_config.dtype")
    ap.add_argument("--exe-mode", choices=["eager", "ge_graph", "acl_graph"], help="overrides model_config.exe_mode")
    ap.add_argument("--device", help="the optimized model's device (default: the platform's)")
    ap.add_argument("--out", default="equivalence_report", help="output directory (default ./equivalence_report)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    if args.decode_steps < 0:
        ap.error(f"--decode-steps must be >= 0; got {args.decode_steps}")
    return args


def report_for_config(
    config: str | Path,
    *,
    prompt=None,
    prompt_ids=None,
    decode_steps: int = 2,
    dtype=None,
    exe_mode=None,
    device=None,
    progress=None,
) -> Report:
    cfg = load_config(config)
    model, ref, model_dir = models_of_config(cfg, dtype, device)
    ns = argparse.Namespace(prompt=prompt, prompt_ids=prompt_ids)
    prompts = prompts_of(ns, cfg, model_dir, ref.config.vocab_size)
    mode = exe_mode or cfg.model_config.exe_mode
    if max(len(p) for p in prompts) + decode_steps > ref.config.max_position_embeddings:
        raise ReportError(
            f"prompt + {decode_steps} decode steps exceed max_position_embeddings={ref.config.max_position_embeddings}"
        )
    meta = {"config": str(config), "model_path": cfg.model_config.model_path}
    block_size = cfg.scheduler_config.block_size
    if model is None:
        return build_parallel_report(
            model_dir,
            cfg.parallel_config,
            ref,
            prompts,
            decode_steps,
            dtype=cfg.model_config.torch_dtype,
            exe_mode=mode,
            block_size=block_size,
            meta=meta,
            progress=progress,
        )
    return build_report(
        model, ref, prompts, decode_steps, exe_mode=mode, block_size=block_size, meta=meta, progress=progress
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    progress = None if args.quiet else (lambda msg: print(f"[report] {msg}", file=sys.stderr, flush=True))
    try:
        report = report_for_config(
            args.config,
            prompt=args.prompt,
            prompt_ids=args.prompt_ids,
            decode_steps=args.decode_steps,
            dtype=args.dtype,
            exe_mode=args.exe_mode,
            device=args.device,
            progress=progress,
        )
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    json_path, html_path = write_report(report, args.out)
    print(report.summary())
    print(f"wrote {json_path} ({json_path.stat().st_size} bytes) and {html_path} ({html_path.stat().st_size} bytes)")
    return 1 if report.first_divergence else 0


if __name__ == "__main__":
    sys.exit(main())
