"""Joining a job never hangs: a manual two-rank launch whose MASTER_PORT another program holds (it accepts the
connection and never answers, so torch's store client would wait forever) fails on both ranks with one named
line: rank 0 cannot start the store (the port is in use), rank 1 cannot reach it within
`parallel_config.collective_timeout_s` (its environment override, 2 s here).

Both ranks run `python -m optimized generate` in-process in processes started the way torchrun starts them
(env:// through `init_distributed`).
"""

from __future__ import annotations

import socket
import time

import pytest

from equivalence.support import two_rank_jobs
from equivalence.support.two_rank_jobs import REPO, TIMEOUT_S, _cli_child, _run_two_ranks
from optimized.distributed.guard import TIMEOUT_ENV

pytestmark = pytest.mark.distributed


def test_master_port_held_by_another_program_fails_both_ranks_within_the_timeout(monkeypatch):
    with socket.socket() as squatter:  # listens on the port, never speaks the store's protocol
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(8)
        port = squatter.getsockname()[1]
        monkeypatch.setenv(TIMEOUT_ENV, str(TIMEOUT_S))
        monkeypatch.setattr(two_rank_jobs, "_free_port", lambda: port)  # the ranks' MASTER_PORT: the held one
        tp2 = str(REPO / "fixtures" / "configs" / "tiny_tp2.yaml")
        start = time.monotonic()
        results = _run_two_ranks(_cli_child, [tp2, tp2], timeout=TIMEOUT_S + 30)
        waited = time.monotonic() - start
    (rank0, code0, err0), (rank1, code1, err1) = results
    assert (rank0, code0, rank1, code1) == (0, 2, 1, 2), results
    assert err0.count("\n") == 1 and err1.count("\n") == 1, results
    assert (
        f"python -m optimized: error: rank 0 cannot start the job's rendezvous store at "
        f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}: the port is already in use by another program"
    ) in err0, err0
    assert (
        f"python -m optimized: error: joining the job: rank 1 could not join the job's rendezvous store at "
        f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port} within parallel_config.collective_timeout_s={TIMEOUT_S:g} s "
        f"(environment override {TIMEOUT_ENV})"
    ) in err1, err1
    assert waited < TIMEOUT_S + 20, f"the ranks took {waited:.1f} s for a {TIMEOUT_S} s timeout"
