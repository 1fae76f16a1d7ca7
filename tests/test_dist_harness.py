"""The multi-rank harness and optimized.distributed: groups and collectives equal their definitions on real gloo ranks.

Worker functions are top-level (pickled by reference) and take `(rank, world_size, ...)`. Inputs are
regenerated from a seed on both sides, so nothing large travels; expected values are computed here from
an independent restatement of the group layouts, never from `optimized.distributed.layout_ranks`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from equivalence.support.dist import DistTaskError, DistTimeoutError, WorkerPool, get_pool
from optimized import distributed as comm
from optimized.config import ConfigError, ParallelConfig

pytestmark = pytest.mark.distributed

ROWS, COLS = 8, 6  # ROWS divisible by every group size up to 8 (reduce_scatter)


# ------------------------------------------------------------------------------------------ definitions


def members(kind: str, rank: int, w: int, a: int, t: int, v: int, lm: int) -> list[int]:
    """The group of `rank` for `kind`, restated from the design (independent of optimized.distributed)."""
    if kind == "moe_ep":
        return [q for q in range(w) if q % t == rank % t]
    size = {"attn_tp": a, "moe_tp": t, "embed_tp": v, "lmhead_tp": lm}[kind]
    return [q for q in range(w) if q // size == rank // size]


def rank_input(seed: int, rank: int, dtype=torch.float32) -> torch.Tensor:
    """Integer-valued floats: sums are exact in any order, so collectives compare with torch.equal."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randint(-8, 9, (ROWS, COLS), generator=g).to(dtype)


def split_plan(seed: int, kind: str, group: list[int]) -> dict[int, list[int]]:
    """all_to_all row counts: plan[src][j] rows go from group rank `src` to group rank j (zeros allowed)."""
    g = torch.Generator().manual_seed(seed * 7 + comm.KINDS.index(kind) * 131 + group[0])
    n = len(group)
    hi = ROWS // n  # every source sends at most ROWS rows in all
    return {src: torch.randint(0, hi + 1, (n,), generator=g).tolist() for src in range(n)}


def gather_sizes(seed: int, kind: str, group: list[int]) -> list[int]:
    g = torch.Generator().manual_seed(seed * 11 + comm.KINDS.index(kind) * 17 + group[0])
    sizes = torch.randint(0, 4, (len(group),), generator=g).tolist()
    sizes[0] = max(sizes[0], 1)
    return sizes


# ------------------------------------------------------------------------------------ worker functions


def _collectives_task(rank, world_size, sizes: dict, seed: int, gather_dim: int):
    state = comm.ParallelState.build(ParallelConfig(world_size=world_size, **sizes))
    x = rank_input(seed, rank)
    out = {}
    for kind in comm.KINDS:
        info = state[kind]
        group = list(info.ranks)
        plan = split_plan(seed, kind, group)
        gs = gather_sizes(seed, kind, group)
        a2a_in = x[: sum(plan[info.rank])]
        out[kind] = dict(
            ranks=info.ranks,
            size=info.size,
            rank=info.rank,
            pg_ranks=dist.get_process_group_ranks(info.group) if info.group is not None else None,
            all_reduce=comm.all_reduce(x.clone(), info),
            all_gather=comm.all_gather(x, info, dim=gather_dim),
            all_gather_uneven=comm.all_gather(x[: gs[info.rank]], info, dim=0, sizes=gs),
            reduce_scatter=comm.reduce_scatter(x, info, dim=0),
            reduce_scatter_cols=comm.reduce_scatter(x[:, : 2 * info.size], info, dim=1) if info.size <= 3 else None,
            all_to_all=comm.all_to_all_single(a2a_in, info, input_split_sizes=plan[info.rank]),
        )
    return out


