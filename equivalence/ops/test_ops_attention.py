"""FIA v2 / v1 portable kernels (spec npu_ops_attention_norm.md §5, §6) against independent plain math.

The reference here is per-request fp64 attention: repeat_interleave the KV heads (GQA), build the visibility
matrix element by element from the §5.4 table, softmax, P @ V. The kernel instead groups query heads per KV
head, computes visibility with broadcasting and gathers paged KV by vectorised indexing.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import optimized  # noqa: F401  (registers torch.ops.npu.*)
from equivalence.support.compare import assert_bitwise_equal, assert_close, op_tolerance, tolerance
from optimized.ops.registry import portable_kernel

V2 = "npu_fused_infer_attention_score_v2"
V1 = "npu_fused_infer_attention_score"
OPS = torch.ops.npu
TEMPLATE = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)  # what Qwen3-MoE passes: ~tril(ones)


# --- independent reference ------------------------------------------------------------------------------


def ref_visible(mode: int, lq: int, lkv: int, pre: int = 2**31 - 1, nxt: int = 2**31 - 1, mask=None) -> torch.Tensor:
    """§5.4 table, one (i, j) at a time."""
    delta = lkv - lq
    rows = []
    for i in range(lq):
        row = []
        for j in range(lkv):
            if mode == 0:
                ok = True if mask is None else (not bool(mask[i][j]) and -pre <= j - i <= nxt)
            elif mode == 1:
                ok = not bool(mask[i][j])
            elif mode == 2:
                ok = j <= i
            elif mode == 3:
                ok = j <= i + delta
            else:
                ok = delta - pre <= j - i <= delta + nxt
            row.append(ok)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).reshape(lq, lkv)


def ref_attention(q, k, v, vis, scale):
    """q (Lq, Nq, D), k (Lkv, Nkv, D), v (Lkv, Nkv, Dv), vis (Lq, Lkv) -> out (Lq, Nq, Dv) fp64, lse (Lq, Nq)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # -inf where nothing is visible
    none = torch.isinf(lse)
    p = torch.exp(s - torch.where(none, 0.0, lse)[..., None])
    p = torch.where(none[..., None], 0.0, p)
    out = torch.einsum("hij,jhd->ihd", p, v)
    return out, torch.where(none, math.inf, lse).T


def causal_ref(q, k, v, scale):
    return ref_attention(q, k, v, ref_visible(3, q.shape[0], k.shape[0]), scale)


