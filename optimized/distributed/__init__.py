"""Process groups and layouts, the collectives (with byte counting), the rank-agreement guard, the prefill / EP plan."""

from optimized.distributed.collectives import (
    CommCounter,
    all_gather,
    all_reduce,
    all_to_all_single,
    broadcast,
    count_bytes,
    exchange_split_sizes,
    reduce_scatter,
)
from optimized.distributed.parallel_state import (
    KINDS,
    DistEnv,
    GroupInfo,
    ParallelState,
    apply_backend_env,
    comm_name,
    destroy_groups,
    group_by_name,
    init_distributed,
    layout_ranks,
    register_group_name,
)

__all__ = [
    "CommCounter",
    "all_gather",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "count_bytes",
    "exchange_split_sizes",
    "reduce_scatter",
    "KINDS",
    "DistEnv",
    "GroupInfo",
    "ParallelState",
    "apply_backend_env",
    "comm_name",
    "destroy_groups",
    "group_by_name",
    "init_distributed",
    "layout_ranks",
    "register_group_name",
]
