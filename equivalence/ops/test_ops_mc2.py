"""npu_moe_distribute_dispatch_v2 / npu_moe_distribute_combine_v2 (spec §10, §11) over real gloo ranks equal
plain math, under drawn routings (`strategies.expert_routing`: every token on one expert set, so experts with zero
tokens; one EP rank receiving nothing; one rank overloaded; uniform), top_k above, equal to and below the EP size,
equal or unequal BS per rank (global_bs), with or without x_active_mask, at W = 1, 2, 4 (and W = 2 on strided
subgroups of a 4-rank world, resolved by name):

- dispatch, bit-exact: expand_x[:n_recv] holds every active slot routed to this rank's experts, grouped by local
  expert, then source rank, then source token (random bf16 bit patterns, NaNs included, survive); expert_token_nums,
  ep_recv_counts (inclusive prefix ends of the (expert, source) blocks) and the (source rank, token, k slot) of
  every row are exact; rows past n_recv are zero;
- combine, bit-exact against the same arithmetic written out: a per-expert function of each row, then
  out[t] = sum_j expert_scales[t, j] * row(t, j) in fp32 in ascending j, rounded once (rows past n_recv are
  NaN and never read; masked slots contribute nothing);
- the token counts each rank receives: from each source rank, the active slots that rank routes to its experts, and
  over all ranks every active slot exactly once (what an NPU's dispatch delivers too, whatever its wire traffic);
- validation: every semantic rule of §10.4 / §11.3 raises naming the argument, the NPU limits only in strict mode
  (W = 1 allowed there), and the fake kernels give the eager shapes (graph capture).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import strategies as st

from equivalence.support.compare import assert_bitwise_equal
from equivalence.support.dist import get_pool
from equivalence.support.parallel_support import run_property
from equivalence.support.strategies import expert_routing, routing_kinds, seeds
from optimized import distributed as comm

pytestmark = pytest.mark.distributed

H = 16
DISPATCH = torch.ops.npu.npu_moe_distribute_dispatch_v2
COMBINE = torch.ops.npu.npu_moe_distribute_combine_v2
# (E, K) per EP size: top_k below, equal to and above W (K = 1: every token on one expert).
SHAPES = {1: [(4, 1), (4, 2)], 2: [(4, 1), (4, 2), (8, 4)], 4: [(8, 1), (8, 2), (8, 4), (8, 6)]}


def _random_bits(seed: int, rows: int) -> torch.Tensor:
    """bf16 rows of random bit patterns (NaN and inf patterns included)."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(-(2**15), 2**15, (rows, H), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    )


def _mask(kind: str, seed: int, bs: int, k: int):
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "none":
        return None
    if kind == "prefix":
        return torch.arange(bs) < int(torch.randint(0, bs + 1, (1,), generator=g))
    return torch.rand(bs, k, generator=g) < 0.7


def _active(mask, ids):
    if mask is None:
        return torch.ones_like(ids, dtype=torch.bool)
    return mask.unsqueeze(1).expand_as(ids) if mask.dim() == 1 else mask