def rand(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def cumsum(lengths):
    out, total = [], 0
    for x in lengths:
        total += x
        out.append(total)
    return out


# --- strategies -----------------------------------------------------------------------------------------


@st.composite
def heads(draw):
    nkv = draw(st.sampled_from([1, 2]))
    return nkv * draw(st.sampled_from([1, 2, 4])), nkv


@st.composite
def requests(draw, max_kv=12, decode=False):
    """Per-request (Lq_b, Lkv_b) with Lq_b <= Lkv_b."""
    batch = draw(st.integers(1, 4))
    lkv = [draw(st.integers(1 if decode else 0, max_kv)) for _ in range(batch)]
    if decode:
        lq = [draw(st.integers(1, min(2, x))) for x in lkv]
    else:
        lq = [draw(st.integers(0, x)) for x in lkv]
    return lq, lkv


dtypes = st.sampled_from([torch.float32, torch.bfloat16])
head_dims = st.sampled_from([16, 32])
seeds = st.integers(0, 2**31 - 1)


def tnd_inputs(seed, lq, lkv, nq, nkv, d, dtype, tail=0):
    g = torch.Generator().manual_seed(seed)
    q = rand(g, sum(lq) + tail, nq, d, dtype=dtype)
    k = rand(g, sum(lkv), nkv, d, dtype=dtype)
    v = rand(g, sum(lkv), nkv, d, dtype=dtype)
    return q, k, v


def per_request(t, lengths, b):
    start = sum(lengths[:b])
    return t[start : start + lengths[b]]


def fia_tnd(q, k, v, lq, lkv, nq, nkv, **kw):
    kw.setdefault("sparse_mode", 3)
    kw.setdefault("atten_mask", TEMPLATE if kw["sparse_mode"] == 3 else None)
    return OPS.npu_fused_infer_attention_score_v2(
        q,
        k,
        v,
        num_query_heads=nq,
        num_key_value_heads=nkv,
        softmax_scale=1 / math.sqrt(q.shape[-1]),
        input_layout="TND",
        actual_seq_qlen=cumsum(lq),
        actual_seq_kvlen=kw.pop("kvlen", cumsum(lkv)),
        **kw,
    )


def to_paged(seed, kv_per_request, block_size, cache_layout, pad):
    """Scatter per-request (Lkv_b, Nkv, D) rows into shuffled blocks; unused table entries hold `pad`."""
    g = torch.Generator().manual_seed(seed)
    nkv, d = kv_per_request[0].shape[1:]
    need = [-(-x.shape[0] // block_size) for x in kv_per_request]
    num_blocks = sum(need) + 2  # two spare blocks full of garbage
    order = torch.randperm(num_blocks, generator=g).tolist()
    cache = rand(g, num_blocks, block_size, nkv, d, dtype=kv_per_request[0].dtype)
    table = torch.full((len(kv_per_request), max(need) + 1), pad, dtype=torch.int32)
    for b, rows in enumerate(kv_per_request):
        for i in range(need[b]):
            blk = order.pop()
            table[b, i] = blk
            chunk = rows[i * block_size : (i + 1) * block_size]
            cache[blk, : chunk.shape[0]] = chunk
    if cache_layout == "BnBsH":
        return cache.reshape(num_blocks, block_size, nkv * d), table
    return cache.permute(0, 2, 1, 3).contiguous(), table


# --- properties -----------------------------------------------------------------------------------------


@given(seed=seeds, reqs=requests(), hd=heads(), d=head_dims, dtype=dtypes, tail=st.integers(0, 3))
def test_tnd_varlen_causal_gqa_equals_per_request_attention(seed, reqs, hd, d, dtype, tail):
    (lq, lkv), (nq, nkv) = reqs, hd
    q, k, v = tnd_inputs(seed, lq, lkv, nq, nkv, d, dtype, tail)
    out, lse = fia_tnd(q, k, v, lq, lkv, nq, nkv, return_softmax_lse=True)
    assert out.shape == (q.shape[0], nq, d) and out.dtype == dtype
    assert lse.shape == (q.shape[0], nq, 1) and lse.dtype == torch.float32
    for b in range(len(lq)):
        exp_out, exp_lse = causal_ref(
            per_request(q, lq, b), per_request(k, lkv, b), per_request(v, lkv, b), 1 / math.sqrt(d)
        )
        assert_close(per_request(out, lq, b), exp_out, op_tolerance(dtype), f"request {b} out")
        assert_close(per_request(lse, lq, b)[..., 0], exp_lse, op_tolerance(torch.float32), f"request {b} lse")
    # rows beyond cu_q[-1] belong to no request: zeros (spec §10.8)
    assert not out[sum(lq) :].any() and not lse[sum(lq) :].any()


@given(
    seed=seeds,
    reqs=requests(max_kv=40, decode=True),
    hd=heads(),
    d=head_dims,
    dtype=dtypes,
    block_size=st.sampled_from([16, 32]),
    cache_layout=st.sampled_from(["BnBsH", "BnNBsD"]),
    pad=st.sampled_from([0, -1]),
)
def test_paged_equals_contiguous(seed, reqs, hd, d, dtype, block_size, cache_layout, pad):
    (lq, lkv), (nq, nkv) = reqs, hd
    q, k, v = tnd_inputs(seed, lq, lkv, nq, nkv, d, dtype)
    kc, table = to_paged(seed, [per_request(k, lkv, b) for b in range(len(lkv))], block_size, cache_layout, pad)
    vc, table_v = to_paged(seed, [per_request(v, lkv, b) for b in range(len(lkv))], block_size, cache_layout, pad)
    assert torch.equal(table, table_v)
    paged = fia_tnd(
        q, kc, vc, lq, lkv, nq, nkv, kvlen=lkv, block_table=table, block_size=block_size, return_softmax_lse=True
    )
    contiguous = fia_tnd(q, k, v, lq, lkv, nq, nkv, return_softmax_lse=True)
    assert_bitwise_equal(paged[0], contiguous[0], "paged vs contiguous out")
    assert_bitwise_equal(paged[1], contiguous[1], "paged vs contiguous lse")
    for b in range(len(lq)):
        exp_out, _ = causal_ref(per_request(q, lq, b), per_request(k, lkv, b), per_request(v, lkv, b), 1 / math.sqrt(d))
        assert_close(per_request(paged[0], lq, b), exp_out, op_tolerance(dtype), f"request {b}")


@st.composite
def extend_rows(draw):
    """Per row (cached, new): tokens already in the paged cache and new query tokens (a prefill over cached KV)."""
    batch = draw(st.integers(1, 3))
    return [(draw(st.integers(0, 40)), draw(st.integers(1, 9))) for _ in range(batch)]


@given(
    seed=seeds,
    rows=extend_rows(),
    hd=heads(),
    d=head_dims,
    dtype=dtypes,
    block_size=st.sampled_from([16, 32, 48]),
    cache_layout=st.sampled_from(["BnBsH", "BnNBsD"]),
)
def test_extend_over_paged_cache_equals_attention_over_concatenated_kv(
    seed, rows, hd, d, dtype, block_size, cache_layout
):
    """Prefill over cached KV as the model calls it (TND query of the new tokens, paged cache holding cached + new
    K/V, per-row kv lengths, sparse_mode 3): row b's new query i sees keys j <= cached_b + i of the concatenated
    cached and new K/V; plain math builds that mask from the cached length directly."""
    (nq, nkv), new = hd, [n for _, n in rows]
    total = [c + n for c, n in rows]
    q, k, v = tnd_inputs(seed, new, total, nq, nkv, d, dtype)
    kc, table = to_paged(seed, [per_request(k, total, b) for b in range(len(rows))], block_size, cache_layout, 0)
    vc, _ = to_paged(seed, [per_request(v, total, b) for b in range(len(rows))], block_size, cache_layout, 0)
    out, lse = fia_tnd(
        q, kc, vc, new, total, nq, nkv, kvlen=total, block_table=table, block_size=block_size, return_softmax_lse=True
    )
    for b, (c, n) in enumerate(rows):
        offset_causal = torch.arange(c + n)[None, :] <= c + torch.arange(n)[:, None]  # (new, cached + new)
        exp_out, exp_lse = ref_attention(
            per_request(q, new, b), per_request(k, total, b), per_request(v, total, b), offset_causal, 1 / math.sqrt(d)
        )
        assert_close(per_request(out, new, b), exp_out, op_tolerance(dtype), f"row {b} (cached {c}, new {n}) out")
        assert_close(per_request(lse, new, b)[..., 0], exp_lse, op_tolerance(torch.float32), f"row {b} lse")


def test_extend_validation_names_the_argument():
    """The limits an extend call can hit: a block table row per query row, kv lengths within the table's blocks, the
    causal template, per-batch (not cumulative) kv lengths with a block table."""
    g = torch.Generator().manual_seed(5)
    q = rand(g, 5, 4, 16, dtype=torch.bfloat16)
    cache = rand(g, 4, 16, 2 * 16, dtype=torch.bfloat16)
    table = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    kw = dict(block_table=table, block_size=16, actual_seq_qlen=[2, 5], actual_seq_kvlen=[20, 3])
    OPS.npu_fused_infer_attention_score_v2(q, cache, cache, **_tnd_kwargs(**kw))  # valid: 18 cached + 2, 0 + 3
    bad = [
        (dict(block_table=table[:1]), r"v2: block_table has 1 rows; expected the batch count 2"),
        (dict(actual_seq_kvlen=[33, 3]), r"v2: paged actual_seq_kvlen entries must be in \[0, max_blocks\*block_size"),
        (dict(actual_seq_kvlen=[20]), r"v2: actual_seq_kvlen has 1 entries; expected len\(actual_seq_qlen\) = 2"),
        (dict(atten_mask=None), r"v2: sparse_mode=3 needs the 2048x2048 atten_mask"),
        (dict(block_table=table.long()), r"v2: block_table"),
    ]
    for over, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            OPS.npu_fused_infer_attention_score_v2(q, cache, cache, **_tnd_kwargs(**{**kw, **over}))


@given(seed=seeds, reqs=requests(max_kv=40, decode=True), hd=heads(), dtype=dtypes, bsh=st.booleans())
def test_paged_bsnd_bsh_decode_equals_contiguous(seed, reqs, hd, dtype, bsh):
    """BSH/BSND queries (S = 1) over a BnBsH cache with per-batch kv lengths == the padded contiguous batch."""
    (_, lkv), (nq, nkv) = reqs, hd
    batch, d, bs = len(lkv), 16, 16
    g = torch.Generator().manual_seed(seed)
    q = rand(g, batch, 1, nq, d, dtype=dtype)
    k4, v4 = rand(g, batch, max(lkv), nkv, d, dtype=dtype), rand(g, batch, max(lkv), nkv, d, dtype=dtype)
    kc, table = to_paged(seed, [k4[b, : lkv[b]] for b in range(batch)], bs, "BnBsH", -1)
    vc, _ = to_paged(seed, [v4[b, : lkv[b]] for b in range(batch)], bs, "BnBsH", -1)
    layout, qq = ("BSH", q.flatten(2)) if bsh else ("BSND", q)
    kw = dict(
        num_query_heads=nq,
        num_key_value_heads=nkv,
        softmax_scale=0.25,
        input_layout=layout,
        actual_seq_kvlen=lkv,
        return_softmax_lse=True,
    )
    paged = OPS.npu_fused_infer_attention_score_v2(qq, kc, vc, block_table=table, block_size=bs, **kw)
    contiguous = OPS.npu_fused_infer_attention_score_v2(
        qq, k4.flatten(2) if bsh else k4, v4.flatten(2) if bsh else v4, **kw
    )
    assert_bitwise_equal(paged[0], contiguous[0], f"paged vs contiguous {layout}")
    assert_bitwise_equal(paged[1], contiguous[1], f"paged vs contiguous {layout} lse")
    with pytest.raises(ValueError, match=r"v2: paged key layout \(num_blocks, Nkv, block_size, D\) needs input_layout"):
        cache = kc.reshape(kc.shape[0], bs, nkv, d).transpose(1, 2)
        OPS.npu_fused_infer_attention_score_v2(qq, cache, cache, block_table=table, block_size=bs, **kw)


@given(
    seed=seeds,
    reqs=requests(),
    hd=heads(),
    d=head_dims,
    dtype=dtypes,
    mode=st.sampled_from([0, 3]),
    equal=st.booleans(),
)
def test_bsnd_bsh_bnsd_equal_tnd(seed, reqs, hd, d, dtype, mode, equal):
    (lq, lkv), (nq, nkv) = reqs, hd
    if equal:  # equal-length batch: no length lists needed for BSND
        lq, lkv = [lq[0]] * len(lq), [lkv[0]] * len(lkv)
    q, k, v = tnd_inputs(seed, lq, lkv, nq, nkv, d, dtype)
    batch, s, s_kv = len(lq), max(max(lq), 2), max(lkv)  # S >= 2: S == 1 would ignore sparse_mode (tested below)
    q4 = torch.zeros(batch, s, nq, d, dtype=dtype)
    k4, v4 = torch.zeros(batch, s_kv, nkv, d, dtype=dtype), torch.zeros(batch, s_kv, nkv, d, dtype=dtype)
    for b in range(batch):
        q4[b, : lq[b]] = per_request(q, lq, b)
        k4[b, : lkv[b]], v4[b, : lkv[b]] = per_request(k, lkv, b), per_request(v, lkv, b)
    mask = TEMPLATE if mode == 3 else None
    tnd_out, tnd_lse = fia_tnd(q, k, v, lq, lkv, nq, nkv, sparse_mode=mode, atten_mask=mask, return_softmax_lse=True)
    lens = {} if equal and lq[0] == s and lkv[0] == s_kv else {"actual_seq_qlen": lq, "actual_seq_kvlen": lkv}
    common = dict(
        num_query_heads=nq,
        num_key_value_heads=nkv,
        softmax_scale=1 / math.sqrt(d),
        sparse_mode=mode,
        atten_mask=mask,
        return_softmax_lse=True,
        **lens,
    )
    bsnd = OPS.npu_fused_infer_attention_score_v2(q4, k4, v4, input_layout="BSND", **common)
    bsh = OPS.npu_fused_infer_attention_score_v2(
        q4.flatten(2), k4.flatten(2), v4.flatten(2), input_layout="BSH", **common
    )
    bnsd = OPS.npu_fused_infer_attention_score_v2(
        q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), input_layout="BNSD", **common
    )
    assert bsnd[0].shape == (batch, s, nq, d) and bsnd[1].shape == (batch, nq, s, 1)
    assert_bitwise_equal(bsh[0], bsnd[0].flatten(2), "BSH vs BSND")
    assert_bitwise_equal(bsh[1], bsnd[1], "BSH vs BSND lse")
    assert_bitwise_equal(bnsd[0], bsnd[0].transpose(1, 2), "BNSD vs BSND")
    for b in range(batch):
        assert_bitwise_equal(bsnd[0][b, : lq[b]], per_request(tnd_out, lq, b), f"BSND vs TND request {b}")
        assert_bitwise_equal(bsnd[1][b, :, : lq[b], 0].T, per_request(tnd_lse, lq, b)[..., 0], f"lse request {b}")
        assert not bsnd[0][b, lq[b] :].any(), "padding rows are zero"


@given(
    seed=seeds, reqs=requests(max_kv=20, decode=True), hd=heads(), dtype=dtypes, paged=st.booleans(), lse=st.booleans()
)
def test_v1_equals_v2_under_renaming(seed, reqs, hd, dtype, paged, lse):
    (lq, lkv), (nq, nkv) = reqs, hd
    q, k, v = tnd_inputs(seed, lq, lkv, nq, nkv, 16, dtype)
    extra, kvlen = {}, cumsum(lkv)
    if paged:
        k, table = to_paged(seed, [per_request(k, lkv, b) for b in range(len(lkv))], 16, "BnBsH", 0)
        v, _ = to_paged(seed, [per_request(v, lkv, b) for b in range(len(lkv))], 16, "BnBsH", 0)
        extra, kvlen = dict(block_table=table, block_size=16), lkv
    v2 = OPS.npu_fused_infer_attention_score_v2(
        q,
        k,
        v,
        num_query_heads=nq,
        num_key_value_heads=nkv,
        softmax_scale=0.3,
        input_layout="TND",
        sparse_mode=3,
        atten_mask=TEMPLATE,
        actual_seq_qlen=cumsum(lq),
        actual_seq_kvlen=kvlen,
        return_softmax_lse=lse,
        **extra,
    )
    v1 = OPS.npu_fused_infer_attention_score(
        q,
        k,
        v,
        num_heads=nq,
        num_key_value_heads=nkv,
        scale=0.3,
        input_layout="TND",
        sparse_mode=3,
        atten_mask=TEMPLATE,
        actual_seq_lengths=cumsum(lq),
        actual_seq_lengths_kv=kvlen,
        softmax_lse_flag=lse,
        **extra,
    )
    assert_bitwise_equal(v1[0], v2[0], "v1 vs v2 out")
    assert_bitwise_equal(v1[1], v2[1], "v1 vs v2 lse")


@given(seed=seeds, reqs=requests(), hd=heads(), d=head_dims)
def test_gqa_equals_mha_on_repeated_kv(seed, reqs, hd, d):
    (lq, lkv), (nq, nkv) = reqs, hd
    q, k, v = tnd_inputs(seed, lq, lkv, nq, nkv, d, torch.float32)
    group = nq // nkv
    gqa = fia_tnd(q, k, v, lq, lkv, nq, nkv, return_softmax_lse=True)
    mha = fia_tnd(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), lq, lkv, nq, 0, return_softmax_lse=True
    )
    assert_close(gqa[0], mha[0], op_tolerance(torch.float32), "GQA vs MHA")
    assert_close(gqa[1], mha[1], op_tolerance(torch.float32), "GQA vs MHA lse")


@given(seed=seeds, lkv=st.integers(1, 12), extra_q=st.integers(1, 4), hd=heads(), dtype=dtypes)
def test_sparse3_alignment_rules(seed, lkv, extra_q, hd, dtype):
    nq, nkv = hd
    scale = 0.25
    # Lq = 1 (decode): mode 3 == mode 0 without mask
    q, k, v = tnd_inputs(seed, [1], [lkv], nq, nkv, 16, dtype)
    assert_bitwise_equal(
        fia_tnd(q, k, v, [1], [lkv], nq, nkv)[0],
        fia_tnd(q, k, v, [1], [lkv], nq, nkv, sparse_mode=0)[0],
        "decode: mode 3 vs mode 0",
    )
    # Lq = Lkv: standard causal (lower triangle incl. diagonal)
    q, k, v = tnd_inputs(seed, [lkv], [lkv], nq, nkv, 16, dtype)
    out = OPS.npu_fused_infer_attention_score_v2(
        q,
        k,
        v,
        num_query_heads=nq,
        num_key_value_heads=nkv,
        softmax_scale=scale,
        input_layout="TND",
        sparse_mode=3,
        atten_mask=TEMPLATE,
        actual_seq_qlen=[lkv],
        actual_seq_kvlen=[lkv],
    )[0]
    tril = torch.ones(lkv, lkv, dtype=torch.bool).tril()
    assert_close(out, ref_attention(q, k, v, tril, scale)[0], op_tolerance(dtype), "Lq == Lkv causal")
    # Lq > Lkv (allowed, spec §10.12): the first Lq - Lkv rows see nothing -> out 0, lse +inf
    lq = lkv + extra_q
    q, k, v = tnd_inputs(seed, [lq], [lkv], nq, nkv, 16, dtype)
    out, lse = fia_tnd(q, k, v, [lq], [lkv], nq, nkv, return_softmax_lse=True)
    assert not out[:extra_q].any() and torch.isinf(lse[:extra_q]).all() and (lse[:extra_q] > 0).all()
    assert_close(out, causal_ref(q, k, v, 0.25)[0], op_tolerance(dtype), "Lq > Lkv")


def test_sparse3_longer_than_the_2048_template():
    g = torch.Generator().manual_seed(0)
    length = 3000
    q, k, v = rand(g, length, 1, 16), rand(g, length, 1, 16), rand(g, length, 1, 16)
    out, lse = fia_tnd(q, k, v, [length], [length], 1, 1, return_softmax_lse=True)
    tril = torch.ones(length, length, dtype=torch.bool).tril()
    exp_out, exp_lse = ref_attention(q, k, v, tril, 0.25)
    assert_close(out, exp_out, op_tolerance(torch.float32), "L = 3000 causal")
    assert_close(lse[..., 0], exp_lse, op_tolerance(torch.float32), "L = 3000 lse")


@given(seed=seeds, s=st.integers(1, 6), s_kv=st.integers(2, 12), hd=heads())
def test_lse_merges_two_key_halves(seed, s, s_kv, hd):
    """Ring-attention identity: attention over [K1; K2] from the two partial outputs and their lse."""
    nq, nkv = hd
    g = torch.Generator().manual_seed(seed)
    q, k, v = rand(g, 1, s, nq, 16), rand(g, 1, s_kv, nkv, 16), rand(g, 1, s_kv, nkv, 16)
    cut = s_kv // 2

    def run(kk, vv):
        return OPS.npu_fused_infer_attention_score_v2(
            q,
            kk,
            vv,
            num_query_heads=nq,
            num_key_value_heads=nkv,
            softmax_scale=0.3,
            input_layout="BSND",
            return_softmax_lse=True,
        )

    full, part1, part2 = run(k, v), run(k[:, :cut], v[:, :cut]), run(k[:, cut:], v[:, cut:])
    lse = torch.logaddexp(part1[1], part2[1])
    w1, w2 = (part1[1] - lse).exp(), (part2[1] - lse).exp()  # (B, N, S, 1)
    merged = w1.permute(0, 2, 1, 3) * part1[0] + w2.permute(0, 2, 1, 3) * part2[0]
    assert_close(lse, full[1], op_tolerance(torch.float32), "merged lse")
    assert_close(merged, full[0], op_tolerance(torch.float32), "merged out")
    # and lse == logsumexp(scale * q.k) directly
    kx = k.repeat_interleave(nq // nkv, 2).double()
    exp_lse = torch.logsumexp(torch.einsum("bihd,bjhd->bhij", q.double(), kx) * 0.3, -1)[..., None]
    assert_close(full[1], exp_lse, op_tolerance(torch.float32), "lse == logsumexp")


@given(
    seed=seeds,
    mode=st.sampled_from([0, 1, 2, 4]),
    lens=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 8)), min_size=1, max_size=3),
    pre=st.integers(0, 4),
    nxt=st.integers(0, 4),
    mask_batched=st.booleans(),
)
def test_bsnd_masks_and_bands_equal_the_mode_table(seed, mode, lens, pre, nxt, mask_batched):
    g = torch.Generator().manual_seed(seed)
    batch, s, s_kv = len(lens), 6, 8
    lq, lkv = [a for a, _ in lens], [c for _, c in lens]
    q, k, v = rand(g, batch, s, 2, 16), rand(g, batch, s_kv, 1, 16), rand(g, batch, s_kv, 1, 16)
    full = torch.rand(batch if mask_batched else 1, 1, s, s_kv, generator=g) < 0.3
    mask = full if mode in (0, 1) else TEMPLATE
    if mode == 0 and not mask_batched:
        mask = full[0, 0].to(torch.uint8)  # (Q_S, KV_S) form, uint8 0/1
    out, lse = OPS.npu_fused_infer_attention_score_v2(
        q,
        k,
        v,
        num_query_heads=2,
        num_key_value_heads=1,
        softmax_scale=0.5,
        input_layout="BSND",
        sparse_mode=mode,
        atten_mask=mask,
        pre_tokens=pre,
        next_tokens=nxt,
        actual_seq_qlen=lq,
        actual_seq_kvlen=lkv,
        return_softmax_lse=True,
    )
    for b in range(batch):
        m = full[b if mask_batched else 0, 0].tolist()
        vis = ref_visible(mode, lq[b], lkv[b], pre, nxt, m)
        exp_out, exp_lse = ref_attention(q[b, : lq[b]], k[b, : lkv[b]], v[b, : lkv[b]], vis, 0.5)
        assert_close(out[b, : lq[b]], exp_out, op_tolerance(torch.float32), f"mode {mode} request {b}")
        assert_close(lse[b, :, : lq[b], 0].T, exp_lse, op_tolerance(torch.float32), f"mode {mode} lse {b}")


