"""A reusable pool of real torch.distributed (gloo) worker processes for multi-rank tests.

    from equivalence.support.dist import get_pool
    results = get_pool(4).run(my_check, x, timeout=60)   # my_check(rank, world_size, x) on each rank

- `WorkerPool(world_size)` forks `world_size` workers (multiprocessing "fork" context, so test modules
  and fixtures already imported by the parent are there). Each worker sets torch threads = 1, joins a
  gloo group through a `file://` rendezvous in a private temporary directory (no port to pick, so pools
  in parallel pytest-xdist workers cannot collide; gloo's own pair sockets use ephemeral ports), then
  serves tasks until told to stop or its parent dies.
- `pool.run(fn, *args, timeout=120, **kwargs)` sends the task to every rank and returns the per-rank
  return values in rank order. `fn` must be an importable top-level function; it is called as
  `fn(rank, world_size, *args, **kwargs)`. Arguments and results are pickled through `torch.save`
  (tensors are copied, never shared memory; plain pickle cannot load float8 tensors on torch 2.13).
- Failures: if any rank raises, the call raises `DistTaskError` with every failing rank's traceback. If
  a rank does not answer within `timeout` (or dies), the call raises `DistTimeoutError` naming the ranks
  that did not answer. In both cases the pool is shut down (peers may be stuck in, or half-way through,
  a collective) and the next `get_pool(world_size)` starts a fresh one.
- `get_pool(world_size)` caches one healthy pool per world size per process; all pools are closed at
  exit. Cost (2-core CPU): see the report in the test module `tests/test_dist_harness.py`.

Fork safety: the parent has imported torch (and maybe used its OpenMP pool). The worker calls
`torch.set_num_threads(1)` before any tensor work, so ATen never enters an OpenMP region inherited
in a broken state; the parent never initializes torch.distributed. Workers ignore SIGINT (the parent
handles Ctrl-C and kills them), close the pipe ends of every other worker, and on Linux ask the kernel
to kill them when the parent dies (PR_SET_PDEATHSIG), so no worker outlives a crashed test run.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import io
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait

from optimized.ops.validation import STRICT_ENV

START_TIMEOUT_S = 120.0
# Once a rank has failed, how long the others get to answer before the pool is torn down.
ERROR_GRACE_S = 2.0

_ALL_PARENT_CONNS: list = []  # every parent-side pipe end; closed in each freshly forked worker


class DistTaskError(RuntimeError):
    """A rank raised inside `pool.run`; the message holds each failing rank's traceback."""


class DistTimeoutError(RuntimeError):
    """Some ranks did not answer in time (or died); the pool has been shut down."""