def _expert_fn(rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The stand-in FFN: row * (expert + 1) / 8 in fp32, rounded to the payload dtype."""
    return (rows.float() * ((experts.float() + 1) / 8).unsqueeze(1)).to(rows.dtype)


def _mc2_task(rank, world, case, moe_tp=1):
    """One EP group of size W = world / moe_tp (strided, as parallel_state lays out moe_ep); its rank e plays case
    rank e. Returns the dispatch outputs and the combine output."""
    if world == 1:
        group, ep_rank = None, 0
    elif moe_tp == 1:
        group, ep_rank = dist.group.WORLD, rank
    else:
        state = comm.ParallelState.build(
            world_size=world, moe_tp_size=moe_tp, moe_ep_size=world // moe_tp, attn_dp=False
        )
        group, ep_rank = state.moe_ep.group, state.moe_ep.rank
    w, e, gbs = world // moe_tp, case["E"], case["global_bs"]
    name = comm.comm_name(group)
    x_bits, x, ids, weights, mask = (case[key][ep_rank] for key in ("x_bits", "x", "ids", "weights", "mask"))
    kw = dict(
        group_ep=name,
        ep_world_size=w,
        ep_rank_id=ep_rank,
        moe_expert_num=e,
        x_active_mask=mask,
        global_bs=gbs,
        group_tp=name,
        tp_world_size=1,
        tp_rank_id=0,
        expert_shard_type=0,
        shared_expert_num=0,
        shared_expert_rank_num=0,
    )
    moved = DISPATCH(x_bits, expert_ids=ids, quant_mode=0, comm_alg="fullmesh_v2", scales=None, **kw)
    expand_x, _, assist, tokens, recv_counts, tp_counts = DISPATCH(
        x, expert_ids=ids, quant_mode=0, comm_alg="fullmesh_v2", scales=None, **kw
    )[:6]
    local = e // w
    n = int(tokens.sum())
    experts = ep_rank * local + torch.repeat_interleave(torch.arange(local), tokens)
    y = torch.full_like(expand_x, float("nan"))  # rows past n_recv: never read
    y[:n] = _expert_fn(expand_x[:n], experts)
    out = COMBINE(
        expand_x=y,
        expert_ids=ids,
        assist_info_for_combine=assist,
        ep_send_counts=recv_counts,
        tp_send_counts=tp_counts,
        expert_scales=weights,
        comm_quant_mode=0,
        **kw,
    )
    return {"moved": moved[0], "tokens": moved[3], "recv_counts": moved[4], "assist": moved[2], "out": out}


def _draw_case(world: int, kind: str, shape: int, bs: int, uneven: bool, mask_kind: str, seed: int) -> dict:
    e, k = SHAPES[world][shape % len(SHAPES[world])]
    g = torch.Generator().manual_seed(seed)
    sizes = [int(torch.randint(0, bs + 1, (1,), generator=g)) for _ in range(world)] if uneven else [bs] * world
    sizes[-1] = max(sizes[-1], 1 if sum(sizes) == 0 else 0)  # some rank holds a token
    ids, weights = expert_routing(kind, seed, sum(sizes), e, k, world)
    bits, vals = _random_bits(seed, sum(sizes)), torch.randn(sum(sizes), H, generator=g).to(torch.bfloat16)
    split = lambda t: list(t.split(sizes))  # noqa: E731
    masks = [_mask(mask_kind, seed + r, s, k) for r, s in enumerate(sizes)]
    return {
        "E": e,
        "K": k,
        "global_bs": max(max(sizes), 1) * world if uneven else 0,
        "sizes": sizes,
        "x_bits": split(bits),
        "x": split(vals),
        "ids": split(ids),
        "weights": split(weights),
        "mask": masks,
    }


def _expected_rows(case: dict, rank: int, w: int):
    """Plain math: the active slots routed to rank `rank`'s experts, in (expert, source rank, token) order."""
    local = case["E"] // w
    rows, origin, counts = [], [], []
    for expert in range(rank * local, (rank + 1) * local):
        before = len(rows)
        for s in range(w):
            act = _active(case["mask"][s], case["ids"][s])
            for t in range(case["sizes"][s]):
                for j in range(case["K"]):
                    if act[t, j] and int(case["ids"][s][t, j]) == expert:
                        rows.append(case["x_bits"][s][t])
                        origin.append((s, t, j))
        counts.append(len(rows) - before)
    return rows, origin, counts


def _expected_out(case: dict, s: int) -> torch.Tensor:
    """Plain math: sum_j w[t, j] * f(x[t], expert) in fp32, ascending j, inactive slots skipped, one rounding."""
    x, ids, weights = case["x"][s], case["ids"][s], case["weights"][s]
    act = _active(case["mask"][s], ids)
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for j in range(case["K"]):
        contrib = weights[:, j : j + 1] * _expert_fn(x, ids[:, j]).float()
        acc = acc + torch.where(act[:, j : j + 1], contrib, torch.zeros_like(contrib))
    return acc.to(x.dtype)


def _check_results(case: dict, results: list, w: int, what: str) -> None:
    e, k = case["E"], case["K"]
    local = e // w
    for rank, got in enumerate(results):
        label = f"{what} rank {rank} (E={e}, K={k}, BS {case['sizes']}, global_bs {case['global_bs']})"
        rows, origin, counts = _expected_rows(case, rank, w)
        n = len(rows)
        a = (case["global_bs"] or case["sizes"][0] * w) * min(local, k)
        assert got["moved"].shape == (a, H), f"{label}: expand_x shape {tuple(got['moved'].shape)}, A={a}"
        want = torch.stack(rows) if rows else torch.empty(0, H, dtype=torch.bfloat16)
        assert_bitwise_equal(got["moved"][:n], want, f"{label}: expand_x[:n_recv]")
        assert not bool(got["moved"][n:].view(torch.int16).any()), f"{label}: expand_x rows past n_recv not zero"
        assert got["tokens"].tolist() == counts, f"{label}: expert_token_nums {got['tokens'].tolist()} != {counts}"
        blocks = [
            sum(1 for (s, _, _), ex in zip(origin, _experts_of(case, origin)) if s == src and ex == le)
            for le in range(rank * local, (rank + 1) * local)
            for src in range(w)
        ]
        ends = torch.tensor(blocks).cumsum(0).tolist() if blocks else []
        assert got["recv_counts"].tolist() == ends, f"{label}: ep_recv_counts {got['recv_counts'].tolist()} != {ends}"
        triplets = got["assist"][: 3 * n].view(-1, 3).tolist()
        assert triplets == [list(o) for o in origin], f"{label}: assist (src rank, token, slot) {triplets} != {origin}"
        assert_bitwise_equal(got["out"], _expected_out(case, rank), f"{label}: combine output")
        # rows received from each source rank: the active slots it routes to this rank's experts
        per_source = got["recv_counts"].diff(prepend=got["recv_counts"].new_zeros(1)).view(local, w).sum(0)
        want_from = [
            sum(
                1
                for t in range(case["sizes"][s])
                for j in range(k)
                if _active(case["mask"][s], case["ids"][s])[t, j] and int(case["ids"][s][t, j]) // local == rank
            )
            for s in range(w)
        ]
        assert per_source.tolist() == want_from, f"{label}: rows from each source {per_source.tolist()} != {want_from}"
    active = sum(int(_active(case["mask"][s], case["ids"][s]).sum()) for s in range(w))
    received = sum(int(got["tokens"].sum()) for got in results)
    assert received == active, f"{what}: {received} rows received over all ranks, {active} active slots sent"


def _experts_of(case, origin):
    return [int(case["ids"][s][t, j]) for s, t, j in origin]


def _property(world: int, moe_tp: int, examples: int):
    w = world // moe_tp

    def check(kind, shape, bs, uneven, mask_kind, seed):
        kind = "one_rank_overloaded" if w == 1 and kind == "rank_gets_nothing" else kind  # one rank gets all
        case = _draw_case(w, kind, shape, bs, uneven, mask_kind, seed)
        if world == 1:
            results = [_mc2_task(0, 1, case)]
        else:
            per_rank = get_pool(world).run(_mc2_task, case, moe_tp, timeout=120)
            results = per_rank[::moe_tp]  # EP group of global rank 0: ranks 0, T, 2T, ...
            for j in range(1, moe_tp):  # the other EP groups moved the same data
                for a, b in zip(results, per_rank[j::moe_tp]):
                    assert_bitwise_equal(b["out"], a["out"], f"EP group {j} vs group 0")
        _check_results(case, results, w, f"{kind} W={w}{' (subgroup)' if moe_tp > 1 else ''}")

    run_property(
        check,
        examples,
        kind=routing_kinds,
        shape=st.integers(0, 3),
        bs=st.integers(1, 4),
        uneven=st.booleans(),
        mask_kind=st.sampled_from(["none", "prefix", "slots"]),
        seed=seeds,
    )


@pytest.mark.parametrize(
    "world, moe_tp, examples", [(1, 1, 8), (2, 1, 8), (4, 1, 6), (4, 2, 3)], ids=["w1", "w2", "w4", "w4-ep2-subgroups"]
)
def test_dispatch_combine_equal_plain_math_bit_exact(world, moe_tp, examples):
    _property(world, moe_tp, examples)


# ------------------------------------------------------------------------------------------- validation


def _single_inputs(bs=3, k=2, e=4, h=H, dtype=torch.bfloat16):
    x = torch.randn(bs, h).to(dtype)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(bs)]).to(torch.int32)
    return x, ids