def test_single_query_token_mask_forms_agree():
    """Q_S = 1: a (B, KV_S) mask means the same as (B, 1, 1, KV_S); mode 0 and mode 1 read it."""
    g = torch.Generator().manual_seed(3)
    q, k, v = rand(g, 3, 1, 2, 16), rand(g, 3, 6, 2, 16), rand(g, 3, 6, 2, 16)
    mask = torch.rand(3, 6, generator=g) < 0.4
    kw = dict(
        num_query_heads=2, softmax_scale=0.3, input_layout="BSND", actual_seq_kvlen=[6, 4, 5], return_softmax_lse=True
    )
    two_d = OPS.npu_fused_infer_attention_score_v2(q, k, v, atten_mask=mask, **kw)
    four_d = OPS.npu_fused_infer_attention_score_v2(q, k, v, atten_mask=mask[:, None, None, :], sparse_mode=1, **kw)
    assert_bitwise_equal(two_d[0], four_d[0], "(B, KV_S) vs (B, 1, 1, KV_S)")
    for b, lkv in enumerate([6, 4, 5]):
        exp_out, _ = ref_attention(q[b], k[b, :lkv], v[b, :lkv], ~mask[b : b + 1, :lkv], 0.3)
        assert_close(two_d[0][b], exp_out, op_tolerance(torch.float32), f"request {b}")