# ------------------------------------------------------------------------------------------------ worker


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _dumps(obj) -> bytes:
    """Pickle through torch.save: plain pickle cannot load float8 tensors on torch 2.13."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _send(conn, obj) -> None:
    try:
        data = _dumps(obj)
    except Exception:
        kind, ok, payload = obj
        data = _dumps((kind, False, "result could not be pickled:\n" + traceback.format_exc()))
    conn.send_bytes(data)


def _compile_in_process() -> None:
    """A rank forked from a test process that already compiled a graph inherits inductor's compile pools without
    their threads, and a compile in the rank would wait on them forever: each rank compiles in-process instead."""
    import torch._inductor.config as inductor_config
    from torch._inductor import async_compile

    inductor_config.compile_threads = 1
    for name in ("pool", "process_pool"):
        cached = getattr(async_compile.AsyncCompile, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def _set_strictness(value: str | None) -> None:
    if value is None:
        os.environ.pop(STRICT_ENV, None)
    else:
        os.environ[STRICT_ENV] = value


def _worker_main(rank: int, world_size: int, init_file: str, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    for c in _ALL_PARENT_CONNS:  # inherited copies of the parent's ends: close so EOF reaches peers
        try:
            c.close()
        except OSError:
            pass
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _compile_in_process()
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=600),
        )
        dist.barrier()
        _send(conn, ("ready", True, os.getpid()))
    except BaseException:
        _send(conn, ("ready", False, traceback.format_exc()))
        os._exit(1)
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)
        if msg is None:  # stop
            os._exit(0)
        task_id, payload = msg
        try:
            fn, args, kwargs, strictness = _loads(payload)
            _set_strictness(strictness)
            result = fn(rank, world_size, *args, **kwargs)
            reply = (task_id, True, result)
        except BaseException:
            reply = (task_id, False, traceback.format_exc())
        _send(conn, reply)


# -------------------------------------------------------------------------------------------------- pool


class WorkerPool:
    """`world_size` forked gloo ranks serving `run(fn, ...)` calls. See the module docstring."""

    def __init__(self, world_size: int, *, start_timeout: float = START_TIMEOUT_S):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.alive = False
        self._lock = threading.Lock()
        self._task = 0
        self._tmpdir = tempfile.mkdtemp(prefix=f"distpool{world_size}_")
        ctx = mp.get_context("fork")
        self._procs, self._conns = [], []
        t0 = time.perf_counter()
        init_file = os.path.join(self._tmpdir, "rendezvous")
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=_worker_main,
                name=f"distpool{world_size}-rank{rank}",
                args=(rank, world_size, init_file, child_end),
                daemon=True,
            )
            p.start()
            child_end.close()
            _ALL_PARENT_CONNS.append(parent_end)
            self._procs.append(p)
            self._conns.append(parent_end)
        self.alive = True
        try:
            self._collect("ready", start_timeout, what="start (torch.distributed gloo init)")
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - t0

    # ---- task execution
    def run(self, fn, *args, timeout: float = 120.0, **kwargs) -> list:
        """`fn(rank, world_size, *args, **kwargs)` on every rank; the results in rank order."""
        with self._lock:
            if not self.alive:
                raise RuntimeError(
                    f"this WorkerPool(world_size={self.world_size}) was shut down after a failure; "
                    f"get a fresh one with get_pool({self.world_size})"
                )
            self._task += 1
            # Each task runs under its caller's NPU-limit strictness (the equivalence conftest sets it per test),
            # not the one of whichever test happened to fork the pool.
            payload = pickle.dumps((self._task, _dumps((fn, args, kwargs, os.environ.get(STRICT_ENV)))))
            try:
                for conn in self._conns:
                    conn.send_bytes(payload)
                return self._collect(self._task, timeout, what=f"{getattr(fn, '__qualname__', fn)}")
            except (DistTaskError, DistTimeoutError):
                raise
            except BaseException:  # e.g. Ctrl-C or a broken pipe: ranks may be out of step now
                self.close()
                raise

    def _collect(self, task_id, timeout: float, what: str) -> list:
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        dead: dict[int, int | None] = {}
        deadline = time.monotonic() + timeout
        waiting = {c: r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        while waiting:
            now = time.monotonic()
            if now >= deadline:
                break
            pending = set(waiting.values())
            ready = wait(list(waiting) + [s for s, r in sentinels.items() if r in pending], timeout=deadline - now)
            for obj in ready:
                if obj in sentinels:  # the process exited: read what it left in the pipe, if anything
                    r = sentinels[obj]
                    obj = self._conns[r]
                    if obj not in waiting:
                        continue
                    if not obj.poll():
                        del waiting[obj]
                        self._procs[r].join(0.1)
                        dead[r] = self._procs[r].exitcode
                        continue
                r = waiting.get(obj)
                if r is None:
                    continue
                del waiting[obj]
                try:
                    data = obj.recv_bytes()
                except (EOFError, OSError):  # the worker's end closed: it died
                    self._procs[r].join(0.5)
                    dead[r] = self._procs[r].exitcode
                    continue
                try:
                    tid, ok, value = _loads(data)
                except Exception:
                    errors[r] = "its answer could not be unpickled here:\n" + traceback.format_exc()
                    continue
                if tid != task_id:  # cannot happen in a healthy pool
                    errors[r] = f"answered task {tid!r} while task {task_id!r} was expected"
                elif ok:
                    results[r] = value
                else:
                    errors[r] = value
            if (errors or dead) and waiting:
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        silent = sorted(waiting.values())
        if not (errors or dead or silent):
            return [results[r] for r in range(self.world_size)]
        self.close()  # peers may be stuck in (or half-way through) a collective: never reuse this pool
        parts = [f"WorkerPool(world_size={self.world_size}) {what}:"]
        for r in sorted(errors):
            parts.append(f"--- rank {r} raised:\n{errors[r]}")
        for r in sorted(dead):
            parts.append(f"--- rank {r} died (exit code {dead[r]})")
        if silent:
            reason = (
                "after another rank failed (likely blocked in a collective)"
                if (errors or dead)
                else f"within the timeout of {timeout:g} s"
            )
            parts.append(f"--- ranks {silent} did not answer {reason}")
        parts.append("The pool was shut down; the next get_pool() starts a fresh one.")
        msg = "\n".join(parts)
        if errors:
            raise DistTaskError(msg)
        raise DistTimeoutError(msg)

    # ---- shutdown
    def close(self) -> None:
        """Stop the workers (politely, then SIGKILL) and remove the rendezvous directory."""
        if not self._procs:
            return
        was_alive, self.alive = self.alive, False
        if was_alive:
            for conn in self._conns:
                try:
                    conn.send_bytes(pickle.dumps(None))
                except OSError:
                    pass
        deadline = time.monotonic() + (0.5 if was_alive else 0.0)
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)
        for conn in self._conns:
            conn.close()
            if conn in _ALL_PARENT_CONNS:
                _ALL_PARENT_CONNS.remove(conn)
        self._procs, self._conns = [], []
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_POOLS: dict[int, WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def get_pool(world_size: int) -> WorkerPool:
    """The cached healthy pool for `world_size` in this process, started on first use."""
    with _POOLS_LOCK:
        pool = _POOLS.get(world_size)
        if pool is None or not pool.alive:
            pool = _POOLS[world_size] = WorkerPool(world_size)
        return pool


def close_pools() -> None:
    with _POOLS_LOCK:
        for pool in _POOLS.values():
            pool.close()
        _POOLS.clear()


atexit.register(close_pools)
