"""Process groups: the rank layouts of a parallel config, the groups built from them, and joining the job.

- `init_distributed(...)` joins the job from torchrun's environment (LaunchError for a launch it cannot use) and
  applies the platform settings before the default group exists.
- `layout_ranks(parallel) -> {kind: [rank lists]}`, pure: `attn_tp`, `moe_tp`, `embed_tp`, `lmhead_tp` contiguous,
  `moe_ep` strided (the ranks with the same `rank % moe_tp_size`), and under attention DP `attn_dp` strided (the
  ranks with the same attention TP rank).
- `ParallelState.build(parallel, mc2_window_mb=...)`: the `torch.distributed` groups, this rank's `GroupInfo` per
  kind, plus `moe_ep_mc2`, the MC2 group with its own HCCL window. Every rank calls `new_group` for every group of
  every kind in the same order (a torch.distributed requirement); a group of size 1 is None, one spanning the world
  is the default group, identical rank lists share one group. `destroy_groups()` ends the cached subgroups (the
  default group stays) and bumps `groups_generation()`, which caches of models key on.
- `comm_name(group)`: the communicator name the MC2 operators' `group_ep` takes.
"""

from __future__ import annotations

import copy
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from optimized import envs, platform
from optimized.config import PARALLEL_OPTIONS, PARALLEL_SIZES, ParallelConfig
from optimized.errors import UsageError

# The name registry sits on the operators' floor (the MC2 kernels resolve `group_ep` there); filled from here.
from optimized.ops.process_groups import group_by_name, register_group_name  # noqa: F401  (re-exported)

KINDS = ("attn_tp", "moe_tp", "moe_ep", "embed_tp", "lmhead_tp")

# ------------------------------------------------------------------------------------------ environment


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int


class LaunchError(UsageError, RuntimeError):
    """A process started without what its multi-process run needs (torchrun's environment, a world size that
    matches the config, a free MASTER_PORT): one line from the CLIs, a RuntimeError for library callers."""


def _required(name: str, value):
    """torchrun's `value` of variable `name` (an envs accessor's), or a LaunchError saying it is missing."""
    if value is None:
        raise LaunchError(
            f"environment variable {name} is not set (WORLD_SIZE={envs.world_size()}); "
            f"start multi-process runs with torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK, "
            f"MASTER_ADDR, MASTER_PORT), or unset WORLD_SIZE for a single process"
        )
    return value


def apply_backend_env(backend: str, hccl_op_expansion_mode: str | None = "AIV") -> None:
    """Backend-specific environment, set before the process group exists.

    On NPU (hccl): `HCCL_OP_EXPANSION_MODE` defaults to AIV (collectives expanded on the AI vector cores,
    the recipe's low-latency setting) unless the environment already sets it; None leaves it alone.
    """
    if backend == "npu" and hccl_op_expansion_mode is not None:
        envs.set_default("HCCL_OP_EXPANSION_MODE", hccl_op_expansion_mode)


def init_distributed(
    *,
    hccl_op_expansion_mode: str | None = "AIV",
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    settings: "platform.PlatformSettings | None" = None,
) -> DistEnv:
    """Join the job: the one place a process group is initialized (CLI, library, parallel bench).

    Default: torchrun's env:// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); WORLD_SIZE unset
    or 1 returns DistEnv(0, 1, 0) without initializing torch.distributed. With `init_method` (e.g. file://...,
    processes started by the caller), `rank` and `world_size` are given and the local rank is the rank.
    Either way: the backend's environment, the local device selected (`set_device`) before the group exists, the
    default group with `platform.dist_backend()` (hccl / nccl / gloo). Idempotent.
    timeout: how long a collective may wait; None: `guard.collective_timeout()` (the environment variable
    QWEN3_MOE_COLLECTIVE_TIMEOUT_S, else 120 s), never torch's 30-minute default.
    settings: the per-platform settings (`platform.PlatformSettings(model_config.platform, exe_mode)`), applied here,
    before the default group exists, and its options given to that group; None: those of $PLATFORM_VERSION (else A3)
    in eager mode. hccl_op_expansion_mode overrides the A2 / A3 HCCL_OP_EXPANSION_MODE (None: leave it unset).
    """
    if dist.is_available() and dist.is_initialized():
        local = envs.local_rank()
        return DistEnv(dist.get_rank(), dist.get_world_size(), dist.get_rank() if local is None else local)
    if init_method is None:
        world_size = envs.world_size() or 1  # an EnvError (a UsageError) for a value that is not an integer >= 1
        if world_size <= 1:
            return DistEnv(0, 1, 0)
        rank = _required(envs.RANK, envs.rank())
        local = envs.local_rank()
        local_rank = rank if local is None else local
        for name, value in ((envs.MASTER_ADDR, envs.master_addr()), (envs.MASTER_PORT, envs.master_port())):
            if value is None:
                raise LaunchError(
                    f"environment variable {name} is not set (WORLD_SIZE={world_size}); "
                    f"start multi-process runs with torchrun"
                )
        init_method = "env://"
    elif rank is None or world_size is None:
        raise ValueError(f"init_distributed(init_method={init_method!r}) needs rank and world_size")
    else:
        local_rank = rank
    backend = platform.backend_name()
    settings = copy.copy(settings or platform.PlatformSettings.from_environment())
    settings.env = dict(settings.env)
    if "HCCL_OP_EXPANSION_MODE" in settings.env:
        if hccl_op_expansion_mode is None:
            del settings.env["HCCL_OP_EXPANSION_MODE"]
        else:
            settings.env["HCCL_OP_EXPANSION_MODE"] = hccl_op_expansion_mode
    settings.apply(backend)
    platform.set_device(local_rank)
    from optimized.distributed.guard import collective_timeout

    timeout = timeout if timeout is not None else collective_timeout()
    store = _join_store(init_method, rank, world_size, timeout)
    dist.init_process_group(
        platform.dist_backend(),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        pg_options=settings.group_options(platform.dist_backend(), default_group=True),
    )
    return DistEnv(rank, world_size, local_rank)


