"""MoE routing family (spec npu_ops_moe.md §2-§7) proven against plain per-slot math written here.

The references below are deliberately naive (python loops over slots/tokens, `sorted` with explicit keys) and share
no code with optimized/ops/routing.py. Bulk tensor contents come from a hypothesis-drawn seed; the structure
(sizes, dtypes, routing shape, ties, ranges, active_num, modes) is drawn by hypothesis directly.
Unspecified output regions (spec §0) are masked out of every property; the deterministic values the portable kernel
writes there are pinned separately in `test_unspecified_regions_are_deterministic`.
"""

from __future__ import annotations

import bisect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import optimized.ops  # noqa: F401  (registers torch.ops.npu.*)
from equivalence.support.compare import assert_bitwise_equal, assert_close, op_tolerance
from optimized.ops.registry import portable_kernel

npu = torch.ops.npu
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
# Canonical NaN/Inf bit patterns per width, planted into every random payload (quiet, signalling, negative, inf).
SPECIAL_BITS = {
    torch.bfloat16: [0x7FC0, 0x7F81, -1, 0x7F80, -128],  # -1 = 0xFFFF (NaN), -128 = 0xFF80 (-inf)
    torch.float16: [0x7E00, 0x7C01, -1, 0x7C00],
    torch.float32: [0x7FC00000, 0x7F800001, -1, 0x7F800000],
    torch.float8_e4m3fn: [0x7F, 0xFF],
    torch.uint8: [0xFF, 0x7F],
}


# ------------------------------------------------------------------------------------------------------------------
# strategies and input builders
# ------------------------------------------------------------------------------------------------------------------

seeds = st.integers(0, 2**31 - 1)
float_dtypes = st.sampled_from(FLOATS)
# "uniform": any expert; "skewed": every slot on one expert; "sparse": two experts only (the rest empty);
# "marker": uniform in [0, E] inclusive, E being gating's "finished" id that every range drops.
routings = st.sampled_from(["uniform", "skewed", "sparse", "marker"])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_bits(shape, dtype, seed) -> torch.Tensor:
    """Random bytes viewed as `dtype`, with NaN/Inf patterns planted: only bit-exact movement survives this."""
    width = INT_OF_WIDTH[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(width)
    bits = torch.randint(info.min, info.max, shape, generator=gen(seed), dtype=torch.int64).to(width)
    flat = bits.reshape(-1)
    for pos, pattern in enumerate(SPECIAL_BITS.get(dtype, SPECIAL_BITS[torch.uint8])):
        if pos < flat.numel():
            flat[(pos * 7) % flat.numel()] = pattern if width != torch.uint8 else pattern & 0xFF
    return bits.view(dtype)


def expert_ids(n, k, num_experts, kind, seed) -> torch.Tensor:
    g = gen(seed)
    if kind == "skewed":
        c = int(torch.randint(0, num_experts, (1,), generator=g))
        return torch.full((n, k), c, dtype=torch.int32)
    if kind == "sparse":
        pick = torch.randint(0, num_experts, (2,), generator=g)
        return pick[torch.randint(0, 2, (n, k), generator=g)].to(torch.int32)
    high = num_experts + 1 if kind == "marker" else num_experts
    return torch.randint(0, high, (n, k), generator=g, dtype=torch.int32)


@st.composite
def routing_problems(draw, max_n=9, max_k=4, max_e=8):
    n = draw(st.integers(0, max_n))
    k = draw(st.integers(1, max_k))
    num_experts = draw(st.integers(1, max_e))
    ids = expert_ids(n, k, num_experts, draw(routings), draw(seeds))
    return n, k, num_experts, ids


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_OF_WIDTH[t.element_size()]) if t.element_size() in INT_OF_WIDTH else t


# ------------------------------------------------------------------------------------------------------------------
# plain references (python loops; small sizes only)
# ------------------------------------------------------------------------------------------------------------------


def ref_gating_order(probs_row: list[float], k: int) -> list[int]:
    """Top-k expert ids: larger probability first, lower expert id first among equal probabilities."""
    return sorted(range(len(probs_row)), key=lambda e: (-probs_row[e], e))[:k]


def ref_v2_order(ef: list[int], s: int, e: int) -> tuple[list[int], list[int]]:
    """(in-range slots ordered by (expert, slot), the full stable order: in-range and above-range by id, then
    below-range ids last, each by ascending slot)."""
    in_range = sorted((f for f in range(len(ef)) if s <= ef[f] < e), key=lambda f: (ef[f], f))
    above = sorted((f for f in range(len(ef)) if ef[f] >= e), key=lambda f: (ef[f], f))
    below = [f for f in range(len(ef)) if ef[f] < s]
    return in_range, in_range + above + below


def ref_finalize(rows, skip1, skip2, bias, scales, idx, export, mode, k):
    """The spec §6 literal loop: fp32 accumulation, skip1, skip2, then ascending j; -1 contributes nothing."""
    kk = scales.shape[1] if scales is not None else k
    n = scales.shape[0] if scales is not None else idx.numel() // k
    h = rows.shape[-1]
    r2 = rows.reshape(-1, h)
    out = torch.zeros(n, h, dtype=torch.float32)
    for i in range(n):
        acc = torch.zeros(h, dtype=torch.float32)
        if skip1 is not None:
            acc = acc + skip1[i].float()
        if skip2 is not None:
            acc = acc + skip2[i].float()
        for j in range(kk):
            p = int(idx[j * n + i] if mode in (0, 1) else idx[i * kk + j])
            if p == -1:
                continue
            v = r2[p].float()
            if bias is not None:
                v = v + bias[int(export[i, j])].float()
            if scales is not None:
                v = scales[i, j].float() * v
            acc = acc + v
        out[i] = acc
    return out.to(rows.dtype)


def ref_re_routing_perm(cnt: list[list[int]]) -> list[int]:
    w, num_local = len(cnt), len(cnt[0]) if cnt else 0
    start, off = {}, 0
    for r in range(w):
        for e in range(num_local):
            start[r, e] = off
            off += cnt[r][e]
    perm = []
    for e in range(num_local):
        for r in range(w):
            perm += list(range(start[r, e], start[r, e] + cnt[r][e]))
    return perm


# ------------------------------------------------------------------------------------------------------------------
# §2 gating
# ------------------------------------------------------------------------------------------------------------------


@st.composite
def gating_problems(draw):
    dtype = draw(float_dtypes)
    three_d = draw(st.booleans())
    lead = (draw(st.integers(0, 3)), draw(st.integers(1, 3))) if three_d else (draw(st.integers(0, 6)),)
    num_experts = draw(st.integers(1, 9))
    k = draw(st.integers(0, num_experts))
    g = gen(draw(seeds))
    kind = draw(st.sampled_from(["random", "exact_ties", "near_ties"]))
    if kind == "exact_ties":  # few distinct integer logits: equal logits give bitwise-equal fp32 probabilities
        x = torch.randint(-1, 2, lead + (num_experts,), generator=g).to(dtype)
    elif kind == "near_ties":  # one logit plus a few ulps: ties or near-ties after rounding to dtype/softmax
        x = (1.0 + torch.randint(0, 3, lead + (num_experts,), generator=g) * torch.finfo(dtype).eps).to(dtype)
    else:
        x = (torch.randn(lead + (num_experts,), generator=g) * 3).to(dtype)
    finished = torch.rand(lead, generator=g) < 0.3 if draw(st.booleans()) else None
    return x, finished, k