@pytest.mark.parametrize("mode", [2, 3, 4])
def test_single_query_token_ignores_sparse_mode(mode):
    g = torch.Generator().manual_seed(1)
    q, k, v = rand(g, 2, 1, 32), rand(g, 2, 7, 16), rand(g, 2, 7, 16)
    kw = dict(num_query_heads=2, num_key_value_heads=1, softmax_scale=0.2, input_layout="BSH", actual_seq_kvlen=[5, 7])
    got = OPS.npu_fused_infer_attention_score_v2(
        q, k, v, sparse_mode=mode, atten_mask=TEMPLATE, pre_tokens=0, next_tokens=0, **kw
    )[0]
    assert_bitwise_equal(got, OPS.npu_fused_infer_attention_score_v2(q, k, v, **kw)[0], f"mode {mode}")


def test_lse_not_requested_is_empty_float32():
    q, k, v = tnd_inputs(0, [2], [3], 2, 1, 16, torch.bfloat16)
    _, lse = fia_tnd(q, k, v, [2], [3], 2, 1)
    assert lse.shape == (0,) and lse.dtype == torch.float32
    _, lse = OPS.npu_fused_infer_attention_score(
        q,
        k,
        v,
        num_heads=2,
        num_key_value_heads=1,
        input_layout="TND",
        actual_seq_lengths=[2],
        actual_seq_lengths_kv=[3],
    )
    assert lse.shape == (0,) and lse.dtype == torch.float32