def _join_store(init_method: str, rank: int, world_size: int, timeout: datetime.timedelta):
    """The job's rendezvous store (torch's own `rendezvous(init_method)`, as init_process_group would make it),
    within `timeout`, else a StoreTimeoutError naming the store and the setting.

    torch bounds only part of this wait: a client whose MASTER_PORT is held by a program that accepts the connection
    but never answers (rank 0 failed to bind it) blocks forever. So the store is joined on a daemon thread (the
    connection releases the GIL) and the wait is bounded here; a thread still blocked is abandoned at exit.
    """
    import threading

    from torch.distributed.rendezvous import rendezvous

    from optimized.distributed.guard import TIMEOUT_ENV, TIMEOUT_KEY, StoreTimeoutError, first_line

    joined: dict = {}

    def join() -> None:
        try:
            joined["store"] = next(rendezvous(init_method, rank, world_size, timeout=timeout))[0]
        except Exception as e:  # noqa: BLE001 - handed to the waiting thread below
            joined["error"] = e

    thread = threading.Thread(target=join, name="rendezvous store", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds())
    where = (
        f"MASTER_ADDR:MASTER_PORT={envs.master_addr()}:{envs.master_port()}" if init_method == "env://" else init_method
    )
    error = joined.get("error")
    if error is not None and "EADDRINUSE" in str(error):
        raise LaunchError(
            f"rank {rank} cannot start the job's rendezvous store at {where}: the port is already in "
            f"use by another program; choose a free MASTER_PORT (torchrun --master-port PORT, or "
            f"--standalone)"
        ) from None
    if thread.is_alive() or (error is not None and "timed out" in str(error).lower()):
        host = rank == 0 and not envs.torchelastic_agent_store()
        why = (
            "the other ranks did not connect: were they started, with the same MASTER_ADDR and MASTER_PORT?"
            if host
            else "rank 0 did not start it (check rank 0's output, e.g. MASTER_PORT already in use) or "
            "another program answers on that port"
        )
        raise StoreTimeoutError(
            f"rank {rank} could not join the job's rendezvous store at {where} within "
            f"{TIMEOUT_KEY}={timeout.total_seconds():g} s (environment override {TIMEOUT_ENV}): "
            f"{why}" + (f" ({first_line(error)})" if error is not None else "")
        ) from None
    if error is not None:
        raise error
    store = joined["store"]
    store.set_timeout(timeout)
    return store


# ---------------------------------------------------------------------------------------------- layouts