def _dtype_task(rank, world_size, seed: int):
    state = comm.ParallelState.build(world_size=world_size, attn_tp_size=world_size, moe_ep_size=world_size)
    info = state.attn_tp  # the whole world
    g = torch.Generator().manual_seed(seed * 101 + rank)
    raw = torch.randint(0, 256, (4, 5), dtype=torch.uint8, generator=g)  # every byte pattern, NaNs included
    bf = torch.randn(4, 6, generator=g).to(torch.bfloat16)
    mag = (torch.rand(4, 6, generator=g) * 3.5 + 0.5) * torch.sign(torch.randn(4, 6, generator=g))
    out = {
        "bf_gather": comm.all_gather(bf, info, dim=1),
        "bf_a2a": comm.all_to_all_single(bf.repeat(world_size, 1), info),
        "bf_sum_native": comm.all_reduce(mag.to(torch.bfloat16), info),
        "bf_sum_upcast": comm.all_reduce(mag.to(torch.bfloat16), info, upcast=True),
        "bf_rs_upcast": comm.reduce_scatter(mag.to(torch.bfloat16).repeat(world_size, 1), info, upcast=True),
        "bf_int_native": comm.all_reduce(rank_input(seed, rank, torch.bfloat16), info),
    }
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"):
        dt = getattr(torch, name)
        f8 = raw.view(dt)
        bc = f8.clone()
        comm.broadcast(bc, info, src_group_rank=world_size - 1)
        out[name] = dict(
            gather=comm.all_gather(f8, info, dim=0),
            gather_cols=comm.all_gather(f8, info, dim=1),
            a2a=comm.all_to_all_single(f8.repeat(world_size, 1)[: 4 * world_size], info),
            bcast=bc,
        )
        try:
            comm.all_reduce(f8.clone(), info)
            out[name]["reduce_error"] = None
        except TypeError as e:
            out[name]["reduce_error"] = str(e)
    return out


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")
    x = torch.ones(1)
    dist.all_reduce(x)  # rank 0 blocks here: the pool must not hang
    return rank


def _all_raise(rank, world_size):
    raise KeyError(f"bad key on {rank}")


def _sleep_on_last(rank, world_size, seconds):
    if rank == world_size - 1:
        time.sleep(seconds)
    return rank


def _die_on_zero(rank, world_size):
    if rank == 0:
        os._exit(7)
    return rank


def _identity(rank, world_size, *args, **kwargs):
    return rank, world_size, args, kwargs


def _sum_ranks(rank, world_size):
    x = torch.tensor([rank], dtype=torch.int64)
    dist.all_reduce(x)
    return int(x)


# ----------------------------------------------------------------------------------------------- layouts


@st.composite
def layouts(draw, worlds=(2, 4, 8)):
    w = draw(st.sampled_from(worlds))
    divs = [d for d in range(1, w + 1) if w % d == 0]
    t = draw(st.sampled_from(divs))
    return w, dict(
        attn_tp_size=draw(st.sampled_from(divs)),
        moe_tp_size=t,
        moe_ep_size=w // t,
        embed_tp_size=draw(st.sampled_from(divs)),
        lmhead_tp_size=draw(st.sampled_from(divs)),
        attn_dp=False,
    )  # replicated attention: these are the collectives of every group kind


@settings(max_examples=50)
@given(layouts(worlds=(1, 2, 4, 8, 16)))
def test_layout_ranks_match_definitions(layout):
    w, s = layout
    lay = comm.layout_ranks(ParallelConfig(world_size=w, **s))
    args = (w, s["attn_tp_size"], s["moe_tp_size"], s["embed_tp_size"], s["lmhead_tp_size"])
    for kind in comm.KINDS:
        groups = lay[kind]
        assert sorted(r for g in groups for r in g) == list(range(w)), f"{kind} does not partition the world"
        for g in groups:
            for r in g:
                assert g == members(kind, r, *args), (kind, r)
    for r in range(w):
        state = comm.ParallelState.build(ParallelConfig(world_size=w, **s), r, create_groups=False)
        for kind in comm.KINDS:
            info = state[kind]
            assert list(info.ranks) == members(kind, r, *args) and info.group is None
            assert info.size == len(info.ranks) and info.ranks[info.rank] == r


def test_moe_groups_cross_into_a_grid():
    lay = comm.layout_ranks(ParallelConfig(world_size=8, moe_tp_size=2, moe_ep_size=4, attn_dp=False))
    assert lay["moe_tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay["moe_ep"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ConfigError, match="moe_ep_size"):
        comm.layout_ranks(ParallelConfig(world_size=8, moe_tp_size=2, moe_ep_size=2, attn_dp=False))


def test_single_process_needs_no_distributed():
    assert not dist.is_initialized()
    env = comm.init_distributed()
    assert (env.rank, env.world_size) == (0, 1) and not dist.is_initialized()
    state = comm.ParallelState.single()
    x = torch.arange(6.0).view(2, 3)
    for kind in comm.KINDS:
        info = state[kind]
        assert (info.size, info.rank, info.group) == (1, 0, None)
        assert comm.all_reduce(x, info) is x and comm.all_gather(x, info, dim=1) is x
        assert comm.reduce_scatter(x, info, dim=0) is x and comm.all_to_all_single(x, info) is x
        assert comm.all_to_all_single(x, None, [2], [2]) is x
    assert comm.group_by_name(comm.comm_name(None)) is None


def test_init_distributed_env_errors(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="RANK is not set.*torchrun"):
        comm.init_distributed()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(RuntimeError, match="RANK must be an integer"):
        comm.init_distributed()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set"):
        comm.init_distributed()


def test_hccl_expansion_mode_default_and_override(monkeypatch):
    monkeypatch.delenv("HCCL_OP_EXPANSION_MODE", raising=False)
    comm.apply_backend_env("cpu")
    assert "HCCL_OP_EXPANSION_MODE" not in os.environ
    comm.apply_backend_env("npu")
    assert os.environ["HCCL_OP_EXPANSION_MODE"] == "AIV"
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "HOST")
    comm.apply_backend_env("npu")
    assert os.environ["HCCL_OP_EXPANSION_MODE"] == "HOST"  # the user's setting wins
    monkeypatch.delenv("HCCL_OP_EXPANSION_MODE")
    comm.apply_backend_env("npu", hccl_op_expansion_mode=None)
    assert "HCCL_OP_EXPANSION_MODE" not in os.environ


