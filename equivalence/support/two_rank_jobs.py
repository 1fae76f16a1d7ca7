"""Two-rank jobs in forked processes with torchrun's environment (the collective-timeout and rendezvous proofs),
and the CLI's `generate` as a rank's child."""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import socket
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

TIMEOUT_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(target, *args, timeout: float = 60.0) -> list:
    port = _free_port()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, q, *args), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return sorted(q.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _torchrun_env(rank: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)


def _cli_child(rank, port, q, configs):
    _torchrun_env(rank, port)
    from optimized.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(["generate", "--config", configs[rank], "--prompt", "hi", "--max-new-tokens", "2"])
        except SystemExit as e:
            code = e.code
    q.put((rank, code, err.getvalue()))