def _contiguous(world_size: int, size: int) -> list[list[int]]:
    return [list(range(i * size, (i + 1) * size)) for i in range(world_size // size)]


def _strided(world_size: int, stride: int) -> list[list[int]]:
    return [list(range(j, world_size, stride)) for j in range(stride)]


def layout_ranks(parallel: ParallelConfig) -> dict[str, list[list[int]]]:
    """The rank lists of every group of every kind (validated layout; pure, no torch.distributed)."""
    parallel.validate()
    w = parallel.world_size
    return {
        "attn_tp": _contiguous(w, parallel.attn_tp_size),
        "moe_tp": _contiguous(w, parallel.moe_tp_size),
        "moe_ep": _strided(w, parallel.moe_tp_size),
        "embed_tp": _contiguous(w, parallel.embed_tp_size),
        "lmhead_tp": _contiguous(w, parallel.lmhead_tp_size),
    }


# --------------------------------------------------------------------------------------- group registry


def comm_name(group: "dist.ProcessGroup | None", rank: int | None = None) -> str:
    """The string an operator takes for `group`, registered so `group_by_name` resolves it.

    On NPU this is the HCCL communicator name (what torch_npu's MC2 operators expect); elsewhere the
    process group's own name ('' -> 'single' for no group). `get_hccl_comm_name(rank)` picks the communicator's
    device from the rank it is given (rank % devices per host), so it takes this process's rank as the group's
    backend knows it, the global one (`dist.get_global_rank(group, dist.get_rank(group))`): its rank *within* the
    group names another device as soon as the group is not ranks 0..W-1 in order (an EP group of a DP layout).
    """
    if group is None:
        return register_group_name("single", None)
    if platform.backend_name() == "npu":
        r = dist.get_global_rank(group, dist.get_rank(group)) if rank is None else rank
        name = group._get_backend(torch.device("npu")).get_hccl_comm_name(r)
    else:
        name = group.group_name
    return register_group_name(name, group)


# ------------------------------------------------------------------------------------------ group state


@dataclass(frozen=True)
class GroupInfo:
    """This rank's view of one group: the group (None when size 1), its rank list, size, rank within."""

    kind: str
    ranks: tuple[int, ...]
    group: "dist.ProcessGroup | None"
    size: int
    rank: int
    window_mb: int | None = None  # the MC2 group's HCCL window (moe_ep_mc2 only)


_GROUP_CACHE: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _new_group(ranks: tuple[int, ...], world_size: int) -> "dist.ProcessGroup | None":
    if len(ranks) == 1:
        return None
    if len(ranks) == world_size:
        return dist.group.WORLD
    if ranks not in _GROUP_CACHE:
        # Collective: every rank of the default group calls this with the same lists in the same order.
        _GROUP_CACHE[ranks] = dist.new_group(list(ranks))
    return _GROUP_CACHE[ranks]


def _new_mc2_group(ranks: tuple[int, ...], window_mb: int) -> "dist.ProcessGroup":
    """The MC2 dispatch / combine's own group over `ranks`, with its HCCL window (every rank calls this for every
    EP group in the same order). Never the default group nor another kind's: the window is this group's alone."""
    from optimized.distributed.decode_plan import mc2_group_options

    key = ("mc2", window_mb) + ranks
    if key not in _GROUP_CACHE:
        options = mc2_group_options(platform.dist_backend(), window_mb)
        _GROUP_CACHE[key] = dist.new_group(list(ranks), pg_options=options)
    return _GROUP_CACHE[key]


_GENERATION = [0]  # how many times the cached subgroups were destroyed in this process


def destroy_groups() -> None:
    """Destroy the cached subgroups (all ranks together); the default group stays. Every ParallelState built
    before holds destroyed groups afterwards: `groups_generation` tells a cache of models that it must rebuild."""
    for pg in _GROUP_CACHE.values():
        dist.destroy_process_group(pg)
    _GROUP_CACHE.clear()
    _GENERATION[0] += 1


def groups_generation() -> int:
    """Changes whenever `destroy_groups` ran: models (ParallelStates) built under another generation are stale."""
    return _GENERATION[0]


@dataclass(frozen=True)
class ParallelState:
    world_size: int
    rank: int
    parallel: ParallelConfig
    attn_tp: GroupInfo
    moe_tp: GroupInfo
    moe_ep: GroupInfo
    embed_tp: GroupInfo
    lmhead_tp: GroupInfo
    attn_dp: GroupInfo | None = None  # set by `build`; size 1 without attention DP
    world: GroupInfo | None = None  # every rank (the default group)
    moe_ep_mc2: GroupInfo | None = None  # the MC2 decode's own EP group (moe_ep's ranks), with its HCCL window

    @property
    def dp_rank(self) -> int:
        """This rank's attention DP group (0 without attention DP)."""
        return self.attn_dp.rank if self.attn_dp is not None else 0

    def close(self) -> None:
        """Destroy the process subgroups (every rank together; the default group stays): a run's explicit end,
        before `destroy_process_group`, instead of relying on garbage collection order. Idempotent."""
        destroy_groups()

    def __getitem__(self, kind: str) -> GroupInfo:
        if kind not in KINDS:
            raise KeyError(f"unknown group kind {kind!r}; kinds: {', '.join(KINDS)}")
        return getattr(self, kind)

    @classmethod
    def build(
        cls,
        parallel: ParallelConfig | None = None,
        rank: int | None = None,
        *,
        create_groups: bool | None = None,
        mc2_window_mb: int | None = None,
        **sizes,
    ) -> "ParallelState":
        """Groups for `parallel` (or keyword sizes: world_size=, attn_tp_size=, ...).

        mc2_window_mb: the HCCL window of the MC2 decode's own EP group (`decode_plan.window_for(hf_config,
        parallel, max_decode_batch, act_bytes)`); None: HCCL's default, 200 MB. Only layouts with an MC2 decode
        build that group; the runner checks at start-up that the window holds its decode batch.

        rank / world_size default to torch.distributed's when initialized, else 0 / 1. `create_groups`
        (default: torch.distributed is initialized) False gives the rank lists with every group None,
        e.g. to inspect a layout in a single process. Otherwise a world size > 1 without an initialized
        torch.distributed, or a WORLD_SIZE environment that disagrees with the config, is refused: such a
        process would compute as rank 0 of 1 and print wrong tokens.
        """
        initialized = dist.is_available() and dist.is_initialized()
        if parallel is None:
            if "world_size" not in sizes:
                sizes["world_size"] = dist.get_world_size() if initialized else 1
            unknown = set(sizes) - {"world_size", *PARALLEL_SIZES, *PARALLEL_OPTIONS}
            if unknown:
                raise TypeError(
                    f"unknown parallel sizes {sorted(unknown)}; allowed: world_size, "
                    f"{', '.join(PARALLEL_SIZES + PARALLEL_OPTIONS)}"
                )
            parallel = ParallelConfig(**sizes)
        elif sizes:
            raise TypeError("pass either a ParallelConfig or keyword sizes, not both")
        layouts = layout_ranks(parallel)
        w = parallel.world_size
        if create_groups is None:
            _check_launch(w, initialized)
            create_groups = initialized and w > 1
        if create_groups:
            if not initialized:
                raise RuntimeError("create_groups=True needs an initialized torch.distributed (init_distributed())")
            if dist.get_world_size() != w:
                raise ValueError(
                    f"parallel_config.world_size ({w}) != torch.distributed world size ({dist.get_world_size()})"
                )
            rank = dist.get_rank() if rank is None else rank
        rank = 0 if rank is None else rank
        if not 0 <= rank < w:
            raise ValueError(f"rank {rank} is outside world_size {w}")
        infos = {}
        for kind in KINDS:  # same order on every rank
            mine = None
            for ranks in layouts[kind]:
                t = tuple(ranks)
                pg = _new_group(t, w) if create_groups else None
                if rank in t:
                    mine = GroupInfo(kind, t, pg, len(t), t.index(rank))
            infos[kind] = mine
        dp_ranks = _strided(w, parallel.attn_tp_size)[rank % parallel.attn_tp_size]
        if parallel.attn_dp_size > 1:  # created only for attention DP (every rank builds the same lists in order)
            groups = [_new_group(tuple(r), w) if create_groups else None for r in _strided(w, parallel.attn_tp_size)]
            pg = groups[rank % parallel.attn_tp_size]
            infos["attn_dp"] = GroupInfo("attn_dp", tuple(dp_ranks), pg, len(dp_ranks), dp_ranks.index(rank))
        else:
            infos["attn_dp"] = GroupInfo("attn_dp", (rank,), None, 1, 0)
        world_pg = dist.group.WORLD if create_groups and w > 1 else None
        infos["world"] = GroupInfo("world", tuple(range(w)), world_pg, w, rank)
        from optimized.distributed.decode_plan import HCCL_DEFAULT_MB

        if parallel.mc2_decode:  # the MC2 decode's own group
            window = HCCL_DEFAULT_MB if mc2_window_mb is None else int(mc2_window_mb)
            for ranks in layouts["moe_ep"]:  # same order on every rank
                t = tuple(ranks)
                pg = _new_mc2_group(t, window) if create_groups else None
                if rank in t:
                    infos["moe_ep_mc2"] = GroupInfo("moe_ep_mc2", t, pg, len(t), t.index(rank), window)
        return cls(world_size=w, rank=rank, parallel=parallel, **infos)

    @classmethod
    def single(cls) -> "ParallelState":
        return cls.build(ParallelConfig(), 0, create_groups=False)


def _check_launch(world_size: int, initialized: bool) -> None:
    env = envs.world_size()  # an EnvError for a value that is not a positive integer
    if env is not None and env != world_size:
        raise LaunchError(
            f"parallel_config.world_size is {world_size} but the environment says WORLD_SIZE={env}; "
            f"launch with `torchrun --nproc-per-node {world_size}` or fix parallel_config.world_size"
        )
    if world_size > 1 and not initialized:
        raise LaunchError(
            f"parallel_config.world_size is {world_size} but torch.distributed is not initialized: "
            f"call optimized.distributed.init_distributed() first, in every process started by torchrun "
            f"(or pass create_groups=False to inspect a layout without process groups)"
        )
