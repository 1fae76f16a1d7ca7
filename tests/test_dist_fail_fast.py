"""Multi-rank runs fail fast with a named error instead of hanging or printing wrong tokens.

- A rank that stops answering makes the others fail within the configured collective timeout (2 s here),
  with an error naming `parallel_config.collective_timeout_s` and its environment override.
- Ranks started with different configs are refused at start-up by `python -m optimized generate`, naming
  the first key that differs, before any weight is loaded.
- `ParallelState.build` refuses a world size > 1 without torch.distributed, and a WORLD_SIZE environment
  that disagrees with the config.

The two-rank cases are processes started the way torchrun starts them (env:// rendezvous through
`init_distributed`), so they exercise the real start-up path; the worker pool could not (its ranks are
already initialized, with the pool's own timeout).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from equivalence.support.two_rank_jobs import (
    REPO,
    TIMEOUT_S,
    _cli_child,
    _run_two_ranks,
    _torchrun_env,
)
from optimized import distributed as comm
from optimized.distributed.guard import TIMEOUT_ENV, CollectiveTimeoutError, named_collective_errors

pytestmark = pytest.mark.distributed


def _stopped_rank_child(rank, port, q):
    _torchrun_env(rank, port)
    os.environ[TIMEOUT_ENV] = str(TIMEOUT_S)
    comm.init_distributed()  # the timeout comes from the environment
    comm.all_reduce(torch.ones(1), torch.distributed.group.WORLD)  # both ranks alive: this one completes
    if rank == 1:
        time.sleep(TIMEOUT_S + 1.0)  # stops answering (longer than rank 0 may wait)
        q.put((rank, "stopped", 0.0))
        return
    start = time.monotonic()
    try:
        with named_collective_errors(TIMEOUT_S):
            comm.all_reduce(torch.ones(1), torch.distributed.group.WORLD)
        q.put((rank, "completed", time.monotonic() - start))
    except CollectiveTimeoutError as e:
        q.put((rank, str(e), time.monotonic() - start))


def test_a_stopped_rank_makes_the_others_fail_within_the_timeout():
    (_, message, waited), (_, stopped, _) = _run_two_ranks(_stopped_rank_child)
    assert stopped == "stopped"
    assert f"parallel_config.collective_timeout_s={TIMEOUT_S:g} s" in message and TIMEOUT_ENV in message, message
    assert "another rank stopped" in message
    assert TIMEOUT_S * 0.9 <= waited < TIMEOUT_S + 3.0, f"waited {waited:.2f} s for a {TIMEOUT_S} s timeout"


def test_ranks_with_different_configs_are_refused_at_start_up(tmp_path):
    tp2 = (REPO / "fixtures" / "configs" / "tiny_tp2.yaml").read_text()
    ep2 = tmp_path / "ep2.yaml"  # same world size, another layout: would print wrong tokens with exit 0
    ep2.write_text(tp2.replace("moe_tp_size: 2", "moe_tp_size: 1").replace("moe_ep_size: 1", "moe_ep_size: 2"))
    results = _run_two_ranks(_cli_child, [str(REPO / "fixtures" / "configs" / "tiny_tp2.yaml"), str(ep2)])
    for rank, code, err in results:
        assert code == 2 and err.count("\n") == 1, (rank, code, err)
        assert (
            f"python -m optimized: error: rank {rank}: rank 1 was started with parallel_config.moe_ep_size=2 but "
            f"rank 0 with parallel_config.moe_ep_size=1"
        ) in err, err


def test_parallel_state_refuses_a_world_without_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(
        RuntimeError,
        match=r"world_size is 2 but torch.distributed is not initialized: call "
        r"optimized.distributed.init_distributed\(\) first",
    ):
        comm.ParallelState.build(world_size=2, attn_tp_size=2, moe_tp_size=2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match=r"world_size is 1 but the environment says WORLD_SIZE=4"):
        comm.ParallelState.build(world_size=1)
    assert comm.ParallelState.build(world_size=2, moe_ep_size=2, rank=1, create_groups=False).moe_ep.rank == 1
