"""The execution plan: what a run will do, decided once from the inference config and the model's config (its
quantization scheme included), before any process group exists, and printed at start-up as one block.

It holds the decisions as data: the checkpoint's quantization scheme, the phase paths (`paths`: the prefill path, its
EP scheme and activation wire, the decode path; decided by optimized/path_plan.py's one rule), the graph buckets, the
MC2 window and the KV pool (given, or sized by memory once the weights are loaded: `kv_pool`, set by the assembly,
holds the figures). The MC2 window is sized from the largest batch a decode step can dispatch: in graph mode
the largest captured bucket (padding rows are real rows to MC2, and warming up runs it), per attention-DP group. The
assembly builds the groups with its window and the model on its paths; tests, the benches, the latency harness and
the equivalence report read its fields to know which path runs (never its printed lines).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from optimized.config import GRAPH_MODES, InferenceConfig, ParallelConfig
from optimized.distributed import decode_plan, prefill_plan
from optimized.errors import UsageError
from optimized.executor.kv_pool import KVPool
from optimized.executor.scheduler import deal
from optimized.forward_metadata import default_buckets
from optimized.layers.quantization.schemes import MXFP8_WIRE, QuantScheme, quant_scheme, scheme_row
from optimized.path_plan import DP, SP, PhasePaths, decide_paths


def group_batch(batch: int, dp_groups: int) -> int:
    """A DP group's share of a batch: the most requests one group runs at once."""
    return -(-batch // dp_groups)


def graph_buckets(batch: int, dp_groups: int, sizes: list[int] | tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The captured decode batch sizes a graph-mode run uses: `sizes` (model_config.graph_batch_sizes; UsageError
    naming the key when the largest cannot hold a group's share), else 1, 2, 4, 8, then every 16 up to the bucket
    of a group's share."""
    share = group_batch(batch, dp_groups)
    if sizes is None:
        return default_buckets(share)
    if max(sizes) < share:
        raise UsageError(
            f"model_config.graph_batch_sizes: the largest ({max(sizes)}) cannot hold a decode batch of {share}"
            f"{' per DP group' if dp_groups > 1 else ''}: add a size of {share} or more"
        )
    return tuple(sizes)


def dispatch_batch(batch: int, dp_groups: int, graph: bool, buckets: tuple[int, ...] | None = None) -> int:
    """The largest decode batch a step dispatches over the job: the batch itself in eager mode; in graph mode every
    DP group's rows padded to the largest bucket (one group without DP): warming up runs it, and so may a step.
    buckets: the captured sizes (None: the default rule's for this batch)."""
    if not graph:
        return batch
    return dp_groups * max(buckets or graph_buckets(batch, dp_groups))


def pool_blocks(lengths: list[int], block_size: int, dp_groups: int = 1) -> int:
    """KV blocks per DP group (the null block included) for requests of these token budgets added together (the
    engine deals them by load in tokens, scheduler.deal)."""
    per_group = [1] * dp_groups
    for g, n in zip(deal(lengths, dp_groups), lengths):
        per_group[g] += -(-n // block_size)
    return max(per_group)


@dataclass(frozen=True)
class ExecutionPlan:
    batch: int  # the most requests decoding together (scheduler_config.batch_size, or the prompts)
    dp_groups: int
    exe_mode: str
    quant: str | None  # the checkpoint's quantization scheme (a name of layers/quantization/schemes.py's table)
    paths: PhasePaths  # prefill path, its EP scheme and wire, decode path
    buckets: tuple[int, ...]  # graph mode's captured decode batches (empty in eager mode)
    dispatch_batch: int  # the largest decode batch a step dispatches (padded in graph mode)
    mc2_window_mb: int | None  # the MC2 group's HCCL window; None: no MC2 decode
    mc2_limits: tuple[str, ...]  # the NPU MC2 kernels' limits the dispatched batch breaks (portable kernels only)
    kv_pool_blocks: int | None  # per DP group, the null block included; None: no engine pool (each call its own)
    block_size: int | None
    prefill_line: str  # the start-up lines of the prefill and decode paths (display only: read the fields)
    decode_line: str
    pool_by_memory: bool = False  # kv_pool_blocks to be sized by memory once the weights are loaded (the assembly)
    kv_pool: KVPool | None = None  # the pool as sized, with the figures it came from (the assembly sets it)

    @property
    def graph(self) -> bool:
        return self.exe_mode in GRAPH_MODES

    @property
    def mc2(self) -> bool:
        return self.mc2_window_mb is not None

    @property
    def scheme(self) -> QuantScheme:
        """The quantization scheme's row of the table."""
        return scheme_row(self.quant)

    @classmethod
    def build(
        cls, cfg: InferenceConfig, hf_config, *, batch: int, prefill_tokens: int, kv_pool_blocks: int | None
    ) -> "ExecutionPlan":
        """Every decision of a config run, once. Raises QuantConfigError / PathPlanError for a layout the
        checkpoint's scheme cannot run (path_plan.decide_paths). kv_pool_blocks None: the pool is sized by memory
        once the weights are loaded (`pool_by_memory`; the assembly sets `kv_pool`)."""
        m, s = cfg.model_config, cfg.scheduler_config
        plan = cls.for_layout(
            hf_config,
            cfg.parallel_config,
            quant=quant_scheme(hf_config),
            batch=batch,
            act_bytes=m.torch_dtype.itemsize,
            exe_mode=m.exe_mode,
            block_size=s.block_size,
            prefill_tokens=prefill_tokens,
            kv_pool_blocks=kv_pool_blocks,
            graph_batch_sizes=m.graph_batch_sizes,
        )
        return replace(plan, pool_by_memory=kv_pool_blocks is None)

    @classmethod
    def for_layout(
        cls,
        hf_config,
        parallel: ParallelConfig,
        *,
        quant: str | None,
        batch: int,
        act_bytes: int,
        exe_mode: str = "eager",
        block_size: int | None = None,
        prefill_tokens: int | None = None,
        kv_pool_blocks: int | None = None,
        graph_batch_sizes: list[int] | None = None,
    ) -> "ExecutionPlan":
        """The plan of one layout without an inference config (`build` is this over a config; the parallel bench,
        the latency harness and the first-divergence report call it through `assembly.plan_for`). quant: the
        checkpoint's scheme (its config.json's, which may differ from the shapes `hf_config` gives); act_bytes: the
        model dtype's size; prefill_tokens / kv_pool_blocks / block_size: None where no engine pool or first
        prefill is planned (each `generate` call sizes its own); graph_batch_sizes: model_config's captured decode
        batches (None: the default rule, `graph_buckets`)."""
        graph = exe_mode in GRAPH_MODES
        dp = parallel.attn_dp_size
        paths = decide_paths(hf_config, parallel, quant)
        buckets = graph_buckets(batch, dp, graph_batch_sizes) if graph else ()
        dispatched = dispatch_batch(batch, dp, graph, buckets)
        window = decode_plan.window_for(hf_config, parallel, dispatched, act_bytes) if paths.mc2 else None
        limits = tuple(decode_plan.mc2_limit_violations(hf_config, parallel, dispatched)) if paths.mc2 else ()
        return cls(
            batch=batch,
            dp_groups=dp,
            exe_mode=exe_mode,
            quant=quant,
            paths=paths,
            buckets=buckets,
            dispatch_batch=dispatched,
            mc2_window_mb=window,
            mc2_limits=limits,
            kv_pool_blocks=kv_pool_blocks,
            block_size=block_size,
            prefill_line=prefill_line(hf_config, parallel, paths, prefill_tokens, act_bytes, scheme_row(quant)),
            decode_line=decode_line(hf_config, parallel, paths, dispatched, act_bytes, window, limits),
        )

    def describe(self) -> str:
        """The start-up block: one line per decision."""
        dp = (
            f", {self.dp_groups} attention-DP groups of up to {group_batch(self.batch, self.dp_groups)}"
            if self.dp_groups > 1
            else ""
        )
        if self.graph:
            graph = (
                f"decode steps as {self.exe_mode} graphs: buckets {_buckets_text(self.buckets)}; a step dispatches up "
                f"to {self.dispatch_batch} rows (padded)"
            )
        else:
            graph = "decode steps eager"
        window = (
            f"MC2 window {self.mc2_window_mb} MB (sized for {self.dispatch_batch} dispatched rows)"
            if self.mc2
            else "no MC2 decode"
        )
        return "\n".join(
            [
                f"plan: batch {self.batch}{dp}",
                self.prefill_line,
                self.decode_line,
                f"{graph}; {window}",
                self._pool_line(),
            ]
        )

    def _pool_line(self) -> str:
        if self.kv_pool is not None:
            return self.kv_pool.line()
        if self.pool_by_memory:
            return "KV pool: sized by memory once the weights are loaded (scheduler_config.mem_fraction_static)"
        if self.kv_pool_blocks is None:
            return "KV pool: none planned (each generate call sizes its own)"
        return (
            f"KV pool: {self.kv_pool_blocks} blocks of {self.block_size} tokens"
            f"{' per DP group' if self.dp_groups > 1 else ''} (null block included)"
        )


def _buckets_text(buckets: tuple[int, ...]) -> str:
    """The captured sizes as printed: the list, its middle elided when long."""
    if len(buckets) <= 8:
        return str(list(buckets))
    head, tail = ", ".join(map(str, buckets[:6])), buckets[-1]
    return f"[{head}, ..., {tail}] ({len(buckets)} sizes)"


def prefill_line(
    hf_config,
    parallel: ParallelConfig,
    paths: PhasePaths,
    num_tokens: int | None,
    act_bytes: int,
    scheme: QuantScheme,
) -> str:
    """The start-up line of the prefill path the plan decided, with both EP schemes' volumes for the SP prefill of
    `num_tokens` (None: no first prefill planned, no volumes)."""
    if paths.prefill == DP:
        return (
            f"prefill path: attention data parallel ({parallel.attn_dp_size} DP groups x attention TP "
            f"{parallel.attn_tp_size}: each group prefills its own requests, all-gather before QKV, reduce-scatter "
            f"after o_proj), MoE EP {parallel.moe_ep_size} by double routing ({paths.ep_scheme}) of each rank's tokens"
        )
    if paths.prefill != SP:
        return (
            f"prefill path: tensor parallel (every rank runs all tokens; MoE EP by expert range + all_reduce); "
            f"{paths.why}"
        )
    mx = paths.wire == MXFP8_WIRE
    wire = f"MXFP8 activations on the wire ({scheme.label})" if mx else "activations on the wire in the model dtype"
    line = (
        f"prefill path: sequence parallel over {parallel.attn_tp_size} ranks (Attention SP+TP), MoE EP scheme "
        f"{paths.ep_scheme} ({paths.why}), {wire}"
    )
    if num_tokens is None:
        return line
    vol = prefill_plan.ep_comm_volumes(hf_config, parallel, num_tokens, act_bytes, mx)
    return (
        f"{line}; per MoE layer and rank for {num_tokens} tokens: allgather {vol['allgather'].total} B, alltoall "
        f"~{vol['alltoall'].total} B (uniform routing)"
    )


def decode_line(
    hf_config,
    parallel: ParallelConfig,
    paths: PhasePaths,
    batch: int,
    act_bytes: int,
    window_mb: int | None,
    broken: tuple[str, ...] = (),
) -> str:
    """The start-up line of the decode path the plan decided: for MC2, its group's window and volume, and the MC2
    kernel limits `broken` (the plan's `mc2_limits`)."""
    if not paths.mc2:
        return (
            f"decode MoE path: moe_infer_tp (moe_tp_size {parallel.moe_tp_size}, moe_ep_size "
            f"{parallel.moe_ep_size}: expert range + all_reduce)"
        )
    limits = f"; beyond the NPU's MC2 limits (portable kernels only): {'; '.join(broken)}" if broken else ""
    ep = parallel.moe_ep_size
    if paths.decode == DP:  # each rank dispatches its own share of its DP group's batch, nothing gathered
        return (
            f"decode MoE path: moe_infer_dispatch_combine (MC2 over moe_ep {ep}) under attention DP "
            f"({parallel.attn_dp_size} DP groups x attention TP {parallel.attn_tp_size}, batch {batch}: "
            f"{decode_plan.dp_rows(batch, parallel)} tokens per rank, its own); MC2 window {window_mb} MB "
            f"(its own HCCL group); lm_head on the group's rows gathered over attention TP, the chosen ids "
            f"shared{limits}"
        )
    n = decode_plan.tokens_per_rank(batch, ep)
    h, k, e = hf_config.hidden_size, hf_config.num_experts_per_tok, hf_config.num_experts
    vol = decode_plan.mc2_volume(n, h, k, ep, e, act_bytes)
    return (
        f"decode MoE path: moe_infer_dispatch_combine (MC2 over moe_ep {ep}, batch {batch}: {n} tokens per rank); "
        f"MC2 window {window_mb} MB (its own HCCL group); per MoE layer and rank ~{vol.total} B (uniform "
        f"routing){limits}"
    )