def test_empty_kv_and_empty_query():
    q = torch.randn(1, 3, 2, 16)
    k = v = torch.zeros(1, 0, 2, 16)
    out, lse = OPS.npu_fused_infer_attention_score_v2(
        q, k, v, num_query_heads=2, input_layout="BSND", return_softmax_lse=True
    )
    assert out.shape == (1, 3, 2, 16) and not out.any() and torch.isinf(lse).all()
    out, _ = OPS.npu_fused_infer_attention_score_v2(
        torch.zeros(0, 2, 16),
        torch.zeros(0, 2, 16),
        torch.zeros(0, 2, 16),
        num_query_heads=2,
        input_layout="TND",
        actual_seq_qlen=[0],
        actual_seq_kvlen=[0],
    )
    assert out.shape == (0, 2, 16)


def quantize_per_token(x):
    """§8 pertoken float8_e4m3fn quantization of (T, H) rows: y, scale with x ~= f32(y) * scale."""
    amax = x.float().abs().amax(-1)
    scale = amax * torch.tensor(1 / 448.0, dtype=torch.float32)
    y = (x.float() / torch.where(scale > 0, scale, 1.0)[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return y, scale


@given(seed=seeds, reqs=requests(max_kv=40, decode=True), hd=heads())
def test_fp8_kv_quant_mode_4(seed, reqs, hd):
    """Qwen3 FP8 decode: caches in float8_e4m3fn plus per-token fp32 scales per page, sparse 0 without mask."""
    (lq, lkv), (nq, nkv) = reqs, hd
    d, bs = 32, 16
    q, k, v = tnd_inputs(seed, lq, lkv, nq, nkv, d, torch.bfloat16)
    (kq, ks), (vq, vs) = quantize_per_token(k.flatten(1)), quantize_per_token(v.flatten(1))
    kq, vq = kq.view(-1, nkv, d), vq.view(-1, nkv, d)
    # write quantized rows and their scales through the same slot mapping (§7): slot = blk * bs + off
    kc, table = to_paged(seed, [per_request(kq.view(torch.uint8), lkv, b) for b in range(len(lkv))], bs, "BnBsH", 0)
    vc, _ = to_paged(seed, [per_request(vq.view(torch.uint8), lkv, b) for b in range(len(lkv))], bs, "BnBsH", 0)
    num_blocks = kc.shape[0]
    k_scale, v_scale = torch.rand(num_blocks, bs), torch.rand(num_blocks, bs)  # garbage outside the used slots
    for b in range(len(lkv)):
        for pos in range(lkv[b]):
            blk, off = int(table[b, pos // bs]), pos % bs
            k_scale[blk, off] = per_request(ks, lkv, b)[pos]
            v_scale[blk, off] = per_request(vs, lkv, b)[pos]
    out = OPS.npu_fused_infer_attention_score_v2(
        q,
        kc.view(torch.float8_e4m3fn),
        vc.view(torch.float8_e4m3fn),
        num_query_heads=nq,
        num_key_value_heads=nkv,
        softmax_scale=1 / math.sqrt(d),
        input_layout="TND",
        sparse_mode=0,
        actual_seq_qlen=cumsum(lq),
        actual_seq_kvlen=lkv,
        block_table=table,
        block_size=bs,
        dequant_scale_key=k_scale,
        dequant_scale_value=v_scale,
        key_quant_mode=4,
        value_quant_mode=4,
    )[0]
    k_deq, v_deq = kq.float() * ks[:, None, None], vq.float() * vs[:, None, None]
    bf16_out = fia_tnd(q, k, v, lq, lkv, nq, nkv, sparse_mode=0)[0]
    for b in range(len(lq)):
        exp_out, _ = ref_attention(
            per_request(q, lq, b),
            per_request(k_deq, lkv, b),
            per_request(v_deq, lkv, b),
            ref_visible(0, lq[b], lkv[b]),
            1 / math.sqrt(d),
        )
        assert_close(per_request(out, lq, b), exp_out, op_tolerance(torch.bfloat16), f"request {b} vs dequantized")
    assert_close(out, bf16_out, tolerance("op.attention.fp8_kv_vs_bf16"), "fp8 KV vs bf16 KV")


# --- the length arguments ------------------------------------------------------------------------------


def test_length_arguments_as_tensor_or_list():
    """§0 / §10.19: Qwen3 eager passes 1-D int64 tensors to the SymInt[] arguments; lists in graph mode."""
    lq, lkv = [2, 0, 3], [4, 1, 3]
    q, k, v = tnd_inputs(3, lq, lkv, 4, 2, 16, torch.bfloat16)
    kw = dict(
        num_query_heads=4,
        num_key_value_heads=2,
        softmax_scale=0.25,
        input_layout="TND",
        sparse_mode=3,
        atten_mask=TEMPLATE,
    )
    as_list = OPS.npu_fused_infer_attention_score_v2(
        q, k, v, actual_seq_qlen=cumsum(lq), actual_seq_kvlen=cumsum(lkv), **kw
    )[0]
    as_tensor = OPS.npu_fused_infer_attention_score_v2(
        q, k, v, actual_seq_qlen=torch.tensor(cumsum(lq)), actual_seq_kvlen=torch.tensor(cumsum(lkv)), **kw
    )[0]
    direct = portable_kernel(V2)(
        q, k, v, actual_seq_qlen=torch.tensor(cumsum(lq)), actual_seq_kvlen=torch.tensor(cumsum(lkv)), **kw
    )[0]
    assert_bitwise_equal(as_tensor, as_list, "tensor vs list")
    assert_bitwise_equal(direct, as_list, "portable kernel with tensors vs list")
    v1 = OPS.npu_fused_infer_attention_score(
        q,
        k,
        v,
        num_heads=4,
        num_key_value_heads=2,
        scale=0.25,
        input_layout="TND",
        sparse_mode=3,
        atten_mask=TEMPLATE,
        actual_seq_lengths=torch.tensor(cumsum(lq)),
        actual_seq_lengths_kv=torch.tensor(cumsum(lkv)),
    )[0]
    assert_bitwise_equal(v1, as_list, "v1 tensor lengths")


# --- .out overloads -------------------------------------------------------------------------------------


def test_out_overloads_write_and_return_their_arguments():
    lq, lkv = [2, 3], [2, 5]
    q, k, v = tnd_inputs(4, lq, lkv, 2, 1, 16, torch.bfloat16)
    expected = fia_tnd(q, k, v, lq, lkv, 2, 1, return_softmax_lse=True)
    out, lse = torch.empty(5, 2, 16, dtype=torch.bfloat16), torch.empty(5, 2, 1)
    got = OPS.npu_fused_infer_attention_score_v2.out(
        q,
        k,
        v,
        num_query_heads=2,
        num_key_value_heads=1,
        softmax_scale=0.25,
        input_layout="TND",
        sparse_mode=3,
        atten_mask=TEMPLATE,
        actual_seq_qlen=cumsum(lq),
        actual_seq_kvlen=cumsum(lkv),
        return_softmax_lse=True,
        attention_out=out,
        softmax_lse=lse,
    )
    assert got[0] is out and got[1] is lse
    assert_bitwise_equal(out, expected[0], "v2.out")
    assert_bitwise_equal(lse, expected[1], "v2.out lse")
    out1, lse1 = torch.empty(5, 2, 16, dtype=torch.bfloat16), torch.empty(1)  # lse resized to (0,)
    got = OPS.npu_fused_infer_attention_score.out(
        q,
        k,
        v,
        num_heads=2,
        num_key_value_heads=1,
        scale=0.25,
        input_layout="TND",
        sparse_mode=3,
        atten_mask=TEMPLATE,
        actual_seq_lengths=cumsum(lq),
        actual_seq_lengths_kv=cumsum(lkv),
        attention_out=out1,
        softmax_lse=lse1,
    )
    assert got[0] is out1 and got[1] is lse1 and lse1.shape == (0,)
    assert_bitwise_equal(out1, expected[0], "v1.out")


# --- opcheck and torch.compile --------------------------------------------------------------------------


def _prefill_case():
    lq = [3, 2]
    q, k, v = tnd_inputs(5, lq, lq, 4, 2, 16, torch.bfloat16)
    kw = dict(
        num_query_heads=4,
        num_key_value_heads=2,
        softmax_scale=0.25,
        input_layout="TND",
        sparse_mode=3,
        atten_mask=TEMPLATE,
        actual_seq_qlen=cumsum(lq),
        actual_seq_kvlen=cumsum(lq),
    )
    return (q, k, v), kw


def _decode_case():
    lq, lkv = [1, 1, 1], [5, 17, 1]
    q, k, v = tnd_inputs(6, lq, lkv, 4, 2, 16, torch.bfloat16)
    kc, table = to_paged(6, [per_request(k, lkv, b) for b in range(3)], 16, "BnBsH", 0)
    vc, _ = to_paged(6, [per_request(v, lkv, b) for b in range(3)], 16, "BnBsH", 0)
    kw = dict(
        num_query_heads=4,
        num_key_value_heads=2,
        softmax_scale=0.25,
        input_layout="TND",
        sparse_mode=3,
        atten_mask=TEMPLATE,
        actual_seq_qlen=cumsum(lq),
        actual_seq_kvlen=lkv,
        block_table=table,
        block_size=16,
    )
    return (q, kc, vc), kw


def _v1_kwargs(kw):
    renames = {
        "num_query_heads": "num_heads",
        "softmax_scale": "scale",
        "actual_seq_qlen": "actual_seq_lengths",
        "actual_seq_kvlen": "actual_seq_lengths_kv",
        "return_softmax_lse": "softmax_lse_flag",
    }
    return {renames.get(key, key): value for key, value in kw.items()}


@pytest.mark.parametrize("case", [_prefill_case, _decode_case])
def test_opcheck(case):
    args, kw = case()
    torch.library.opcheck(OPS.npu_fused_infer_attention_score_v2.default, args, kw)
    torch.library.opcheck(OPS.npu_fused_infer_attention_score.default, args, _v1_kwargs(kw))
    lse_kw = dict(kw, return_softmax_lse=True)
    out = OPS.npu_fused_infer_attention_score_v2(*args, **lse_kw)
    # test_aot_dispatch_dynamic is left out for the .out overloads: AOTAutograd cannot functionalize a custom
    # (non-ATen) op whose outputs carry alias annotations (`Tensor(a!)` returned), whatever the kernel does.
    # Schema (mutation) checks, autograd registration and the fake kernel are still checked.
    out_utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(
        OPS.npu_fused_infer_attention_score_v2.out,
        args,
        dict(lse_kw, attention_out=torch.empty_like(out[0]), softmax_lse=torch.empty_like(out[1])),
        test_utils=out_utils,
    )
    torch.library.opcheck(
        OPS.npu_fused_infer_attention_score.out,
        args,
        dict(_v1_kwargs(lse_kw), attention_out=torch.empty_like(out[0]), softmax_lse=torch.empty_like(out[1])),
        test_utils=out_utils,
    )


@pytest.mark.parametrize("case", [_prefill_case, _decode_case])
def test_compiles_without_graph_break(case):
    args, kw = case()
    torch._dynamo.reset()

    def attention(q, k, v):
        out, _ = OPS.npu_fused_infer_attention_score_v2(q, k, v, **kw)
        return out.flatten(1) * 2

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    assert_bitwise_equal(compiled(*args), attention(*args), "compiled vs eager")


# --- errors ---------------------------------------------------------------------------------------------


def _tnd_kwargs(**over):
    kw = dict(
        num_query_heads=4,
        num_key_value_heads=2,
        softmax_scale=0.25,
        input_layout="TND",
        sparse_mode=3,
        atten_mask=TEMPLATE,
        actual_seq_qlen=[2, 4],
        actual_seq_kvlen=[2, 4],
    )
    kw.update(over)
    return kw


Q, K, VV = (
    torch.randn(4, 4, 16, dtype=torch.bfloat16),
    torch.randn(4, 2, 16, dtype=torch.bfloat16),
    torch.randn(4, 2, 16, dtype=torch.bfloat16),
)


@pytest.mark.parametrize(
    "args, over, error, pattern",
    [
        ((Q[None], K[None], VV[None]), {}, ValueError, r"npu_fused_infer_attention_score_v2: query must have 3 dims"),
        ((Q, K, VV), dict(input_layout="TNDX"), ValueError, r"v2: input_layout='TNDX' is unknown"),
        ((Q, K, VV), dict(input_layout="NTD"), NotImplementedError, r"v2: input_layout='NTD'"),
        (
            (Q, K, VV),
            dict(num_key_value_heads=3),
            ValueError,
            r"v2: num_query_heads=4 must be divisible by num_key_value_heads=3",
        ),
        ((Q, K, VV), dict(num_query_heads=2), ValueError, r"v2: num_query_heads=2 must equal the query head axis"),
        (
            (Q, K, VV),
            dict(actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 4]),
            ValueError,
            r"v2: actual_seq_qlen\[-1\]=5 exceeds the query token count T=4",
        ),
        ((Q, K, VV), dict(actual_seq_kvlen=[2, 5]), ValueError, r"v2: actual_seq_kvlen\[-1\]=5 exceeds"),
        ((Q, K, VV), dict(actual_seq_qlen=[3, 2]), ValueError, r"v2: actual_seq_qlen must be cumulative"),
        ((Q, K, VV), dict(actual_seq_kvlen=[4]), ValueError, r"v2: actual_seq_kvlen has 1 entries; expected"),
        ((Q, K, VV), dict(actual_seq_qlen=None), ValueError, r"v2: input_layout TND needs actual_seq_qlen"),
        (
            (Q, K.reshape(1, 4, 32), VV.reshape(1, 4, 32)),
            dict(block_table=torch.zeros(2, 1, dtype=torch.int32)),
            ValueError,
            r"v2: block_table is given, so block_size must be > 0",
        ),
        (
            (Q, K.reshape(1, 4, 32), VV.reshape(1, 4, 32)),
            dict(block_table=torch.zeros(2, 1, dtype=torch.int32), block_size=16),
            ValueError,
            r"v2: block_size=16 must equal the key cache block axis",
        ),
        (
            (Q, K.reshape(1, 4, 32).repeat(1, 4, 1), VV.reshape(1, 4, 32).repeat(1, 4, 1)),
            dict(block_table=torch.tensor([[0], [3]], dtype=torch.int32), block_size=16),
            ValueError,
            r"v2: block_table holds block id 3 outside \[0, num_blocks=1\)",
        ),
        (
            (Q, K, VV),
            dict(sparse_mode=3, atten_mask=None),
            ValueError,
            r"v2: sparse_mode=3 needs the 2048x2048 atten_mask",
        ),
        ((Q, K, VV), dict(atten_mask=~TEMPLATE), ValueError, r"v2: atten_mask must be the template triu"),
        ((Q, K, VV), dict(atten_mask=TEMPLATE[:100, :100]), ValueError, r"v2: atten_mask for sparse_mode=3 must be"),
        ((Q, K, VV), dict(sparse_mode=0), ValueError, r"v2: TND with sparse_mode=0 takes no atten_mask"),
        ((Q, K, VV), dict(sparse_mode=1), ValueError, r"v2: TND allows sparse_mode 0 \(no mask\), 3, 4"),
        ((Q, K, VV), dict(sparse_mode=6), ValueError, r"v2: sparse_mode=6 is not supported"),
        ((Q, K.float(), VV), {}, ValueError, r"v2: key has dtype torch.float32; expected the query dtype"),
        (
            (Q, K.to(torch.float8_e4m3fn), VV),
            {},
            ValueError,
            r"v2: key dtype torch.float8_e4m3fn needs key_quant_mode=4",
        ),
        ((Q, K, VV), dict(pse_shift=torch.zeros(1)), NotImplementedError, r"v2: pse_shift not supported"),
        ((Q, K, VV), dict(learnable_sink=torch.zeros(4)), NotImplementedError, r"v2: learnable_sink not supported"),
        ((Q, K, VV), dict(query_rope=Q), NotImplementedError, r"v2: query_rope not supported"),
        ((Q, K, VV), dict(quant_scale_out=torch.ones(1)), NotImplementedError, r"v2: quant_scale_out not supported"),
        ((Q, K, VV), dict(key_quant_mode=1), NotImplementedError, r"v2: key_quant_mode=1 not supported"),
        ((Q, K, VV), dict(out_dtype=1), NotImplementedError, r"v2: out_dtype=torch.int8"),
        ((Q.to(torch.int8), K, VV), {}, NotImplementedError, r"v2: quantized query"),
        ((Q, K, VV), dict(inner_precise=7), ValueError, r"v2: inner_precise must be in 0..3"),
    ],
)
def test_v2_invalid_inputs_raise_naming_op_and_argument(args, over, error, pattern):
    with pytest.raises(error, match=pattern):
        OPS.npu_fused_infer_attention_score_v2(*args, **_tnd_kwargs(**over))


@pytest.mark.parametrize(
    "over, error, pattern",
    [
        (
            dict(num_heads=4, num_key_value_heads=3),
            ValueError,
            r"npu_fused_infer_attention_score: num_heads=4 must be "
            r"divisible by num_key_value_heads=3",
        ),
        (dict(actual_seq_lengths=[2, 9]), ValueError, r"score: actual_seq_lengths\[-1\]=9 exceeds"),
        (dict(antiquant_scale=torch.ones(2)), NotImplementedError, r"score: antiquant_scale not supported"),
        (dict(query_padding_size=torch.ones(1)), NotImplementedError, r"score: query_padding_size not supported"),
        (dict(key_shared_prefix=K), NotImplementedError, r"score: key_shared_prefix not supported"),
        (dict(quant_scale2=torch.ones(1)), NotImplementedError, r"score: quant_scale2 not supported"),
        (dict(antiquant_mode=1), NotImplementedError, r"score: antiquant_mode=1 not supported"),
    ],
)
def test_v1_invalid_inputs_raise_with_v1_argument_names(over, error, pattern):
    kw = dict(
        num_heads=4,
        num_key_value_heads=2,
        scale=0.25,
        input_layout="TND",
        sparse_mode=3,
        atten_mask=TEMPLATE,
        actual_seq_lengths=[2, 4],
        actual_seq_lengths_kv=[2, 4],
    )
    kw.update(over)
    with pytest.raises(error, match=pattern):
        OPS.npu_fused_infer_attention_score(Q, K, VV, **kw)


def test_bsnd_length_lists_follow_the_per_batch_rule():
    g = torch.Generator().manual_seed(2)
    q, k, v = rand(g, 3, 4, 2, 16), rand(g, 3, 5, 2, 16), rand(g, 3, 5, 2, 16)
    kw = dict(num_query_heads=2, input_layout="BSND", softmax_scale=0.3)
    broadcast = OPS.npu_fused_infer_attention_score_v2(q, k, v, actual_seq_qlen=[3], actual_seq_kvlen=[4], **kw)[0]
    explicit = OPS.npu_fused_infer_attention_score_v2(
        q, k, v, actual_seq_qlen=[3, 3, 3, 9], actual_seq_kvlen=[4, 4, 4, 9], **kw
    )[0]
    assert_bitwise_equal(broadcast, explicit, "len 1 broadcast == first B of a longer list")
    with pytest.raises(ValueError, match=r"v2: actual_seq_kvlen has 2 entries; expected 1 or >= batch 3"):
        OPS.npu_fused_infer_attention_score_v2(q, k, v, actual_seq_kvlen=[4, 4], **kw)
    with pytest.raises(ValueError, match=r"v2: actual_seq_kvlen entries must be in \[0, S_kv=5\]"):
        OPS.npu_fused_infer_attention_score_v2(q, k, v, actual_seq_kvlen=[6], **kw)


def test_strict_mode_enforces_npu_caps(monkeypatch):
    q, k, v = tnd_inputs(0, [2], [2], 2, 2, 16, torch.float32)
    fia_tnd(q, k, v, [2], [2], 2, 2)  # fp32 and D = 16 are portable extensions ...
    monkeypatch.setenv("QWEN3_MOE_STRICT_NPU_LIMITS", "1")
    with pytest.raises(ValueError, match=r"v2: NPU limit: query dtype must be float16/bfloat16"):
        fia_tnd(q, k, v, [2], [2], 2, 2)  # ... that strict mode rejects
    with pytest.raises(ValueError, match=r"v2: NPU limit: TND supports D = Dv = 128"):
        fia_tnd(q.bfloat16(), k.bfloat16(), v.bfloat16(), [2], [2], 2, 2)


# --- real NPU vs portable kernel ------------------------------------------------------------------------


def _npu_compare(name, args, kwargs, check_lse):
    npu = torch.device("npu")
    moved = {key: value.to(npu) if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
    got = getattr(OPS, name)(*(a.to(npu) for a in args), **moved)
    expected = portable_kernel(name)(*args, **kwargs)
    assert_close(got[0].cpu(), expected[0], op_tolerance(expected[0].dtype), f"{name} out on NPU")
    if check_lse:
        assert_close(got[1].cpu(), expected[1], op_tolerance(torch.float32), f"{name} lse on NPU")


@pytest.mark.npu
def test_npu_prefill_tnd_sparse3_matches_portable():
    lq = [37, 128, 1, 300]
    q, k, v = tnd_inputs(10, lq, lq, 8, 2, 128, torch.bfloat16)
    kw = dict(
        num_query_heads=8,
        num_key_value_heads=2,
        softmax_scale=1 / math.sqrt(128),
        input_layout="TND",
        sparse_mode=3,
        atten_mask=TEMPLATE,
        actual_seq_qlen=cumsum(lq),
        actual_seq_kvlen=cumsum(lq),
        return_softmax_lse=True,
    )
    _npu_compare(V2, (q, k, v), kw, check_lse=True)
    _npu_compare(V1, (q, k, v), _v1_kwargs(kw), check_lse=True)


def _npu_paged_compare(seed: int, lq: list[int], lkv: list[int]) -> None:
    """TND queries of lq[b] tokens over a paged BnBsH cache of lkv[b] keys per request (sparse_mode 3: the causal
    diagonal shifted by each row's lkv[b] - lq[b] cached keys), the NPU's kernel against the portable one."""
    q, k, v = tnd_inputs(seed, lq, lkv, 8, 2, 128, torch.bfloat16)
    kc, table = to_paged(seed, [per_request(k, lkv, b) for b in range(len(lq))], 128, "BnBsH", 0)
    vc, _ = to_paged(seed, [per_request(v, lkv, b) for b in range(len(lq))], 128, "BnBsH", 0)
    kw = dict(
        num_query_heads=8,
        num_key_value_heads=2,
        softmax_scale=1 / math.sqrt(128),
        input_layout="TND",
        sparse_mode=3,
        atten_mask=TEMPLATE,
        actual_seq_qlen=cumsum(lq),
        actual_seq_kvlen=lkv,
        block_table=table,
        block_size=128,
    )
    _npu_compare(V2, (q, kc, vc), kw, check_lse=False)


@pytest.mark.npu
def test_npu_paged_decode_matches_portable():
    _npu_paged_compare(11, [1] * 4, [1, 130, 257, 64])


@pytest.mark.npu
def test_npu_paged_extend_matches_portable():
    """Prefill over cached KV as the model calls it: TND new tokens over a paged BnBsH cache of cached + new K/V."""
    _npu_paged_compare(13, [37, 128, 1, 200], [37 + 130, 128 + 256, 1 + 5, 200])


@pytest.mark.npu
def test_npu_bsnd_varlen_matches_portable():
    g = torch.Generator().manual_seed(12)
    q, k, v = (rand(g, 2, s, 8, 128, dtype=torch.bfloat16) for s in (16, 40, 40))
    kw = dict(
        num_query_heads=8,
        softmax_scale=1 / math.sqrt(128),
        input_layout="BSND",
        sparse_mode=3,
        atten_mask=TEMPLATE,
        actual_seq_qlen=[16, 16],
        actual_seq_kvlen=[40, 33],
    )
    _npu_compare(V2, (q, k, v), kw, check_lse=False)


@given(
    seed=seeds,
    reqs=requests(max_kv=40, decode=True),
    hd=heads(),
    d=head_dims,
    dtype=dtypes,
    block_size=st.sampled_from([16, 32]),
    tail=st.integers(0, 2),
    lse=st.booleans(),
)
def test_traced_body_equals_the_kernel_bitwise(seed, reqs, hd, d, dtype, block_size, tail, lse):
    """The body a compiled graph inlines (`fia_v2_traced`: no host read of block ids or mask, functional row
    writes) computes the kernel's result bit for bit, rows past the last request (tail) included."""
    from optimized.ops.attention import fia_v2_traced

    (lq, lkv), (nq, nkv) = reqs, hd
    q, k, v = tnd_inputs(seed, lq, lkv, nq, nkv, d, dtype, tail=tail)
    kc, table = to_paged(seed, [per_request(k, lkv, b) for b in range(len(lkv))], block_size, "BnBsH", 0)
    vc, _ = to_paged(seed, [per_request(v, lkv, b) for b in range(len(lkv))], block_size, "BnBsH", 0)
    kwargs = dict(
        num_query_heads=nq,
        num_key_value_heads=nkv,
        softmax_scale=1 / math.sqrt(d),
        input_layout="TND",
        actual_seq_qlen=cumsum(lq),
        actual_seq_kvlen=lkv,
        block_table=table,
        block_size=block_size,
        sparse_mode=3,
        atten_mask=TEMPLATE,
        return_softmax_lse=lse,
    )
    want = portable_kernel(V2)(q, kc, vc, **kwargs)
    got = fia_v2_traced(q, kc, vc, **kwargs)
    assert_bitwise_equal(got[0], want[0], "traced body vs kernel: attention_out")
    assert_bitwise_equal(got[1], want[1], "traced body vs kernel: softmax_lse")


@st.composite
def equal_length_batches(draw):
    """Up to 8 requests with lengths from a small set, so several share (Lq, Lkv) and are batched together; decode
    rows (Lq 1) or whole prompts (Lq = Lkv)."""
    batch = draw(st.integers(2, 8))
    lkv = [draw(st.sampled_from([1, 3, 17])) for _ in range(batch)]
    lq = [1 if draw(st.booleans()) else x for x in lkv] if draw(st.booleans()) else [1] * batch
    return lq, lkv


@given(
    seed=seeds,
    reqs=equal_length_batches(),
    hd=heads(),
    dtype=dtypes,
    layout=st.sampled_from(["TND", "paged", "BSND"]),
    lse=st.booleans(),
)
def test_requests_batched_by_length_equal_each_request_alone_bitwise(seed, reqs, hd, dtype, layout, lse):
    """The kernel batches requests of equal (Lq, Lkv) into one computation (eager): every request's rows are bit
    for bit what a call with that request alone returns, for contiguous and paged TND and for BSND."""
    (lq, lkv), (nq, nkv), d = reqs, hd, 16
    q, k, v = tnd_inputs(seed, lq, lkv, nq, nkv, d, dtype)
    common = dict(return_softmax_lse=lse)
    batch = len(lq)
    if layout == "BSND":
        s, s_kv = max(lq), max(lkv)
        q4 = torch.zeros(batch, s, nq, d, dtype=dtype)
        k4, v4 = torch.zeros(batch, s_kv, nkv, d, dtype=dtype), torch.zeros(batch, s_kv, nkv, d, dtype=dtype)
        for b in range(batch):
            q4[b, : lq[b]] = per_request(q, lq, b)
            k4[b, : lkv[b]], v4[b, : lkv[b]] = per_request(k, lkv, b), per_request(v, lkv, b)
        run = lambda sel, ql, kl: OPS.npu_fused_infer_attention_score_v2(  # noqa: E731
            q4[sel],
            k4[sel],
            v4[sel],
            num_query_heads=nq,
            num_key_value_heads=nkv,
            softmax_scale=1 / math.sqrt(d),
            input_layout="BSND",
            sparse_mode=0,
            actual_seq_qlen=ql,
            actual_seq_kvlen=kl,
            **common,
        )
        together = run(slice(None), lq, lkv)
        for b in range(batch):
            alone = run(slice(b, b + 1), [lq[b]], [lkv[b]])
            assert_bitwise_equal(together[0][b : b + 1], alone[0], f"request {b} of {reqs}: out")
            assert_bitwise_equal(together[1][b : b + 1], alone[1], f"request {b} of {reqs}: lse")
        return
    if layout == "paged":
        kc, table = to_paged(seed, [per_request(k, lkv, b) for b in range(batch)], 16, "BnBsH", 0)
        vc, _ = to_paged(seed, [per_request(v, lkv, b) for b in range(batch)], 16, "BnBsH", 0)
        paged = dict(block_size=16)
        together = fia_tnd(q, kc, vc, lq, lkv, nq, nkv, kvlen=lkv, block_table=table, **paged, **common)
    else:
        together = fia_tnd(q, k, v, lq, lkv, nq, nkv, **common)
    for b in range(batch):
        q_b = per_request(q, lq, b)
        if layout == "paged":
            alone = fia_tnd(
                q_b, kc, vc, [lq[b]], [lkv[b]], nq, nkv, kvlen=[lkv[b]], block_table=table[b : b + 1], **paged, **common
            )
        else:
            alone = fia_tnd(q_b, per_request(k, lkv, b), per_request(v, lkv, b), [lq[b]], [lkv[b]], nq, nkv, **common)
        assert_bitwise_equal(per_request(together[0], lq, b), alone[0], f"request {b} of {reqs} ({layout}): out")
        assert_bitwise_equal(per_request(together[1], lq, b), alone[1], f"request {b} of {reqs} ({layout}): lse")