def _dispatch(x, ids, **over):
    kw = dict(group_ep="single", ep_world_size=1, ep_rank_id=0, moe_expert_num=4, shared_expert_num=0)
    kw.update(over)
    return DISPATCH(x, ids, **kw)


@pytest.mark.parametrize(
    "over, error, match",
    [
        (dict(ep_rank_id=1), ValueError, "ep_rank_id=1"),
        (dict(ep_world_size=2, moe_expert_num=3), ValueError, "moe_expert_num=3"),
        (dict(expert_token_nums_type=2), ValueError, "expert_token_nums_type=2"),
        (dict(quant_mode=1), ValueError, "quant_mode=1"),
        (dict(quant_mode=2), NotImplementedError, "quant_mode=2"),
        (
            dict(ep_world_size=4, moe_expert_num=6, shared_expert_num=2, shared_expert_rank_num=1),
            ValueError,
            "shared_expert_num",
        ),
        (dict(tp_world_size=2), NotImplementedError, "tp_world_size=2"),
        (dict(tp_rank_id=1), ValueError, "tp_rank_id=1"),
        (dict(zero_expert_num=1), NotImplementedError, "zero_expert_num=1"),
        (dict(comm_alg="ring"), ValueError, "comm_alg='ring'"),
        (dict(global_bs=2), ValueError, "global_bs=2"),
        (dict(x_dtype=292), NotImplementedError, "x_dtype=292"),
        (dict(expert_scales=torch.ones(3, 2)), NotImplementedError, "expert_scales"),
        (dict(scales=torch.ones(4, H)), ValueError, "scales"),
        (dict(x_active_mask=torch.tensor([True, False, True])), ValueError, "True prefix"),
        (dict(x_active_mask=torch.ones(2, dtype=torch.bool)), ValueError, "x_active_mask has shape"),
    ],
)
def test_dispatch_rejects_invalid_arguments_naming_them(over, error, match):
    x, ids = _single_inputs()
    with pytest.raises(error, match=match):
        _dispatch(x, ids, **over)


