"""Replay of the recorded MC2 collectives (npu_moe_distribute_dispatch_v2 / _combine_v2) as a W-rank job.

The single-process replay (equivalence/npu/test_npu_replay.py) cannot run these: a dispatch is a collective over
`ep_world_size` ranks, its `group_ep` / `group_tp` are communicator names of the recording job (gloo group names,
meaningless to HCCL in another job), and its handles (outputs 2, 4, 5) are opaque, so an NPU combine cannot take
the handle a portable dispatch wrote (spec npu_ops_moe.md §10.2, §11.1). Here instead:

- capture (`capture`): a multi-rank recording configuration runs again on the CPU (gloo ranks, portable kernels);
  every rank keeps its first dispatch and its first combine (the same layer of the same step: ranks run in
  lockstep) with their arguments and portable outputs. The combine's handle arguments are dropped at capture:
  the replay has only its own dispatch's handles to give.
- replay (`replay_rank`, on each of W ranks): a real group over the W ranks with the platform's collective
  backend (hccl with the MC2 group's HCCL window on the NPU, gloo on the CPU); its name
  (`parallel_state.comm_name`: the HCCL communicator name on the NPU) replaces the recorded group names; the
  dispatch runs with the captured x / expert_ids; expand_x[:n_recv] and expert_token_nums must equal the portable
  ones bitwise (n_recv = expert_token_nums.sum(); later rows are unspecified); then the combine runs on the
  recorded expert outputs (the recorded combine's expand_x) with this replay's dispatch handles, and its output
  must equal the recorded one within the op tolerance (equivalence/support/compare.py, as test_npu_replay's `_compare`
  picks it for a float output). Every check runs after both collectives, so a mismatch on one rank never leaves
  its peers blocked in the combine.
- a group name that is not this replay's group (e.g. the recorded one) is refused before any collective
  (`StaleGroupNameError`): on the NPU it would name no communicator of this job.

Runners: `replay_task` on the gloo worker pool (default suite) or `run_on_spawned_ranks` (fresh spawned processes
whose default group uses the platform backend: the NPU test, as the parent may already hold an NPU context that
forked children cannot use).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch

from equivalence.support.compare import assert_bitwise_equal, assert_close, op_tolerance
from equivalence.support.parallel_support import to_device

DISPATCH, COMBINE = "npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2"
GROUP_ARGS = ("group_ep", "group_tp")
# The combine's inputs that are dispatch handles (outputs 2, 4, 5): opaque, so never taken from a recording.
HANDLE_ARGS = {"assist_info_for_combine": 2, "ep_send_counts": 4, "tp_send_counts": 5}
EXPAND_X, EXPERT_TOKEN_NUMS = 0, 3


class StaleGroupNameError(ValueError):
    """A group name argument that does not name this replay's own group."""


@dataclass
class RankCapture:
    """One rank's first MC2 dispatch and combine from a recording configuration (tensors on the CPU)."""

    config: str
    rank: int
    dispatch_args: dict  # by schema name, as the model passed them (the recording job's group names)
    dispatch_out: tuple  # the portable kernel's 7 outputs
    combine_args: dict  # without the handle arguments (HANDLE_ARGS)
    combine_out: torch.Tensor

    @property
    def world(self) -> int:
        return int(self.dispatch_args["ep_world_size"])

    @property
    def n_recv(self) -> int:
        counts = self.dispatch_out[EXPERT_TOKEN_NUMS]
        cumsum = int(self.dispatch_args.get("expert_token_nums_type", 1)) == 0
        return int(counts[-1]) if cumsum and counts.numel() else int(counts.sum())


def capture(config) -> list[RankCapture]:
    """Every rank's `RankCapture` of a multi-rank recording configuration (record_npu_calls.CONFIGURATIONS)."""
    from equivalence.npu.record_npu_calls import record_mc2

    out = []
    for rank, calls in enumerate(record_mc2(config)):
        if set(calls) != {DISPATCH, COMBINE}:
            raise AssertionError(
                f"{config.name} rank {rank}: recorded MC2 calls {sorted(calls)}; expected a "
                f"dispatch and a combine (does this configuration's decode run MC2?)"
            )
        dispatch, combine = calls[DISPATCH], calls[COMBINE]
        d_args, c_args = dispatch["arguments"], dict(combine["arguments"])
        # The first combine must be the first dispatch's partner: its handle is that dispatch's output 2.
        if not (
            torch.equal(c_args["assist_info_for_combine"], dispatch["outputs"][2])
            and torch.equal(c_args["expert_ids"], d_args["expert_ids"])
        ):
            raise AssertionError(
                f"{config.name} rank {rank}: the first combine does not take the first dispatch's "
                "handle and expert_ids (are the recorded calls out of order?)"
            )
        for name in HANDLE_ARGS:
            c_args.pop(name, None)
        out.append(RankCapture(config.name, rank, d_args, tuple(dispatch["outputs"]), c_args, combine["outputs"]))
    return out