@given(gating_problems())
def test_gating_matches_fp32_softmax_and_stable_topk(problem):
    x, finished, k = problem
    y, idx, row_idx = npu.npu_moe_gating_top_k_softmax(x, finished, k=k)
    lead, num_experts = tuple(x.shape[:-1]), x.shape[-1]
    assert y.shape == idx.shape == row_idx.shape == lead + (k,)
    assert y.dtype == x.dtype and idx.dtype == row_idx.dtype == torch.int32
    if k == 0:
        return
    n = y.numel() // k
    xf = x.reshape(-1, num_experts).float()
    probs = torch.softmax(xf, dim=-1)  # spec §2 step 2 defines P as the fp32 softmax
    # the fp32 softmax itself against max-subtracted exp / row sum in float64
    manual = (xf.double() - xf.double().amax(-1, keepdim=True)).exp()
    manual = manual / manual.sum(-1, keepdim=True)
    assert_close(probs, manual.float(), "op.float32", "softmax")
    yf, idxf, rowf = y.reshape(-1, k), idx.reshape(-1, k), row_idx.reshape(-1, k)
    done = finished.reshape(-1) if finished is not None else torch.zeros(n, dtype=torch.bool)
    for i in range(n):
        order = ref_gating_order(probs[i].tolist(), k)
        expected_y = probs[i, order].to(x.dtype)
        assert_bitwise_equal(yf[i], expected_y, f"y row {i}")  # unchanged even on finished rows
        expected_idx = [num_experts] * k if done[i] else order
        assert idxf[i].tolist() == expected_idx, f"row {i}: {idxf[i].tolist()} != {expected_idx}"
        assert rowf[i].tolist() == [j * n + i for j in range(k)]
        assert bool((yf[i, 1:] <= yf[i, :-1]).all()), "y must be non-increasing"
        assert float(yf[i].float().sum()) <= 1 + 4 * torch.finfo(x.dtype).eps * max(k, 1)


def test_gating_tie_and_layout_choices_pinned():
    # Spec §13.1: ties go to the lower expert id; 3-D input flattens the leading dims for row_idx.
    x = torch.zeros(2, 3, 6)
    x[..., 4] = 1.0
    y, idx, row_idx = npu.npu_moe_gating_top_k_softmax(x, None, k=3)
    assert idx.reshape(-1, 3).tolist() == [[4, 0, 1]] * 6
    assert row_idx.reshape(-1, 3).tolist() == [[i, 6 + i, 12 + i] for i in range(6)]
    assert bool((y[..., 1] == y[..., 2]).all())
    # distinct logits: agrees with torch.topk
    z = torch.randn(7, 16, generator=gen(3))
    _, idx2, _ = npu.npu_moe_gating_top_k_softmax(z, None, k=5)
    assert torch.equal(idx2.long(), torch.topk(z, 5).indices)


# ------------------------------------------------------------------------------------------------------------------
# §3 init_routing v1, and its relation to v2
# ------------------------------------------------------------------------------------------------------------------


@given(routing_problems(), float_dtypes, st.integers(0, 12), st.booleans(), seeds)
def test_init_routing_v1_matches_per_slot_reference(problem, dtype, active_num, shuffle_rows, seed):
    n, k, _, ids = problem
    x = random_bits((n, 3), dtype, seed)
    row_idx = torch.arange(n * k, dtype=torch.int32).reshape(k, n).t().contiguous()  # canonical (gating) layout
    if shuffle_rows:  # any permutation of [0, N*K) is allowed
        row_idx = torch.randperm(n * k, generator=gen(seed + 1)).to(torch.int32).reshape(n, k)
    ex, eri, eei = npu.npu_moe_init_routing(x, row_idx, ids, active_num)
    ef, rf = ids.reshape(-1).tolist(), row_idx.reshape(-1).tolist()
    order = sorted(range(n * k), key=lambda f: (ef[f], f))  # stable by expert over flat slot i*K + j
    assert eei.tolist() == [ef[f] for f in order]
    expected_eri = [0] * (n * k)
    for p, f in enumerate(order):
        expected_eri[rf[f]] = p
    assert eri.dtype == torch.int32 and eri.tolist() == expected_eri
    rows = min(n, active_num) * k
    assert ex.shape == (rows, 3)
    expected_x = torch.stack([x[rf[order[p]] % n] for p in range(rows)]) if rows else x[:0]
    assert_bitwise_equal(ex, expected_x, "v1 expanded_x")


@given(routing_problems(), float_dtypes, seeds)
def test_init_routing_v1_equals_v2_transposed(problem, dtype, seed):
    n, k, num_experts, ids = problem
    ids = ids.clamp(max=num_experts - 1)  # full range: every id valid
    x = random_bits((n, 4), dtype, seed)
    row_idx = torch.arange(n * k, dtype=torch.int32).reshape(k, n).t().contiguous()
    ex1, eri1, eei1 = npu.npu_moe_init_routing(x, row_idx, ids, n)
    ex2, eri2, _, _ = npu.npu_moe_init_routing_v2(x, ids, expert_num=num_experts)
    assert_bitwise_equal(ex1, ex2, "v1 and v2 expanded_x")
    assert torch.equal(eri1.reshape(k, n).t(), eri2.reshape(n, k)), "v1 index is the v2 index transposed"
    assert torch.equal(eei1, ids.reshape(-1).sort(stable=True).values)


# ------------------------------------------------------------------------------------------------------------------
# §4 init_routing_v2
# ------------------------------------------------------------------------------------------------------------------