def _torchrun_like_child(rank, port, q):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    env = comm.init_distributed()
    x = torch.tensor([rank + 1.0])
    comm.all_reduce(x, dist.group.WORLD)
    q.put((env.rank, env.world_size, env.local_rank, x.item(), dist.get_backend()))
    dist.destroy_process_group()


def test_init_distributed_from_torchrun_env():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_torchrun_like_child, args=(r, port, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(q.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert got == [(0, 2, 0, 3.0, "gloo"), (1, 2, 1, 3.0, "gloo")]


# ------------------------------------------------------------------------------------------ collectives


def _check_collectives(w, sizes, seed, gather_dim):
    results = get_pool(w).run(_collectives_task, sizes, seed, gather_dim, timeout=60)
    args = (w, sizes["attn_tp_size"], sizes["moe_tp_size"], sizes["embed_tp_size"], sizes["lmhead_tp_size"])
    xs = [rank_input(seed, r) for r in range(w)]
    for r, res in enumerate(results):
        for kind in comm.KINDS:
            got = res[kind]
            grp = members(kind, r, *args)
            n, me = len(grp), grp.index(r)
            assert list(got["ranks"]) == grp and got["size"] == n and got["rank"] == me, (kind, r)
            assert got["pg_ranks"] == (grp if n > 1 else None), (kind, r)
            total = sum(xs[q] for q in grp)
            assert torch.equal(got["all_reduce"], total), (kind, r, "all_reduce")
            assert torch.equal(got["all_gather"], torch.cat([xs[q] for q in grp], dim=gather_dim)), (kind, r)
            gs = gather_sizes(seed, kind, grp)
            assert torch.equal(got["all_gather_uneven"], torch.cat([xs[q][: gs[i]] for i, q in enumerate(grp)])), (
                kind,
                r,
                "all_gather uneven",
            )
            assert torch.equal(got["reduce_scatter"], total.chunk(n, dim=0)[me]), (kind, r, "reduce_scatter")
            if got["reduce_scatter_cols"] is not None:
                assert torch.equal(got["reduce_scatter_cols"], total[:, : 2 * n].chunk(n, dim=1)[me]), (kind, r)
            plan = split_plan(seed, kind, grp)
            pieces = []
            for src_i, q in enumerate(grp):  # rows that group rank src_i sends to me, in source order
                start = sum(plan[src_i][:me])
                pieces.append(xs[q][start : start + plan[src_i][me]])
            assert torch.equal(got["all_to_all"], torch.cat(pieces)), (kind, r, "all_to_all")


@pytest.mark.parametrize(
    "w, sizes",
    [
        (2, dict(attn_tp_size=2, moe_tp_size=2, moe_ep_size=1, embed_tp_size=2, lmhead_tp_size=2)),
        (4, dict(attn_tp_size=2, moe_tp_size=2, moe_ep_size=2, embed_tp_size=1, lmhead_tp_size=4, attn_dp=False)),
        (8, dict(attn_tp_size=4, moe_tp_size=2, moe_ep_size=4, embed_tp_size=8, lmhead_tp_size=2, attn_dp=False)),
    ],
)
def test_collectives_equal_plain_math_fixed_layouts(w, sizes):
    _check_collectives(w, sizes, seed=1, gather_dim=-1)


@settings(max_examples=8)
@given(layout=layouts(), seed=st.integers(0, 2**16), gather_dim=st.sampled_from([0, 1, -1]))
def test_collectives_equal_plain_math_random_layouts(layout, seed, gather_dim):
    w, sizes = layout
    _check_collectives(w, sizes, seed, gather_dim)


@pytest.mark.parametrize("w", [2, 4, 8])
def test_bf16_and_fp8_payloads(w):
    seed = 3
    results = get_pool(w).run(_dtype_task, seed, timeout=60)
    bfs, raws, mags = [], [], []
    for r in range(w):
        g = torch.Generator().manual_seed(seed * 101 + r)
        raws.append(torch.randint(0, 256, (4, 5), dtype=torch.uint8, generator=g))
        bfs.append(torch.randn(4, 6, generator=g).to(torch.bfloat16))
        mags.append(
            ((torch.rand(4, 6, generator=g) * 3.5 + 0.5) * torch.sign(torch.randn(4, 6, generator=g))).to(
                torch.bfloat16
            )
        )
    exact_sum = sum(m.float() for m in mags)  # exact in fp32: |values| in [0.5, 4), 8 bf16 mantissa bits
    for r, res in enumerate(results):
        # data movement is bit-exact
        assert torch.equal(res["bf_gather"].view(torch.int16), torch.cat(bfs, dim=1).view(torch.int16))
        assert torch.equal(res["bf_a2a"].view(torch.int16), torch.cat([bfs[q] for q in range(w)]).view(torch.int16))
        # upcast reduction: the fp32 sum rounded once to bf16, identical on every rank
        assert torch.equal(res["bf_sum_upcast"].view(torch.int16), exact_sum.to(torch.bfloat16).view(torch.int16))
        assert torch.equal(
            res["bf_rs_upcast"].view(torch.int16),
            (exact_sum.repeat(w, 1)).to(torch.bfloat16).chunk(w)[r].view(torch.int16),
        )
        # native bf16 reduction: within one bf16 rounding per reduction step, the same on every rank
        err = (res["bf_sum_native"].float() - exact_sum).abs()
        assert bool((err <= (w - 1) * 2.0**-8 * exact_sum.abs().clamp_min(1.0) * 4).all())
        assert torch.equal(res["bf_sum_native"], results[0]["bf_sum_native"])
        assert torch.equal(res["bf_int_native"], sum(rank_input(seed, q, torch.bfloat16) for q in range(w)))
        for name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"):
            got = res[name]
            for key in ("gather", "gather_cols", "a2a", "bcast"):
                assert got[key].dtype == getattr(torch, name), (name, key)
            assert torch.equal(got["gather"].view(torch.uint8), torch.cat(raws))
            assert torch.equal(got["gather_cols"].view(torch.uint8), torch.cat(raws, dim=1))
            assert torch.equal(got["a2a"].view(torch.uint8), torch.cat(raws))
            assert torch.equal(got["bcast"].view(torch.uint8), raws[w - 1])
            assert "cannot sum" in got["reduce_error"] and "dequantize" in got["reduce_error"]


# -------------------------------------------------------------------------------------- harness behavior


def test_run_passes_args_and_kwargs_in_rank_order():
    pool = get_pool(4)
    res = pool.run(_identity, 1, "a", k=[3])
    assert res == [(r, 4, (1, "a"), {"k": [3]}) for r in range(4)]
    assert pool.run(_sum_ranks) == [6] * 4
    assert get_pool(4) is pool  # reused


def test_a_raising_rank_surfaces_its_traceback_and_the_pool_recovers():
    pool = get_pool(2)
    t0 = time.perf_counter()
    with pytest.raises(DistTaskError) as e:
        pool.run(_raise_on_rank_one, timeout=60)
    msg = str(e.value)
    assert "rank 1 raised" in msg and "ValueError: rank one refuses" in msg and "_raise_on_rank_one" in msg
    assert "ranks [0] did not answer" in msg  # rank 0 was blocked in all_reduce
    assert time.perf_counter() - t0 < 30
    assert not pool.alive
    with pytest.raises(RuntimeError, match="shut down"):
        pool.run(_sum_ranks)
    fresh = get_pool(2)
    assert fresh is not pool and fresh.run(_sum_ranks) == [1, 1]


def test_every_rank_raising_reports_every_traceback():
    with pytest.raises(DistTaskError) as e:
        get_pool(4).run(_all_raise)
    for r in range(4):
        assert f"rank {r} raised" in str(e.value) and f"bad key on {r}" in str(e.value)
    assert get_pool(4).run(_sum_ranks) == [6] * 4


def test_a_hanging_rank_times_out_with_a_clear_error_and_the_pool_recovers():
    pool = get_pool(4)
    t0 = time.perf_counter()
    with pytest.raises(DistTimeoutError, match=r"ranks \[3\] did not answer within the timeout of 1.5 s"):
        pool.run(_sleep_on_last, 60, timeout=1.5)
    assert time.perf_counter() - t0 < 10
    assert get_pool(4) is not pool and get_pool(4).run(_sleep_on_last, 0) == [0, 1, 2, 3]


def test_a_dying_rank_is_reported():
    with pytest.raises(DistTimeoutError, match=r"rank 0 died \(exit code 7\)"):
        get_pool(2).run(_die_on_zero, timeout=30)
    assert get_pool(2).run(_sum_ranks) == [1, 1]


def test_repeated_pools_start_and_close_cleanly():
    for _ in range(3):
        with WorkerPool(8) as pool:
            assert pool.run(_sum_ranks) == [28] * 8
            assert pool.start_seconds < 30
        assert not pool.alive and not pool._procs


def test_group_registry():
    assert comm.register_group_name("attn_tp:test", None) == "attn_tp:test"
    assert comm.group_by_name("attn_tp:test") is None
    with pytest.raises(KeyError, match="no process group registered under 'nope'"):
        comm.group_by_name("nope")


def _registry_task(rank, world_size):
    state = comm.ParallelState.build(world_size=world_size, moe_tp_size=2, moe_ep_size=world_size // 2, attn_dp=False)
    name = comm.comm_name(state.moe_ep.group)
    pg = comm.group_by_name(name)
    x = torch.tensor([float(rank)])
    return name, dist.get_process_group_ranks(pg), comm.all_reduce(x, pg).item()


def test_group_names_resolve_to_the_group():
    res = get_pool(4).run(_registry_task)
    assert [r[1] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r[2] for r in res] == [2.0, 4.0, 2.0, 4.0]
    assert res[0][0] == res[2][0] and res[0][0] != res[1][0]


def _fixture_built_on_rank_1(rank, world, root):
    """Rank 1 of the pool (torch.distributed initialized) builds the tiny fixture in a fresh cache root -> its
    files by name (bytes), or None on the other ranks."""
    from fixtures import checkpoints

    before = os.environ.get("QWEN3_MOE_FIXTURE_CACHE")
    os.environ["QWEN3_MOE_FIXTURE_CACHE"] = root
    try:
        if rank != 1:
            return None
        return {p.name: p.read_bytes() for p in checkpoints.checkpoint("tiny").iterdir()}
    finally:
        if before is None:
            del os.environ["QWEN3_MOE_FIXTURE_CACHE"]
        else:
            os.environ["QWEN3_MOE_FIXTURE_CACHE"] = before


def test_a_fixture_built_by_a_non_zero_rank_is_whole(tmp_path, monkeypatch):
    """transformers' save_pretrained writes only on rank 0 of an initialized job: a fixture first asked for inside a
    worker of rank 1 must still be the whole checkpoint (config.json, weights), byte for byte the single-process one,
    never a directory holding only the tokenizer that the cache then serves to every later test."""
    from fixtures import checkpoints

    got = get_pool(2).run(_fixture_built_on_rank_1, str(tmp_path / "worker"), timeout=120)[1]
    monkeypatch.setenv("QWEN3_MOE_FIXTURE_CACHE", str(tmp_path / "parent"))
    want = {p.name: p.read_bytes() for p in checkpoints.checkpoint("tiny").iterdir()}
    assert "config.json" in got and "model.safetensors" in got, sorted(got)
    assert got == want


def _model_after_another_closes_task(rank, world):
    """A cached rank model stays usable after another task's model closed its groups (destroy_groups)."""
    from equivalence.support.parallel_support import rank_model
    from fixtures.checkpoints import checkpoint

    layout = dict(world_size=world, attn_tp_size=world, moe_tp_size=1, moe_ep_size=world)
    first = rank_model(checkpoint("tiny"), layout, torch.float32)
    comm.destroy_groups()  # what a closed model or run does to every cached subgroup of this rank
    again = rank_model(checkpoint("tiny"), layout, torch.float32)
    x = torch.ones(1)
    comm.all_reduce(x, again.groups.moe_ep.group)
    return again is not first, x.item()


def test_a_cached_rank_model_is_rebuilt_after_its_groups_were_destroyed():
    from fixtures.checkpoints import checkpoint

    checkpoint("tiny")  # built here, not raced for by the ranks
    assert get_pool(4).run(_model_after_another_closes_task, timeout=120) == [(True, 4.0)] * 4