# ------------------------------------------------------------------------------------------- replay on a rank


def new_replay_group(world: int):
    """A fresh group over ranks 0..world-1 with the platform's collective backend, and on hccl the MC2 group's
    HCCL window option (decode_plan.mc2_group_options), as ParallelState builds `moe_ep_mc2`. Collective."""
    import torch.distributed as dist

    from optimized import platform
    from optimized.distributed.decode_plan import HCCL_DEFAULT_MB, mc2_group_options

    backend = platform.dist_backend()
    return dist.new_group(list(range(world)), backend=backend, pg_options=mc2_group_options(backend, HCCL_DEFAULT_MB))


def _with_group_names(arguments: dict, name: str) -> dict:
    return {k: (name if k in GROUP_ARGS and v else v) for k, v in arguments.items()}


def _check_group_names(op: str, arguments: dict, group, name: str) -> None:
    """Refuse, before any collective, a group name that does not resolve to `group` (this replay's own)."""
    from optimized.distributed.parallel_state import group_by_name

    for arg in GROUP_ARGS:
        given = arguments.get(arg)
        if not given:
            continue
        try:
            resolved = group_by_name(given)
        except KeyError:
            resolved = None
        if resolved is not group:
            raise StaleGroupNameError(
                f"{op}: {arg}={given!r} does not name this replay's group (comm_name: {name!r}); a recorded group "
                f"name belongs to the recording job and names no communicator here: substitute "
                f"parallel_state.comm_name(group)"
            )


def replay_rank(
    cap: RankCapture,
    group,
    device: torch.device | str = "cpu",
    *,
    substitute: bool = True,
    expected: RankCapture | None = None,
) -> None:
    """This rank's dispatch then combine over `group`, checked against the recorded portable outputs.

    substitute=False passes the recorded group names (refused: `StaleGroupNameError`). expected: the outputs to
    compare with (default `cap`'s; a planted test hands in altered ones). Raises AssertionError naming every
    mismatch, after both collectives ran."""
    import torch.distributed as dist

    from optimized.distributed.parallel_state import comm_name

    want = expected or cap
    if dist.get_rank(group) != int(cap.dispatch_args["ep_rank_id"]):
        raise ValueError(
            f"{cap.config}: rank {dist.get_rank(group)} of the replay group was handed the capture of "
            f"ep_rank_id {cap.dispatch_args['ep_rank_id']}"
        )
    name = comm_name(group)
    d_args = _with_group_names(cap.dispatch_args, name) if substitute else dict(cap.dispatch_args)
    c_args = _with_group_names(cap.combine_args, name) if substitute else dict(cap.combine_args)
    _check_group_names(DISPATCH, d_args, group, name)
    _check_group_names(COMBINE, c_args, group, name)

    d_args = to_device(d_args, device)
    got = torch.ops.npu.npu_moe_distribute_dispatch_v2(**d_args)
    c_args = to_device(c_args, device)
    c_args["expert_ids"] = d_args["expert_ids"]  # the same tensor given to the dispatch (spec §11.1)
    for arg, out_index in HANDLE_ARGS.items():  # this replay's own handles, never a recorded one
        c_args[arg] = got[out_index]
    combined = torch.ops.npu.npu_moe_distribute_combine_v2(**c_args)

    where = f"{cap.config} rank {cap.rank}"
    failures = []
    n_recv = want.n_recv
    checks = [
        (
            lambda: assert_bitwise_equal(
                got[EXPERT_TOKEN_NUMS].cpu(),
                want.dispatch_out[EXPERT_TOKEN_NUMS],
                f"{where}: dispatch expert_token_nums",
            )
        ),
        (
            lambda: assert_bitwise_equal(
                got[EXPAND_X][:n_recv].cpu(),
                want.dispatch_out[EXPAND_X][:n_recv],
                f"{where}: dispatch expand_x[:{n_recv}]",
            )
        ),
        (
            lambda: assert_close(
                combined.cpu(), want.combine_out, op_tolerance(want.combine_out.dtype), f"{where}: combine output"
            )
        ),
    ]
    for check in checks:
        try:
            check()
        except AssertionError as err:
            failures.append(str(err))
    if failures:
        raise AssertionError("\n".join(failures))