@st.composite
def v2_problems(draw):
    n, k, num_experts, ids = draw(routing_problems())
    s = draw(st.integers(0, num_experts - 1))
    e = draw(st.integers(s + 1, num_experts))
    full = draw(st.booleans())
    rng = [] if full and draw(st.booleans()) else ([0, num_experts] if full else [s, e])
    active_num = draw(st.sampled_from([-1, 0, 1, 2, n * k // 2, n * k, n * k + 3]))
    return dict(
        n=n,
        k=k,
        num_experts=num_experts,
        ids=ids,
        range=rng,
        active_num=active_num,
        count_type=draw(st.sampled_from([0, 1, 2])),
        row_idx_type=draw(st.sampled_from([0, 1])),
        dtype=draw(st.sampled_from(FLOATS + (torch.float8_e4m3fn, torch.int8))),
        with_scale=draw(st.booleans()),
        seed=draw(seeds),
    )


@given(v2_problems())
def test_init_routing_v2_dropless_matches_per_slot_reference(p):
    n, k, num_experts, ids = p["n"], p["k"], p["num_experts"], p["ids"]
    s, e = p["range"] or (0, num_experts)
    x = (
        random_bits((n, 5), p["dtype"], p["seed"])
        if p["dtype"] != torch.int8
        else torch.randint(-128, 128, (n, 5), generator=gen(p["seed"]), dtype=torch.int8)
    )
    scale = random_bits((n,), torch.float32, p["seed"] + 1) if p["with_scale"] else None
    ex, eri, counts, escale = npu.npu_moe_init_routing_v2(
        x,
        ids,
        scale=scale,
        active_num=p["active_num"],
        expert_num=num_experts,
        active_expert_range=p["range"],
        expert_tokens_num_type=p["count_type"],
        expert_tokens_num_flag=True,
        row_idx_type=p["row_idx_type"],
    )
    ef = ids.reshape(-1).tolist()
    valid_order, full_order = ref_v2_order(ef, s, e)
    avail = len(valid_order)
    rows_out = n * k if p["active_num"] <= 0 else min(p["active_num"], n * k)
    n_valid = min(avail, rows_out)
    assert ex.shape == (rows_out, 5) and ex.dtype == x.dtype
    assert eri.shape == (n * k,) and eri.dtype == torch.int32 and escale.shape == (rows_out,)
    # property 1/6: valid rows are bit-exact copies of their token (NaN patterns included)
    for pos in range(n_valid):
        assert_bitwise_equal(ex[pos], x[valid_order[pos] // k], f"expanded_x row {pos}")
        if scale is not None:
            assert_bitwise_equal(escale[pos], scale[valid_order[pos] // k], f"expanded_scale row {pos}")
    if p["row_idx_type"] == 0:
        expected = [-1] * (n * k)
        for pos, f in enumerate(valid_order):
            expected[f] = pos  # numbers all avail slots, even past rows_out (spec §4.8)
        assert eri.tolist() == expected
    else:
        assert eri[:avail].tolist() == valid_order
        assert eri.tolist() == full_order  # spec §13.4 choice: the tail continues the stable order
    # property 3: expert non-decreasing along valid rows, source slot increasing within an expert
    experts = [ef[f] for f in valid_order]
    assert experts == sorted(experts)
    # property 4: counts
    cnt = [sum(1 for f in range(n * k) if ef[f] == s + r) for r in range(e - s)]
    assert counts.dtype == torch.int64
    if p["count_type"] == 1:
        assert counts.tolist() == cnt and sum(cnt) == avail
    elif p["count_type"] == 0:
        assert counts.tolist() == [sum(cnt[: r + 1]) for r in range(e - s)]
    else:
        pairs = [[s + r, c] for r, c in enumerate(cnt) if c > 0]
        assert counts.tolist() == pairs + [[0, 0]] * (num_experts - len(pairs))


@given(v2_problems())
def test_init_routing_v2_type0_and_type1_are_inverse(p):
    n, k, num_experts, ids = p["n"], p["k"], p["num_experts"], p["ids"]
    x = torch.zeros(n, 2)
    kw = dict(expert_num=num_experts, active_expert_range=p["range"])
    _, eri0, counts, _ = npu.npu_moe_init_routing_v2(x, ids, row_idx_type=0, expert_tokens_num_type=1, **kw)
    _, eri1, _, _ = npu.npu_moe_init_routing_v2(x, ids, row_idx_type=1, **kw)
    for f in range(n * k):
        if eri0[f] >= 0:
            assert int(eri1[eri0[f]]) == f
    assert int((eri0 >= 0).sum()) == int(counts.sum())


@given(
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(0, 8),
    st.integers(1, 3),
    routings,
    seeds,
    st.sampled_from([torch.bfloat16, torch.float32]),
)
def test_init_routing_v2_range_partition(world, local, n, k, kind, seed, dtype):
    num_experts = world * local
    ids = expert_ids(n, k, num_experts, kind, seed)
    x = random_bits((n, 3), dtype, seed + 2)
    full = npu.npu_moe_init_routing_v2(x, ids, expert_num=num_experts, expert_tokens_num_type=1)
    parts, counts = [], []
    for r in range(world):
        ex, _, cnt, _ = npu.npu_moe_init_routing_v2(
            x, ids, expert_num=num_experts, expert_tokens_num_type=1, active_expert_range=[r * local, (r + 1) * local]
        )
        parts.append(ex[: int(cnt.sum())])
        counts.append(cnt)
    avail = int(full[2].sum())
    assert_bitwise_equal(torch.cat(parts), full[0][:avail], "range partition of expanded_x")
    assert torch.equal(torch.cat(counts), full[2])


@given(routing_problems(max_n=8), st.integers(1, 8), st.sampled_from([0, 1, 2]), st.booleans(), float_dtypes, seeds)
def test_init_routing_v2_drop_pad_matches_reference(problem, cap_seed, count_type, with_scale, dtype, seed):
    n, k, num_experts, ids = problem
    if n == 0:
        return  # 0 < expert_capacity <= N is required
    cap = 1 + cap_seed % n
    x = random_bits((n, 3), dtype, seed)
    scale = random_bits((n,), torch.float32, seed + 1) if with_scale else None
    ex, eri, counts, escale = npu.npu_moe_init_routing_v2(
        x,
        ids,
        scale=scale,
        expert_num=num_experts,
        drop_pad_mode=1,
        expert_capacity=cap,
        expert_tokens_num_type=count_type,
    )
    assert ex.shape == (num_experts, cap, 3) and escale.shape == (num_experts * cap,)
    ef = ids.reshape(-1).tolist()
    valid_order, _ = ref_v2_order(ef, 0, num_experts)
    filled = torch.zeros(num_experts, cap, dtype=torch.bool)
    expected_eri = [-1] * (n * k)
    for f in valid_order:
        slot = sum(1 for g in valid_order if ef[g] == ef[f] and (ef[g], g) < (ef[f], f))
        if slot < cap:  # earliest tokens win, the rest are dropped
            expected_eri[f] = ef[f] * cap + slot
            filled[ef[f], slot] = True
            assert_bitwise_equal(ex[ef[f], slot], x[f // k], f"slot ({ef[f]}, {slot})")
            if scale is not None:
                assert_bitwise_equal(escale[ef[f] * cap + slot], scale[f // k])
    assert eri.tolist() == expected_eri
    assert not bool((bits_of(ex[~filled]) != 0).any()), "padding slots are zero"
    cnt = [ef.count(r) for r in range(num_experts)]  # spec §13.7: counts before capacity clipping
    expected = {1: cnt, 0: [sum(cnt[: r + 1]) for r in range(num_experts)]}.get(count_type)
    if expected is not None:
        assert counts.tolist() == expected
    else:
        pairs = [[r, c] for r, c in enumerate(cnt) if c > 0]
        assert counts.tolist() == pairs + [[0, 0]] * (num_experts - len(pairs))


def test_init_routing_v2_fp8_bytes_as_bf16_round_trip():
    # Qwen3 path C: fp8 bytes viewed as bf16 pass through routing untouched, every NaN pattern included.
    n, k, num_experts, h = 16, 4, 8, 64
    raw = torch.arange(n * h * 2, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(n, 2 * h)
    raw = raw[torch.randperm(n, generator=gen(0))]
    x = raw.view(torch.float8_e4m3fn).view(torch.bfloat16)
    assert bool(x.isnan().any())
    ids = expert_ids(n, k, num_experts, "marker", 1)
    for rng in ([0, 4], [4, 8]):
        ex, eri, cnt, _ = npu.npu_moe_init_routing_v2(
            x, ids, expert_num=num_experts, expert_tokens_num_type=1, active_num=n * k, active_expert_range=rng
        )
        for f in range(n * k):
            if int(eri[f]) >= 0:
                assert_bitwise_equal(ex[int(eri[f])], x[f // k])
    xs = torch.randint(0, 256, (n, 2, 2), generator=gen(2), dtype=torch.uint8)  # e8m0 [N, ceil(128/64), 2]
    ex, eri, _, es = npu.npu_moe_init_routing_v2(raw[:, :64], ids, scale=xs, expert_num=num_experts, x_dtype=296)
    for f in range(n * k):
        if int(eri[f]) >= 0:
            assert_bitwise_equal(es[int(eri[f])], xs[f // k])


# ------------------------------------------------------------------------------------------------------------------
# §5 compute_expert_tokens
# ------------------------------------------------------------------------------------------------------------------


@given(st.lists(st.integers(0, 9), max_size=30), st.integers(1, 8))
def test_compute_expert_tokens_is_binary_search_end(values, num_expert):
    rows = torch.tensor(sorted(values), dtype=torch.int32)
    out = npu.npu_moe_compute_expert_tokens(rows, num_expert)
    assert out.dtype == torch.int32 and out.shape == (num_expert,)
    assert out.tolist() == [bisect.bisect_right(sorted(values), i) for i in range(num_expert)]
    histogram = [sum(1 for v in values if v == i) for i in range(num_expert)]  # ids >= num_expert never counted
    assert torch.diff(out, prepend=out.new_zeros(1)).tolist() == histogram


def test_compute_expert_tokens_example():
    assert npu.npu_moe_compute_expert_tokens(torch.tensor([0, 0, 0, 1, 1, 2], dtype=torch.int32), 3).tolist() == [
        3,
        5,
        6,
    ]


# ------------------------------------------------------------------------------------------------------------------
# §6 finalize_routing
# ------------------------------------------------------------------------------------------------------------------


@given(v2_problems(), st.sampled_from([(), (3,), (2, 2)]))
def test_init_routing_v2_traced_body_equals_the_kernel_bitwise(p, scale_tail):
    """The body a compiled graph inlines (masks and a scatter-add instead of host-sized slices and bincount) gives
    the kernel's four outputs bit for bit, every row and index included; key-value counts stay an operator
    (NotImplemented), as does drop/pad mode."""
    from optimized.ops.routing import moe_init_routing_v2_traced

    x = (
        random_bits((p["n"], 5), p["dtype"], p["seed"])
        if p["dtype"] != torch.int8
        else torch.randint(-128, 128, (p["n"], 5), generator=gen(p["seed"]), dtype=torch.int8)
    )
    scale = random_bits((p["n"],) + scale_tail, torch.float32, p["seed"] + 1) if p["with_scale"] else None
    if scale is not None and scale_tail:  # MX row scales: uint8 [N, ceil(H/64), 2] beside a 1-byte x
        if x.element_size() != 1:
            return
        scale = torch.randint(0, 256, (p["n"], 1, 2), generator=gen(p["seed"]), dtype=torch.uint8)
    kw = dict(
        scale=scale,
        active_num=p["active_num"],
        expert_num=p["num_experts"],
        active_expert_range=p["range"],
        expert_tokens_num_type=p["count_type"],
        expert_tokens_num_flag=True,
        row_idx_type=p["row_idx_type"],
    )
    got = moe_init_routing_v2_traced(x, p["ids"], **kw)
    if p["count_type"] == 2:
        assert got is NotImplemented
        return
    want = portable_kernel("npu_moe_init_routing_v2")(x, p["ids"], **kw)
    for name, a, b in zip(("expanded_x", "expanded_row_idx", "expert_tokens", "expanded_scale"), got, want):
        assert_bitwise_equal(a, b, f"traced init routing vs kernel: {name}")
    assert moe_init_routing_v2_traced(x, p["ids"], **kw, drop_pad_mode=1, expert_capacity=1) is NotImplemented


@st.composite
def finalize_problems(draw):
    mode = draw(st.sampled_from([0, 1, 2, 3]))
    dtype = draw(float_dtypes)
    n, kk, h = draw(st.integers(0, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 5))
    g = gen(draw(seeds))
    if mode in (1, 3):
        num_experts, cap = draw(st.integers(1, 4)), draw(st.integers(1, 4))
        rows = torch.randn(num_experts, cap, h, generator=g).to(dtype)
        num_rows = num_experts * cap
    else:
        num_rows = n * kk + draw(st.integers(0, 3))  # rows past the indexed ones are never read
        rows = torch.randn(num_rows, h, generator=g).to(dtype)
    idx = torch.randint(0, max(num_rows, 1), (n * kk,), generator=g, dtype=torch.int32)
    idx[torch.rand(n * kk, generator=g) < draw(st.sampled_from([0.0, 0.3, 1.0]))] = -1
    if num_rows == 0:
        idx.fill_(-1)
    with_scales = draw(st.booleans())
    scales_dtype = torch.float32 if dtype == torch.bfloat16 and draw(st.booleans()) else dtype
    scales = torch.rand(n, kk, generator=g).to(scales_dtype) if with_scales else None
    skip1 = torch.randn(n, h, generator=g).to(dtype) if draw(st.booleans()) else None
    skip2 = torch.randn(n, h, generator=g).to(dtype) if skip1 is not None and draw(st.booleans()) else None
    num_bias = draw(st.integers(1, 5))
    export = torch.randint(0, num_bias, (n, kk), generator=g, dtype=torch.int32)
    bias = torch.randn(num_bias, h, generator=g).to(dtype) if draw(st.booleans()) else None
    if bias is None and draw(st.booleans()):
        export = None
    return dict(
        rows=rows,
        skip1=skip1,
        skip2=skip2,
        bias=bias,
        scales=scales,
        idx=idx,
        export=export,
        mode=mode,
        k=kk if scales is None else draw(st.integers(1, 3)),
    )


@given(finalize_problems())
def test_finalize_matches_literal_loop(p):
    out = npu.npu_moe_finalize_routing(
        p["rows"],
        p["skip1"],
        p["skip2"],
        p["bias"],
        p["scales"],
        p["idx"],
        p["export"],
        drop_pad_mode=p["mode"],
        k=p["k"],
    )
    expected = ref_finalize(
        p["rows"], p["skip1"], p["skip2"], p["bias"], p["scales"], p["idx"], p["export"], p["mode"], p["k"]
    )
    assert out.dtype == p["rows"].dtype and out.shape == expected.shape
    # The spec fixes the fp32 order (skip1, skip2, ascending j), and the reference follows it: equal values.
    assert torch.equal(out, expected), f"not equal to the fixed-order loop; {out} vs {expected}"


@given(finalize_problems())
def test_finalize_traced_body_equals_the_kernel_bitwise(p):
    """The body a compiled graph inlines (no host read of the index ranges) gives the kernel's result bit for bit."""
    from optimized.ops.routing import moe_finalize_routing_traced

    args = (p["rows"], p["skip1"], p["skip2"], p["bias"], p["scales"], p["idx"], p["export"])
    want = portable_kernel("npu_moe_finalize_routing")(*args, drop_pad_mode=p["mode"], k=p["k"])
    assert_bitwise_equal(
        moe_finalize_routing_traced(*args, drop_pad_mode=p["mode"], k=p["k"]), want, "traced finalize vs kernel"
    )


@given(finalize_problems())
def test_finalize_minus_one_rows_contribute_nothing(p):
    idx, rows = p["idx"], p["rows"]
    args = (p["skip1"], p["skip2"], p["bias"])
    out = npu.npu_moe_finalize_routing(rows, *args, p["scales"], idx, p["export"], drop_pad_mode=p["mode"], k=p["k"])
    # Poison every weight and every row not addressed: a -1 slot must not read any of it (no row, no bias).
    scales = p["scales"]
    if scales is not None:
        n, kk = scales.shape
        slot = idx.view(kk, n).t() if p["mode"] in (0, 1) else idx.view(n, kk)
        scales = torch.where(slot < 0, torch.tensor(float("nan"), dtype=scales.dtype), scales)
    used = torch.zeros(rows.reshape(-1, rows.shape[-1]).shape[0], dtype=torch.bool)
    used[idx[idx >= 0].long()] = True
    poisoned = rows.reshape(-1, rows.shape[-1]).clone()
    poisoned[~used] = float("inf")
    out2 = npu.npu_moe_finalize_routing(
        poisoned.reshape(rows.shape), *args, scales, idx, p["export"], drop_pad_mode=p["mode"], k=p["k"]
    )
    assert torch.equal(out, out2)
    if bool((idx == -1).all()):
        base = torch.zeros_like(out, dtype=torch.float32)
        for skip in args[:2]:
            if skip is not None:
                base = base + skip.float()
        assert torch.equal(out, base.to(out.dtype))


def test_finalize_minus_one_choice_pinned():
    # Spec §13.8/§13.9: -1 gives zero contribution in every mode, and no bias either.
    rows = torch.ones(4, 2)
    bias = torch.full((2, 2), 100.0)
    idx = torch.tensor([0, -1, 2, -1], dtype=torch.int32)
    export = torch.zeros(2, 2, dtype=torch.int32)
    expected = {
        2: [[101.0, 101.0], [101.0, 101.0]],  # row layout: token i uses idx[2i], idx[2i+1]
        0: [[202.0, 202.0], [0.0, 0.0]],
    }  # column layout: token i uses idx[i], idx[2+i]
    for mode, want in expected.items():
        out = npu.npu_moe_finalize_routing(rows, None, None, bias, None, idx, export, drop_pad_mode=mode, k=2)
        assert out.tolist() == want, f"mode {mode}"


def test_finalize_accumulation_order_pinned():
    # Spec §6: fp32 accumulation skip1, skip2, then ascending j. With 1 and two halves of an fp32 ulp the order
    # is visible: 1 + 2^-24 + 2^-24 == 1 (ties to even twice), 2^-24 + 2^-24 + 1 == 1 + 2^-23.
    tiny = 2.0**-24
    rows = torch.tensor([[1.0], [tiny], [tiny]])
    out = npu.npu_moe_finalize_routing(
        rows, None, None, None, None, torch.tensor([0, 1, 2], dtype=torch.int32), None, drop_pad_mode=2, k=3
    )
    assert out.item() == 1.0, "choices are summed in ascending j"
    skip = torch.tensor([[1.0]])
    out = npu.npu_moe_finalize_routing(
        rows[1:], skip, None, None, None, torch.tensor([0, 1], dtype=torch.int32), None, drop_pad_mode=2, k=2
    )
    assert out.item() == 1.0, "skip1 is accumulated before the choices"


@given(routing_problems(), float_dtypes, seeds, st.booleans())
def test_init_routing_v2_then_finalize_is_weighted_expert_sum(problem, dtype, seed, fp32_scales):
    n, k, num_experts, ids = problem
    g = gen(seed)
    x = torch.randn(n, 6, generator=g).to(dtype)
    w = torch.rand(n, k, generator=g)
    w = w.to(torch.float32 if fp32_scales and dtype == torch.bfloat16 else dtype)
    ef = ids.tolist()
    full = None
    partials = []
    world = 2 if num_experts % 2 == 0 else 1
    local = num_experts // world
    for rng in [[0, num_experts]] + [[r * local, (r + 1) * local] for r in range(world)]:
        ex, eri, _, _ = npu.npu_moe_init_routing_v2(
            x, ids, expert_num=num_experts, active_expert_range=rng, expert_tokens_num_type=1, active_num=n * k
        )
        out = npu.npu_moe_finalize_routing(ex, None, None, None, w, eri, ids, drop_pad_mode=2)
        expected = torch.zeros(n, 6, dtype=torch.float64)
        for i in range(n):
            for j in range(k):
                if rng[0] <= ef[i][j] < rng[1]:
                    expected[i] += w[i, j].double() * x[i].double()
        assert_close(out, expected.to(dtype), op_tolerance(dtype), f"finalize∘init_routing_v2 range {rng}")
        if full is None:
            full = out
        else:
            partials.append(out.float())
    if partials:  # path C: summing local-range partial outputs gives the full-range output
        assert_close(sum(partials).to(dtype), full, op_tolerance(dtype), "range partition of finalize")


@given(routing_problems(), float_dtypes, seeds)
def test_finalize_mode0_v1_equals_mode2_v2(problem, dtype, seed):
    n, k, num_experts, ids = problem
    ids = ids.clamp(max=num_experts - 1)
    g = gen(seed)
    x = torch.randn(n, 3, generator=g).to(dtype)
    w = torch.rand(n, k, generator=g).to(dtype)
    row_idx = torch.arange(n * k, dtype=torch.int32).reshape(k, n).t().contiguous()
    ex1, eri1, _ = npu.npu_moe_init_routing(x, row_idx, ids, n)
    ex2, eri2, _, _ = npu.npu_moe_init_routing_v2(x, ids, expert_num=num_experts)
    out0 = npu.npu_moe_finalize_routing(ex1, None, None, None, w, eri1, None, drop_pad_mode=0)
    out2 = npu.npu_moe_finalize_routing(ex2, None, None, None, w, eri2, None, drop_pad_mode=2)
    assert_bitwise_equal(out0, out2, "mode 0 (v1) vs mode 2 (v2)")


@given(routing_problems(max_n=8), st.integers(1, 8), float_dtypes, seeds)
def test_drop_pad_then_finalize_mode3_sums_kept_slots(problem, cap_seed, dtype, seed):
    n, k, num_experts, ids = problem
    if n == 0:
        return
    cap = 1 + cap_seed % n
    g = gen(seed)
    x = torch.randn(n, 4, generator=g).to(dtype)
    w = torch.rand(n, k, generator=g).to(dtype)
    ex, eri, _, _ = npu.npu_moe_init_routing_v2(
        x, ids, expert_num=num_experts, drop_pad_mode=1, expert_capacity=cap, expert_tokens_num_type=1
    )
    out = npu.npu_moe_finalize_routing(ex, None, None, None, w, eri, None, drop_pad_mode=3)
    kept = (eri >= 0).view(n, k)
    expected = (w.double() * kept).sum(-1, keepdim=True) * x.double()
    assert_close(out, expected.to(dtype), op_tolerance(dtype), "drop/pad then finalize mode 3")


# ------------------------------------------------------------------------------------------------------------------
# §7 re_routing
# ------------------------------------------------------------------------------------------------------------------


@st.composite
def re_routing_problems(draw):
    world, local = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    g = gen(draw(seeds))
    kind = draw(st.sampled_from(["uniform", "zeros", "skewed"]))
    cnt = torch.randint(0, 4, (world, local), generator=g)
    if kind == "zeros":
        cnt[torch.rand(world, local, generator=g) < 0.5] = 0
    elif kind == "skewed":
        cnt.zero_()
        cnt[draw(st.integers(0, world - 1)), draw(st.integers(0, local - 1))] = draw(st.integers(0, 9))
    cnt = cnt.to(draw(st.sampled_from([torch.int32, torch.int64])))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.int8]))
    a = int(cnt.sum())
    tokens = (
        random_bits((a, 3), dtype, draw(seeds))
        if dtype != torch.int8
        else torch.randint(-128, 128, (a, 3), generator=g, dtype=torch.int8)
    )
    scales = random_bits((a,), torch.float32, draw(seeds)) if draw(st.booleans()) else None
    return tokens, cnt, scales, draw(st.sampled_from([0, 1])), draw(st.sampled_from([0, 1]))


@given(re_routing_problems())
def test_re_routing_is_expert_major_permutation(p):
    tokens, cnt, scales, count_type, idx_type = p
    pt, ps, pidx, num = npu.npu_moe_re_routing(
        tokens, cnt, per_token_scales=scales, expert_token_num_type=count_type, idx_type=idx_type
    )
    a = tokens.shape[0]
    perm = ref_re_routing_perm(cnt.tolist())
    assert sorted(perm) == list(range(a))
    gather = pidx.tolist() if idx_type == 0 else torch.argsort(pidx).tolist()
    assert pidx.dtype == torch.int32 and gather == perm
    assert sorted(pidx.tolist()) == list(range(a)), "permute_token_idx is a permutation"
    expected_tokens = tokens[torch.tensor(perm, dtype=torch.long)]
    assert_bitwise_equal(pt, expected_tokens, "permute_tokens")
    if scales is not None:
        assert_bitwise_equal(ps, scales[torch.tensor(perm, dtype=torch.long)], "permute_per_token_scales")
    per_expert = cnt.sum(0)
    assert num.dtype == cnt.dtype
    assert num.tolist() == (per_expert if count_type == 1 else per_expert.cumsum(0)).tolist()
    if idx_type == 0:  # Qwen3 path B inverse: index_select(y, 0, idx.float().argsort().int()) restores the order
        restored = pt.index_select(0, pidx.float().argsort().int())
        assert_bitwise_equal(restored, tokens, "argsort inverse")
    # within output block (e, r) the source indices are contiguous and ascending
    pos = 0
    c = cnt.tolist()
    for e in range(cnt.shape[1]):
        for r in range(cnt.shape[0]):
            block = gather[pos : pos + c[r][e]]
            if block:
                assert block == list(range(block[0], block[0] + len(block)))
            pos += c[r][e]


@given(st.integers(1, 3), st.integers(1, 3), st.integers(0, 5), st.integers(1, 3), routings, seeds)
def test_re_routing_after_simulated_all_to_all_equals_global_init_routing(world, local, bs, k, kind, seed):
    num_experts = world * local
    xs = [random_bits((bs, 2), torch.bfloat16, seed + s) for s in range(world)]
    ids = [expert_ids(bs, k, num_experts, kind, seed + 100 + s).clamp(max=num_experts - 1) for s in range(world)]
    for r in range(world):
        rng = [r * local, (r + 1) * local]
        received, cnt = [], []
        for s in range(world):  # rank s sends rank r its rows for experts in r's range, grouped by expert
            ex, _, c, _ = npu.npu_moe_init_routing_v2(
                xs[s], ids[s], expert_num=num_experts, active_expert_range=rng, expert_tokens_num_type=1
            )
            received.append(ex[: int(c.sum())])
            cnt.append(c)
        pt, _, _, num = npu.npu_moe_re_routing(torch.cat(received), torch.stack(cnt))
        gx, _, gc, _ = npu.npu_moe_init_routing_v2(
            torch.cat(xs), torch.cat(ids), expert_num=num_experts, active_expert_range=rng, expert_tokens_num_type=1
        )
        assert_bitwise_equal(pt, gx[: int(gc.sum())], f"rank {r}")
        assert torch.equal(num, gc)


# ------------------------------------------------------------------------------------------------------------------
# unspecified regions: the portable kernel writes deterministic values (spec §0)
# ------------------------------------------------------------------------------------------------------------------


def test_unspecified_regions_are_deterministic():
    x = random_bits((4, 3), torch.bfloat16, 5)
    ids = torch.tensor([[0, 4], [1, 4], [4, 4], [0, 1]], dtype=torch.int32)
    ex, eri, _, es = npu.npu_moe_init_routing_v2(x, ids, expert_num=4)
    assert eri.tolist() == [0, -1, 2, -1, -1, -1, 1, 3]  # id 4 (== expert_num, gating's finished marker) is dropped
    assert not bool((bits_of(ex[4:]) != 0).any()) and not bool((es != 0).any())
    _, ps, _, _ = npu.npu_moe_re_routing(x, torch.tensor([[2, 2]]))
    assert ps.tolist() == [0.0] * 4


# ------------------------------------------------------------------------------------------------------------------
# opcheck and torch.compile
# ------------------------------------------------------------------------------------------------------------------


def _opcheck_cases():
    g = gen(11)
    x = torch.randn(6, 8, generator=g)
    ids = torch.randint(0, 4, (6, 2), generator=g, dtype=torch.int32)
    row_idx = torch.arange(12, dtype=torch.int32).reshape(2, 6).t().contiguous()
    xb = torch.randn(6, 4, generator=g).to(torch.bfloat16)
    ex, eri, _, _ = npu.npu_moe_init_routing_v2(xb, ids, expert_num=4, active_expert_range=[1, 3])
    w = torch.rand(6, 2, generator=g)
    return [
        ("npu_moe_gating_top_k_softmax", (x, None), {"k": 2}),
        (
            "npu_moe_gating_top_k_softmax",
            (x.bfloat16().reshape(2, 3, 8), torch.rand(2, 3, generator=g) < 0.5),
            {"k": 3},
        ),
        ("npu_moe_init_routing", (xb, row_idx, ids, 4), {}),
        (
            "npu_moe_init_routing_v2",
            (xb, ids),
            {"expert_num": 4, "expert_tokens_num_type": 1, "active_expert_range": [1, 3], "active_num": 7},
        ),
        (
            "npu_moe_init_routing_v2",
            (xb, ids),
            {"expert_num": 4, "scale": torch.rand(6, generator=g), "expert_tokens_num_type": 2, "row_idx_type": 1},
        ),
        (
            "npu_moe_init_routing_v2",
            (xb, ids),
            {"expert_num": 4, "drop_pad_mode": 1, "expert_capacity": 2, "expert_tokens_num_type": 1},
        ),
        ("npu_moe_compute_expert_tokens", (torch.tensor([0, 0, 1, 3, 3], dtype=torch.int32), 4), {}),
        ("npu_moe_finalize_routing", (ex, None, None, None, w, eri, ids), {"drop_pad_mode": 2}),
        (
            "npu_moe_finalize_routing",
            (ex, xb, xb, torch.randn(4, 4, generator=g).bfloat16(), None, eri, ids),
            {"drop_pad_mode": 2, "k": 2},
        ),
        ("npu_moe_re_routing", (xb[:5], torch.tensor([[1, 2], [0, 2]])), {}),
        (
            "npu_moe_re_routing",
            (xb[:5], torch.tensor([[1, 2], [0, 2]], dtype=torch.int32)),
            {"per_token_scales": torch.rand(5, generator=g), "idx_type": 1, "expert_token_num_type": 0},
        ),
    ]


@pytest.mark.parametrize("case", range(len(_opcheck_cases())))
def test_opcheck(case):
    name, args, kwargs = _opcheck_cases()[case]
    # No output size depends on data (every shape follows from input shapes and int args), so every sub-test
    # applies, test_aot_dispatch_dynamic included; no input requires grad (the ops have no autograd formula).
    torch.library.opcheck(getattr(npu, name).default, args, kwargs)


def _compile_programs():
    g = gen(12)
    logits = torch.randn(5, 6, generator=g)
    x = torch.randn(5, 4, generator=g).to(torch.bfloat16)

    def moe_path_a(logits, x):  # gating -> init_routing_v2 -> finalize, as Qwen3 path A (identity FFN)
        w, ids, _ = npu.npu_moe_gating_top_k_softmax(logits, None, k=2)
        ex, eri, cnt, _ = npu.npu_moe_init_routing_v2(
            x,
            ids,
            active_num=x.shape[0] * 2,
            expert_num=6,
            expert_tokens_num_type=1,
            expert_tokens_num_flag=True,
            active_expert_range=[0, 6],
        )
        return npu.npu_moe_finalize_routing(ex * 2, None, None, None, w.to(ex.dtype), eri, None, drop_pad_mode=2), cnt

    def legacy(logits, x):  # gating -> v1 -> compute_expert_tokens -> finalize mode 0
        w, ids, row_idx = npu.npu_moe_gating_top_k_softmax(logits, None, k=2)
        ex, eri, eei = npu.npu_moe_init_routing(x, row_idx, ids, 5)
        tok = npu.npu_moe_compute_expert_tokens(eei, 6)
        return npu.npu_moe_finalize_routing(ex, None, None, None, w.bfloat16(), eri, None, drop_pad_mode=0), tok

    def re_route(x, cnt):
        tokens, _, idx, num = npu.npu_moe_re_routing(x, cnt)
        return tokens, idx, num

    return [(moe_path_a, (logits, x)), (legacy, (logits, x)), (re_route, (x, torch.tensor([[2, 1], [0, 2]])))]


@pytest.mark.parametrize("program", range(3))
def test_torch_compile_fullgraph_matches_eager(program):
    fn, args = _compile_programs()[program]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(*args), fn(*args)):
        assert_bitwise_equal(got, want, f"{fn.__name__} compiled vs eager")


def test_inductor_runs_a_call_the_traced_body_leaves_as_the_operator():
    """With graph mode's decompositions registered, inductor inlines a dropless init routing and keeps a drop/pad one
    (its traced body returns NotImplemented) as the operator, called as a fallback kernel: both as eager, bitwise."""
    from optimized.executor.graph import compile_settings  # importing it registers the decompositions

    g = gen(13)
    x = torch.randn(6, 4, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 4, (6, 2), generator=g, dtype=torch.int32)

    def both(x, ids):
        dropless = npu.npu_moe_init_routing_v2(
            x,
            ids,
            active_num=12,
            expert_num=4,
            expert_tokens_num_type=1,
            expert_tokens_num_flag=True,
            active_expert_range=[0, 4],
        )
        dropped = npu.npu_moe_init_routing_v2(
            x, ids, expert_num=4, drop_pad_mode=1, expert_capacity=2, expert_tokens_num_type=1
        )
        return dropless + dropped

    torch._dynamo.reset()
    with compile_settings():
        got = torch.compile(both, fullgraph=True, backend="inductor")(x, ids)
    for i, (a, b) in enumerate(zip(got, both(x, ids))):
        assert_bitwise_equal(a, b, f"output {i}: inductor vs eager")


def test_torch_compile_dynamic_shapes_matches_eager():
    # Symbolic N: the fake kernels' shapes (rows_out = N*K, finalize N) must follow the input sizes.
    fn, _ = _compile_programs()[0]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
    for n in (5, 7):
        g = gen(n)
        args = (torch.randn(n, 6, generator=g), torch.randn(n, 4, generator=g).to(torch.bfloat16))
        for got, want in zip(compiled(*args), fn(*args)):
            assert_bitwise_equal(got, want, f"dynamic N={n}")


# ------------------------------------------------------------------------------------------------------------------
# validation errors name the op and the argument
# ------------------------------------------------------------------------------------------------------------------

_x = torch.randn(4, 6)
_ids = torch.zeros(4, 2, dtype=torch.int32)
_rows = torch.zeros(8, 6)
_idx = torch.zeros(8, dtype=torch.int32)
ERROR_CASES = [
    (
        lambda: npu.npu_moe_gating_top_k_softmax(torch.randn(6), None, k=1),
        ValueError,
        r"npu_moe_gating_top_k_softmax: x must have 2 or 3 dims",
    ),
    (
        lambda: npu.npu_moe_gating_top_k_softmax(_x.double(), None, k=1),
        ValueError,
        r"npu_moe_gating_top_k_softmax: x has dtype torch.float64",
    ),
    (lambda: npu.npu_moe_gating_top_k_softmax(_x, None, k=7), ValueError, r"gating_top_k_softmax: k=7 .*E=6"),
    (
        lambda: npu.npu_moe_gating_top_k_softmax(_x, torch.zeros(4, dtype=torch.int32), k=1),
        ValueError,
        r"gating_top_k_softmax: finished has dtype",
    ),
    (
        lambda: npu.npu_moe_gating_top_k_softmax(_x, torch.zeros(3, dtype=torch.bool), k=1),
        ValueError,
        r"gating_top_k_softmax: finished has shape \(3,\); expected \(4,\)",
    ),
    (lambda: npu.npu_moe_init_routing(_x, _ids, _ids, 4), ValueError, r"npu_moe_init_routing: row_idx must be a perm"),
    (
        lambda: npu.npu_moe_init_routing(_x, _ids.long(), _ids, 4),
        ValueError,
        r"npu_moe_init_routing: row_idx has dtype",
    ),
    (lambda: npu.npu_moe_init_routing(_x[:3], _ids, _ids, 4), ValueError, r"npu_moe_init_routing: x has 3 rows"),
    (
        lambda: npu.npu_moe_init_routing(_x, _ids, _ids[:, :1], -1),
        ValueError,
        r"npu_moe_init_routing: row_idx has shape",
    ),
    (lambda: npu.npu_moe_init_routing_v2(_x, _ids), ValueError, r"init_routing_v2: expert_num=-1 must be > 0"),
    (
        lambda: npu.npu_moe_init_routing_v2(_x, _ids, expert_num=4, quant_mode=1),
        NotImplementedError,
        r"npu_moe_init_routing_v2: quant_mode=1",
    ),
    (
        lambda: npu.npu_moe_init_routing_v2(_x, _ids, expert_num=4, quant_mode=10),
        ValueError,
        r"npu_moe_init_routing_v2: quant_mode=10",
    ),
    (
        lambda: npu.npu_moe_init_routing_v2(_x, _ids, expert_num=4, drop_pad_mode=2),
        ValueError,
        r"init_routing_v2: drop_pad_mode=2",
    ),
    (
        lambda: npu.npu_moe_init_routing_v2(_x, _ids, expert_num=4, active_expert_range=[3, 3]),
        ValueError,
        r"init_routing_v2: active_expert_range=\[3, 3\]",
    ),
    (
        lambda: npu.npu_moe_init_routing_v2(_x, _ids, expert_num=4, active_expert_range=[0, 5]),
        ValueError,
        r"init_routing_v2: active_expert_range",
    ),
    (
        lambda: npu.npu_moe_init_routing_v2(_x, _ids, expert_num=4, drop_pad_mode=1, expert_capacity=5),
        ValueError,
        r"init_routing_v2: drop_pad_mode=1 needs 0 < expert_capacity",
    ),
    (
        lambda: npu.npu_moe_init_routing_v2(
            _x, _ids, expert_num=4, drop_pad_mode=1, expert_capacity=2, active_expert_range=[1, 3]
        ),
        ValueError,
        r"init_routing_v2: drop_pad_mode=1 needs the full active_expert_range",
    ),
    (
        lambda: npu.npu_moe_init_routing_v2(_x, _ids - 1, expert_num=4),
        ValueError,
        r"init_routing_v2: expert_idx values must be >= 0",
    ),
    (
        lambda: npu.npu_moe_init_routing_v2(_x, _ids + 5, expert_num=4),
        ValueError,
        r"init_routing_v2: expert_idx value 5 is outside \[0, expert_num=4\]",
    ),
    (
        lambda: npu.npu_moe_init_routing_v2(_x, _ids + 5, expert_num=4, active_expert_range=[0, 2]),
        ValueError,
        r"init_routing_v2: expert_idx value 5 is outside",
    ),
    (
        lambda: npu.npu_moe_init_routing_v2(_x, _ids.long(), expert_num=4),
        ValueError,
        r"init_routing_v2: expert_idx has dtype",
    ),
    (
        lambda: npu.npu_moe_init_routing_v2(_x, _ids, expert_num=4, scale=torch.ones(3)),
        ValueError,
        r"init_routing_v2: scale has shape",
    ),
    (
        lambda: npu.npu_moe_init_routing_v2(_x, _ids, expert_num=4, row_idx_type=2),
        ValueError,
        r"init_routing_v2: row_idx_type=2",
    ),
    (
        lambda: npu.npu_moe_compute_expert_tokens(_idx.long(), 3),
        ValueError,
        r"compute_expert_tokens: sorted_expert_for_source_row has dtype",
    ),
    (lambda: npu.npu_moe_compute_expert_tokens(_idx, 0), ValueError, r"compute_expert_tokens: num_expert=0"),
    (
        lambda: npu.npu_moe_finalize_routing(_rows, None, None, None, None, _idx, None, drop_pad_mode=4, k=2),
        ValueError,
        r"finalize_routing: drop_pad_mode=4",
    ),
    (
        lambda: npu.npu_moe_finalize_routing(_rows, None, None, None, None, _idx, None, drop_pad_mode=1, k=2),
        ValueError,
        r"finalize_routing: expanded_permuted_rows must have 3 dims",
    ),
    (
        lambda: npu.npu_moe_finalize_routing(_rows, None, None, None, torch.ones(4, 3), _idx, None),
        ValueError,
        r"finalize_routing: expanded_src_to_dst_row has shape \(8,\); expected \(12,\)",
    ),
    (
        lambda: npu.npu_moe_finalize_routing(_rows, None, _x, None, torch.ones(4, 2), _idx, None),
        ValueError,
        r"finalize_routing: skip2 requires skip1",
    ),
    (
        lambda: npu.npu_moe_finalize_routing(_rows, _x[:3], None, None, torch.ones(4, 2), _idx, None),
        ValueError,
        r"finalize_routing: skip1 has shape",
    ),
    (
        lambda: npu.npu_moe_finalize_routing(_rows, None, None, _x, torch.ones(4, 2), _idx, None),
        ValueError,
        r"finalize_routing: bias requires export_for_source_row",
    ),
    (
        lambda: npu.npu_moe_finalize_routing(_rows, None, None, None, torch.ones(4, 2), _idx + 8, None),
        ValueError,
        r"finalize_routing: expanded_src_to_dst_row values must lie in \[-1, 8\)",
    ),
    (
        lambda: npu.npu_moe_finalize_routing(_rows.half(), None, None, None, torch.ones(4, 2), _idx, None),
        ValueError,
        r"finalize_routing: scales has dtype torch.float32",
    ),
    (
        lambda: npu.npu_moe_re_routing(_x.bfloat16(), torch.tensor([[1, 2], [0, 2]])),
        ValueError,
        r"re_routing: expert_token_num_per_rank sums to 5 but tokens has A=4",
    ),
    (
        lambda: npu.npu_moe_re_routing(_x[:1].bfloat16(), torch.tensor([[2, -1]])),
        ValueError,
        r"re_routing: expert_token_num_per_rank values must be >= 0",
    ),
    (
        lambda: npu.npu_moe_re_routing(_x, torch.tensor([4])),
        ValueError,
        r"re_routing: expert_token_num_per_rank must have 2 dims",
    ),
    (lambda: npu.npu_moe_re_routing(_x, torch.tensor([[4]]), idx_type=2), ValueError, r"re_routing: idx_type=2"),
    (
        lambda: npu.npu_moe_re_routing(_x, torch.tensor([[4]]), per_token_scales=torch.ones(3)),
        ValueError,
        r"re_routing: per_token_scales has shape",
    ),
]


def test_init_routing_v2_drops_the_finished_marker_but_refuses_ids_past_it():
    """Spec §4.1: expert_num is gating's "finished" id, dropped (never an error); expert_num + 1 is refused."""
    ids = torch.tensor([[0, 4], [4, 1]], dtype=torch.int32)
    x = torch.randn(2, 6)
    expanded_x, row_idx, counts, _ = npu.npu_moe_init_routing_v2(
        x, ids, expert_num=4, expert_tokens_num_type=1, expert_tokens_num_flag=True
    )
    assert counts.tolist() == [1, 1, 0, 0]
    assert row_idx.tolist() == [0, -1, -1, 1]
    assert_bitwise_equal(expanded_x[:2], x[[0, 1]], "rows of experts 0 and 1")
    with pytest.raises(ValueError, match=r"expert_idx value 5 is outside \[0, expert_num=4\]"):
        npu.npu_moe_init_routing_v2(x, ids + 1, expert_num=4)


@pytest.mark.parametrize("case", range(len(ERROR_CASES)))
def test_invalid_inputs_raise_naming_op_and_argument(case):
    call, error, pattern = ERROR_CASES[case]
    with pytest.raises(error, match=pattern):
        call()


STRICT_CASES = [
    (lambda: npu.npu_moe_gating_top_k_softmax(torch.zeros(1, 1100), None, k=1025), r"gating_top_k_softmax: NPU limit"),
    (
        lambda: npu.npu_moe_compute_expert_tokens(torch.tensor([1, 0], dtype=torch.int32), 2),
        r"compute_expert_tokens: NPU limit.*non-decreasing",
    ),
    (lambda: npu.npu_moe_re_routing(_x, torch.tensor([[4]])), r"re_routing: NPU limit: tokens has dtype"),
]


@pytest.mark.parametrize("case", range(len(STRICT_CASES)))
def test_npu_limits_raise_only_in_strict_mode(case, monkeypatch):
    call, pattern = STRICT_CASES[case]
    monkeypatch.setenv("QWEN3_MOE_STRICT_NPU_LIMITS", "0")
    call()
    monkeypatch.setenv("QWEN3_MOE_STRICT_NPU_LIMITS", "1")
    with pytest.raises(ValueError, match=pattern):
        call()


# ------------------------------------------------------------------------------------------------------------------
# NPU: the real torch_npu kernels against the portable ones (skipped where there is no NPU)
# ------------------------------------------------------------------------------------------------------------------


def _npu(t):
    return t.to("npu") if isinstance(t, torch.Tensor) else t


@pytest.mark.npu
@given(gating_problems())
def test_npu_gating_matches_portable(problem):
    x, finished, k = problem
    if k == 0 or x.numel() == 0:
        return  # the C++ returns before launching; nothing to compare
    got = npu.npu_moe_gating_top_k_softmax(_npu(x), _npu(finished), k=k)
    want = portable_kernel("npu_moe_gating_top_k_softmax")(x, finished, k=k)
    assert_close(got[0].cpu(), want[0], op_tolerance(x.dtype), "y")
    probs = torch.softmax(x.reshape(-1, x.shape[-1]).float(), -1)
    # expert ids may only differ where the two chosen probabilities are within tolerance (near-ties)
    chosen = probs.gather(-1, got[1].cpu().reshape(-1, k).long().clamp(max=x.shape[-1] - 1))
    assert_close(
        chosen,
        probs.gather(-1, want[1].reshape(-1, k).long().clamp(max=x.shape[-1] - 1)),
        "op.float32",
        "probability of the chosen experts",
    )
    assert torch.equal(got[2].cpu(), want[2])


@pytest.mark.npu
@given(routing_problems(), float_dtypes, st.integers(0, 12), seeds)
def test_npu_init_routing_v1_matches_portable(problem, dtype, active_num, seed):
    n, k, _, ids = problem
    if n == 0:
        return
    x = random_bits((n, 16), dtype, seed)
    row_idx = torch.arange(n * k, dtype=torch.int32).reshape(k, n).t().contiguous()
    got = npu.npu_moe_init_routing(_npu(x), _npu(row_idx), _npu(ids), active_num)
    want = portable_kernel("npu_moe_init_routing")(x, row_idx, ids, active_num)
    for a, b, what in zip(got, want, ("expanded_x", "expanded_row_idx", "expanded_expert_idx")):
        assert_bitwise_equal(a.cpu(), b, what)


@pytest.mark.npu
@given(v2_problems())
def test_npu_init_routing_v2_matches_portable(p):
    if p["n"] == 0 or p["dtype"] == torch.int8:
        return
    x = random_bits((p["n"], 16), p["dtype"], p["seed"])
    scale = torch.rand(p["n"], generator=gen(p["seed"])) if p["with_scale"] else None
    kw = dict(
        scale=scale,
        active_num=p["active_num"],
        expert_num=p["num_experts"],
        active_expert_range=p["range"] or [0, p["num_experts"]],
        expert_tokens_num_type=p["count_type"],
        expert_tokens_num_flag=True,
        row_idx_type=p["row_idx_type"],
    )
    got = [t.cpu() for t in npu.npu_moe_init_routing_v2(_npu(x), _npu(p["ids"]), **{k: _npu(v) for k, v in kw.items()})]
    want = portable_kernel("npu_moe_init_routing_v2")(x, p["ids"], **kw)
    avail = int(((p["ids"] >= kw["active_expert_range"][0]) & (p["ids"] < kw["active_expert_range"][1])).sum())
    n_valid = min(avail, want[0].shape[0])
    assert_bitwise_equal(got[0][:n_valid], want[0][:n_valid], "expanded_x (valid rows)")
    if p["row_idx_type"] == 0:
        assert torch.equal(got[1], want[1])
    else:
        assert torch.equal(got[1][:avail], want[1][:avail])  # the tail is undocumented
    assert torch.equal(got[2], want[2])
    if scale is not None:
        assert_bitwise_equal(got[3][:n_valid], want[3][:n_valid], "expanded_scale (valid rows)")


@pytest.mark.npu
@given(st.lists(st.integers(0, 9), min_size=1, max_size=30), st.integers(1, 8))
def test_npu_compute_expert_tokens_matches_portable(values, num_expert):
    rows = torch.tensor(sorted(values), dtype=torch.int32)
    got = npu.npu_moe_compute_expert_tokens(_npu(rows), num_expert).cpu()
    assert torch.equal(got, portable_kernel("npu_moe_compute_expert_tokens")(rows, num_expert))


@pytest.mark.npu
@given(finalize_problems())
def test_npu_finalize_matches_portable(p):
    if p["rows"].shape[0] == 0 or p["idx"].numel() == 0:
        return
    if p["mode"] in (0, 2) and bool((p["idx"] == -1).any()):
        return  # -1 in dropless modes is outside the documented NPU domain (spec §13.8)
    if p["bias"] is not None and bool((p["idx"] == -1).any()):
        return  # -1 with bias: the doc golden and the kernel disagree (spec §13.9)
    args = [p[name] for name in ("rows", "skip1", "skip2", "bias", "scales", "idx", "export")]
    got = npu.npu_moe_finalize_routing(*map(_npu, args), drop_pad_mode=p["mode"], k=p["k"]).cpu()
    want = portable_kernel("npu_moe_finalize_routing")(*args, drop_pad_mode=p["mode"], k=p["k"])
    assert_close(got, want, op_tolerance(want.dtype), "finalize")


@pytest.mark.npu
@given(re_routing_problems())
def test_npu_re_routing_matches_portable(p):
    tokens, cnt, scales, count_type, idx_type = p
    if tokens.shape[0] == 0 or tokens.dtype == torch.float32:
        return
    kw = dict(per_token_scales=scales, expert_token_num_type=count_type, idx_type=idx_type)
    got = [t.cpu() for t in npu.npu_moe_re_routing(_npu(tokens), _npu(cnt), **{k: _npu(v) for k, v in kw.items()})]
    want = portable_kernel("npu_moe_re_routing")(tokens, cnt, **kw)
    assert_bitwise_equal(got[0], want[0], "permute_tokens")
    if scales is not None:
        assert_bitwise_equal(got[1], want[1], "permute_per_token_scales")
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
