"""The execution plan: what a run will do, computed once from the inference config and the model's config, before
any process group exists, and printed at start-up as one block.

It names the prefill path (TP, SP with its EP scheme, the MX wire), the decode path (TP, MC2, attention DP), the
graph buckets, the MC2 window and the KV pool. The MC2 window is sized from the largest batch a decode step can
dispatch: in graph mode the padded bucket (padding rows are real rows to MC2), and under attention DP each group's
share padded to its bucket. Tests and the equivalence report read the plan to know which path ran.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimized.config import GRAPH_MODES, InferenceConfig
from optimized.distributed import decode_plan, prefill_plan
from optimized.forward_metadata import batch_bucket


def group_batch(batch: int, dp_groups: int) -> int:
    """A DP group's share of a batch: the most requests one group runs at once."""
    return -(-batch // dp_groups)


def graph_buckets(batch: int, dp_groups: int) -> tuple[int, ...]:
    """The captured decode batch sizes a graph-mode run may use: powers of two up to a group's padded share."""
    top, buckets, b = batch_bucket(group_batch(batch, dp_groups)), [], 1
    while b <= top:
        buckets.append(b)
        b *= 2
    return tuple(buckets)


def dispatch_batch(batch: int, dp_groups: int, graph: bool) -> int:
    """The largest decode batch a step dispatches over the job: the batch itself in eager mode; in graph mode
    every DP group's share padded to its bucket (one group without DP)."""
    if not graph:
        return batch
    return dp_groups * batch_bucket(group_batch(batch, dp_groups))


def mc2_window(hf_config, parallel, batch: int, exe_mode: str, act_bytes: int) -> int | None:
    """The MC2 group's HCCL window (MB) for decode batches up to `batch` as a step dispatches them (padded to the
    graph bucket in a graph mode, per DP group under attention DP); None without an MC2 decode. Every builder of
    process groups (the assembly, the parallel bench, the latency harness) sizes the window here."""
    dispatched = dispatch_batch(batch, parallel.attn_dp_size, exe_mode in GRAPH_MODES)
    return decode_plan.window_for(hf_config, parallel, dispatched, act_bytes)


def pool_blocks(lengths: list[int], block_size: int, dp_groups: int = 1) -> int:
    """KV blocks per DP group (the null block included) for requests of these token budgets added together (the
    engine deals them round robin, request i to group i mod D)."""
    per_group = [1] * dp_groups
    for i, n in enumerate(lengths):
        per_group[i % dp_groups] += -(-n // block_size)
    return max(per_group)


@dataclass(frozen=True)
class ExecutionPlan:
    batch: int  # the most requests decoding together (scheduler_config.batch_size, or the prompts)
    dp_groups: int
    exe_mode: str
    buckets: tuple[int, ...]  # graph mode's captured decode batches (empty in eager mode)
    dispatch_batch: int  # the largest decode batch a step dispatches (padded in graph mode)
    mc2_window_mb: int | None  # the MC2 group's HCCL window; None: no MC2 decode
    kv_pool_blocks: int  # per DP group, the null block included
    block_size: int
    prefill: str  # the start-up lines of the prefill and decode paths
    decode: str

    @property
    def graph(self) -> bool:
        return self.exe_mode in GRAPH_MODES

    @property
    def mc2(self) -> bool:
        return self.mc2_window_mb is not None

    @classmethod
    def build(
        cls, cfg: InferenceConfig, hf_config, *, batch: int, prefill_tokens: int, kv_pool_blocks: int
    ) -> "ExecutionPlan":
        m, p, s = cfg.model_config, cfg.parallel_config, cfg.scheduler_config
        from optimized.phases import uses_mx_prefill

        graph = m.exe_mode in GRAPH_MODES
        dp, act = p.attn_dp_size, m.torch_dtype.itemsize
        dispatched = dispatch_batch(batch, dp, graph)
        return cls(
            batch=batch,
            dp_groups=dp,
            exe_mode=m.exe_mode,
            buckets=graph_buckets(batch, dp) if graph else (),
            dispatch_batch=dispatched,
            mc2_window_mb=mc2_window(hf_config, p, batch, m.exe_mode, act),
            kv_pool_blocks=kv_pool_blocks,
            block_size=s.block_size,
            prefill=prefill_plan.describe(hf_config, p, prefill_tokens, act, mx=uses_mx_prefill(hf_config, p)),
            decode=decode_plan.describe(hf_config, p, dispatched, act),
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
                f"decode steps as {self.exe_mode} graphs: buckets {list(self.buckets)}; a step dispatches up "
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
                self.prefill,
                self.decode,
                f"{graph}; {window}",
                f"KV pool: {self.kv_pool_blocks} blocks of {self.block_size} tokens"
                f"{' per DP group' if self.dp_groups > 1 else ''} (null block included)",
            ]
        )