def replay_task(
    rank: int,
    world: int,
    captures: list[RankCapture],
    device: str | None = None,
    substitute: bool = True,
    expected: list[RankCapture] | None = None,
) -> str:
    """Worker task: a fresh replay group over the job's W ranks, then `replay_rank` on this rank's capture."""
    import torch.distributed as dist

    from optimized import platform

    if world != captures[0].world:
        raise ValueError(f"{captures[0].config}: the replay job has {world} ranks, the recording {captures[0].world}")
    from optimized.distributed.parallel_state import comm_name

    recorded = {cap.dispatch_args.get(arg) for cap in captures for arg in GROUP_ARGS}
    groups = [new_replay_group(world)]
    # A gloo group's name is a per-job counter ('0', '1', ...) that may repeat the recording job's name, and then a
    # stale name would pass unnoticed; take the next group (the counters, hence the loop, agree on every rank). An
    # HCCL communicator name never repeats across jobs.
    while comm_name(groups[-1]) in recorded:
        groups.append(new_replay_group(world))
    try:
        replay_rank(
            captures[rank],
            groups[-1],
            device or platform.device(),
            substitute=substitute,
            expected=None if expected is None else expected[rank],
        )
    finally:
        for group in groups:
            dist.destroy_process_group(group)
    return "ok"


# -------------------------------------------------------------------------------------------------- runners


def _spawned_rank(rank: int, world: int, init_file: str, payload: bytes, queue) -> None:
    import torch.distributed as dist

    from equivalence.support.dist import _dumps, _loads
    from optimized import platform

    try:
        import optimized  # noqa: F401  (portable kernels where torch_npu is absent)

        if platform.backend_name() == "npu":  # pragma: no cover - needs torch_npu
            torch.npu.set_device(rank)
        dist.init_process_group(
            platform.dist_backend(),
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=300),
        )
        fn, args, kwargs = _loads(payload)
        queue.put((rank, True, _dumps(fn(rank, world, *args, **kwargs))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_spawned_ranks(world: int, fn, *args, timeout: float = 300, **kwargs) -> list:
    """`fn(rank, world, *args, **kwargs)` on `world` freshly spawned processes, each with a default group on the
    platform's backend (hccl on the NPU: rank r on NPU r). Results in rank order; a rank that raises, dies or
    does not answer within `timeout` fails the call with every rank's story, and no process is left running."""
    import queue as queue_mod

    import torch.multiprocessing as mp

    from equivalence.support.dist import _dumps, _loads

    ctx = mp.get_context("spawn")
    results, errors = {}, {}
    with tempfile.TemporaryDirectory(prefix="mc2replay_") as tmp:
        q = ctx.Queue()
        payload = _dumps((fn, args, kwargs))
        procs = [
            ctx.Process(target=_spawned_rank, args=(r, world, os.path.join(tmp, "rendezvous"), payload, q), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < world and time.monotonic() < deadline:
                try:
                    rank, ok, value = q.get(timeout=1.0)
                except queue_mod.Empty:
                    if errors or any(p.exitcode not in (None, 0) for p in procs):
                        deadline = min(deadline, time.monotonic() + 5)  # the rest may be stuck in a collective
                    continue
                if ok:
                    results[rank] = _loads(value)
                else:
                    errors[rank] = value
                    deadline = min(deadline, time.monotonic() + 5)
        finally:
            for p in procs:
                p.join(1 if not errors and len(results) == world else 0)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    if errors or len(results) < world:
        silent = [r for r in range(world) if r not in results and r not in errors]
        parts = [f"{world} spawned ranks running {getattr(fn, '__qualname__', fn)}:"]
        parts += [f"--- rank {r} raised:\n{errors[r]}" for r in sorted(errors)]
        if silent:
            parts.append(f"--- ranks {silent} did not answer within {timeout:g} s (or died)")
        raise RuntimeError("\n".join(parts))
    return [results[r] for r in range(world)]