def test_dispatch_rejects_bad_expert_ids():
    x, ids = _single_inputs()
    with pytest.raises(ValueError, match="twice in one row"):
        _dispatch(x, torch.tensor([[1, 1], [0, 2], [3, 2]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"expert_ids values must lie in \[0, moe_expert_num=4\)"):
        _dispatch(x, torch.tensor([[1, 4], [0, 2], [3, 2]], dtype=torch.int32))
    with pytest.raises(ValueError, match="x has 3 rows but expert_ids has 2"):
        _dispatch(x, ids[:2])
    with pytest.raises(ValueError, match="x has 0 rows"):
        _dispatch(x[:0], ids[:0])


def test_combine_rejects_foreign_or_mismatched_handles():
    x, ids = _single_inputs()
    expand_x, _, assist, _, counts, _, _ = _dispatch(x, ids)
    weights = torch.rand(3, 2)
    kw = dict(group_ep="single", ep_world_size=1, ep_rank_id=0, moe_expert_num=4, shared_expert_num=0)
    foreign = assist.clone()
    foreign[-1] = 0
    with pytest.raises(ValueError, match="not written by the portable"):
        COMBINE(expand_x, ids, foreign, counts, weights, **kw)
    with pytest.raises(ValueError, match="x_active_mask differs"):
        COMBINE(expand_x, ids, assist, counts, weights, x_active_mask=torch.tensor([True, True, False]), **kw)
    with pytest.raises(ValueError, match="expert_scales has shape"):
        COMBINE(expand_x, ids, assist, counts, weights[:, :1], **kw)
    with pytest.raises(NotImplementedError, match="shared_expert_x"):
        COMBINE(expand_x, ids, assist, counts, weights, shared_expert_x=x, **kw)


def test_npu_limits_only_in_strict_mode_and_w1_allowed_there(monkeypatch):
    small, ids = _single_inputs(h=64, dtype=torch.float32)
    monkeypatch.setenv("QWEN3_MOE_STRICT_NPU_LIMITS", "0")
    _dispatch(small, ids)  # H=64 fp32: fine outside strict mode
    monkeypatch.setenv("QWEN3_MOE_STRICT_NPU_LIMITS", "1")
    with pytest.raises(ValueError, match="NPU limit: H=64"):
        _dispatch(small.to(torch.bfloat16), ids)
    with pytest.raises(ValueError, match="NPU limit: x has dtype torch.float32"):
        _dispatch(torch.zeros(3, 1024), ids)
    k13 = torch.stack([torch.randperm(16)[:13] for _ in range(3)]).to(torch.int32)
    with pytest.raises(ValueError, match="NPU limit: K=13 must be <= 12"):
        _dispatch(torch.zeros(3, 1024, dtype=torch.bfloat16), k13, moe_expert_num=16, comm_alg="fullmesh_v2")
    x, ids = _single_inputs(h=1024)
    out = _dispatch(x, ids, comm_alg="fullmesh_v2")  # W = 1 passes the strict limits (spec §13.18)
    assert out[3].sum() == 6


def _bad_group_task(rank, world):
    x, ids = _single_inputs()
    name = comm.comm_name(dist.group.WORLD)
    errors = []
    for kw in (
        dict(group_ep="no-such-group", ep_world_size=world, ep_rank_id=rank),
        dict(group_ep=name, ep_world_size=world, ep_rank_id=(rank + 1) % world),
        dict(group_ep=comm.comm_name(None), ep_world_size=world, ep_rank_id=rank),
    ):
        try:
            DISPATCH(x, ids, moe_expert_num=4, **kw)
            errors.append("")
        except ValueError as err:
            errors.append(str(err))
    kw = dict(group_ep=name, ep_world_size=world, ep_rank_id=rank, moe_expert_num=4)
    ids = torch.tensor([[0, 1], [2, 3], [0, 2]], dtype=torch.int32)
    expand_x, _, assist, _, counts, _, _ = DISPATCH(x, ids, **kw)
    try:
        COMBINE(expand_x, torch.tensor([[0, 1]] * 3, dtype=torch.int32), assist, counts, torch.rand(3, 2), **kw)
        errors.append("")
    except ValueError as err:
        errors.append(str(err))
    return errors


def test_group_ep_resolution_and_handle_mismatch_errors():
    errors = get_pool(2).run(_bad_group_task)[0]
    assert "group_ep='no-such-group' names no process group" in errors[0], errors[0]
    assert "ep_rank_id=1 but this process is rank 0" in errors[1], errors[1]
    assert "has 1 ranks but ep_world_size=2" in errors[2], errors[2]
    assert "expert_ids is not the tensor given to the dispatch" in errors[3], errors[3]


def test_fake_kernels_give_the_eager_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, ids = _single_inputs(bs=5, k=3, e=8)
    weights = torch.rand(5, 3)
    kw = dict(group_ep="single", ep_world_size=1, ep_rank_id=0, moe_expert_num=8, shared_expert_num=0)
    eager = DISPATCH(x, ids, **kw)
    eager_out = COMBINE(eager[0], ids, eager[2], eager[4], weights, tp_send_counts=eager[5], **kw)
    with FakeTensorMode() as mode:
        fx, fids, fw = (mode.from_tensor(t) for t in (x, ids, weights))
        fake = DISPATCH(fx, fids, **kw)
        fake_out = COMBINE(fake[0], fids, fake[2], fake[4], fw, tp_send_counts=fake[5], **kw)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in eager]
    assert (fake_out.shape, fake_out.dtype) == (eager_out.shape, eager_out.dtype)
