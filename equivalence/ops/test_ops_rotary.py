"""npu_apply_rotary_pos_emb (spec §4) proven against independent plain math.

Covers: every mode against an fp64 pair-rotation reference, 'half' against the HF rotate_half formula
(bit-exact for bf16/fp32, native-fp16 emulation pinned), identity for cos=1/sin=0, norm preservation, layout
equivalence (TND/BSND/SBND/BNSD and the BSND fallback), GQA head counts, 950 cos batch broadcast, no mutation and
fresh outputs, opcheck, torch.compile, errors, and NPU-vs-portable comparisons.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import optimized  # noqa: F401  (registers torch.ops.npu.*)
from equivalence.support.compare import assert_bitwise_equal, assert_close, op_tolerance
from optimized.ops.registry import portable_kernel

rope = torch.ops.npu.npu_apply_rotary_pos_emb
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
MODES = ("half", "quarter", "interleave")
LAYOUTS = ("TND", "BSND", "SBND", "BNSD", "BSH")  # "BSH" is not a RoPE layout: op-plugin falls back to BSND


def to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """(B, S, N, D) -> the layout's axis order (TND flattens B*S)."""
    if layout == "TND":
        return t.reshape(-1, *t.shape[2:])
    if layout == "SBND":
        return t.transpose(0, 1)
    if layout == "BNSD":
        return t.transpose(1, 2)
    return t  # BSND and every fallback string


def from_layout(t: torch.Tensor, layout: str, b: int) -> torch.Tensor:
    if layout == "TND":
        return t.reshape(b, -1, *t.shape[1:])
    if layout in ("SBND", "BNSD"):
        return to_layout(t, layout)  # both transposes are involutions
    return t


def pair_indices(d: int, mode: str):
    """(first, second) members of each rotated pair: rot(x)[first] = -x[second], rot(x)[second] = x[first]."""
    idx = torch.arange(d)
    if mode == "half":
        return idx[: d // 2], idx[d // 2 :]
    if mode == "interleave":
        return idx[0::2], idx[1::2]
    q = d // 4
    return torch.cat((idx[:q], idx[2 * q : 3 * q])), torch.cat((idx[q : 2 * q], idx[3 * q :]))


def fp64_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    """Independent reference: rotate each (first, second) pair, in fp64, written element-pair-wise."""
    x, c, s = x.double(), cos.double(), sin.double()
    first, second = pair_indices(x.shape[-1], mode)
    out = torch.empty(torch.broadcast_shapes(x.shape, c.shape), dtype=torch.float64)
    out[..., first] = x[..., first] * c[..., first] - x[..., second] * s[..., first]
    out[..., second] = x[..., second] * c[..., second] + x[..., first] * s[..., second]
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF transformers' rotate_half."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_tol(dtype: torch.dtype):
    return "op.rotary.float16" if dtype == torch.float16 else op_tolerance(dtype)


# --- strategies ---------------------------------------------------------------------------------------


@st.composite
def rope_case(draw, modes=MODES, layouts=LAYOUTS, dtypes=FLOATS, rotation=False):
    """BSND-ordered tensors q (B,S,Nq,D), k (B,S,Nk,D), cos/sin (B|1,S,1,D) plus a layout and mode.

    GQA: Nq = group * Nk. |x| <= 4 and |cos|, |sin| <= 1 (the bound behind op.rotary.float16). With
    rotation=True cos/sin hold cos/sin of one angle per pair (a true rotation).
    """
    dtype = draw(st.sampled_from(dtypes))
    mode = draw(st.sampled_from(modes))
    layout = draw(st.sampled_from(layouts))
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    nk = draw(st.integers(1, 3))
    nq = nk * draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from([4, 8, 16, 64, 128]))
    cos_batch = 1 if (layout != "TND" and draw(st.booleans())) else b  # Ascend 950 batch broadcast
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(b, s, nq, d, generator=gen).clamp(-4, 4).to(dtype)
    k = torch.randn(b, s, nk, d, generator=gen).clamp(-4, 4).to(dtype)
    if rotation:
        angle = torch.rand(cos_batch, s, 1, d // 2, generator=gen) * 6.3
        first, second = pair_indices(d, mode)
        full = torch.empty(cos_batch, s, 1, d)
        full[..., first] = angle
        full[..., second] = angle
        cos, sin = full.cos().to(dtype), full.sin().to(dtype)
    else:
        cos = (torch.rand(cos_batch, s, 1, d, generator=gen) * 2 - 1).to(dtype)
        sin = (torch.rand(cos_batch, s, 1, d, generator=gen) * 2 - 1).to(dtype)
    return q, k, cos, sin, layout, mode


def call(q, k, cos, sin, layout, mode):
    """Run the op in `layout` on BSND-ordered tensors; results come back in BSND order."""
    b = q.shape[0]
    if layout == "TND" and cos.shape[0] != b:
        cos, sin = cos.expand(b, *cos.shape[1:]), sin.expand(b, *sin.shape[1:])
    args = [to_layout(t, layout) for t in (q, k, cos, sin)]
    q_out, k_out = rope(*args, layout=layout, rotary_mode=mode)
    return from_layout(q_out, layout, b), from_layout(k_out, layout, b)


# --- properties ---------------------------------------------------------------------------------------


@given(rope_case())
def test_matches_fp64_pair_rotation(case):
    q, k, cos, sin, layout, mode = case
    q_out, k_out = call(q, k, cos, sin, layout, mode)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.dtype == k_out.dtype == q.dtype
    assert_close(q_out, fp64_rope(q, cos, sin, mode), rope_tol(q.dtype), f"query {layout}/{mode}")
    assert_close(k_out, fp64_rope(k, cos, sin, mode), rope_tol(k.dtype), f"key {layout}/{mode}")


@given(rope_case(modes=("half",)))
def test_half_equals_hf_rotate_half(case):
    q, k, cos, sin, layout, _ = case
    q_out, k_out = call(q, k, cos, sin, layout, "half")
    for x, out in ((q, q_out), (k, k_out)):
        if x.dtype == torch.float16:
            # fp16 is evaluated natively, one rounding per operation (spec §4 precision note, emulated exactly)
            want = x * cos + rotate_half(x) * sin
        else:
            # bf16: fp32 compute + one rounding; fp32: fp32 compute
            xf = x.float()
            want = (xf * cos.float() + rotate_half(xf) * sin.float()).to(x.dtype)
        assert_bitwise_equal(out, want, f"HF rotate_half formula ({x.dtype}, {layout})")


@given(rope_case())
def test_identity_when_cos_one_sin_zero(case):
    q, k, cos, sin, layout, mode = case
    q_out, k_out = call(q, k, torch.ones_like(cos), torch.zeros_like(sin), layout, mode)
    assert torch.equal(q_out, q) and torch.equal(k_out, k)


@given(rope_case(rotation=True))
def test_rotation_keeps_pair_norms(case):
    q, k, cos, sin, layout, mode = case
    first, second = pair_indices(q.shape[-1], mode)
    for x, out in zip((q, k), call(q, k, cos, sin, layout, mode)):
        norm_in = torch.hypot(x[..., first].double(), x[..., second].double())
        norm_out = torch.hypot(out[..., first].double(), out[..., second].double())
        # cos/sin were rounded to the input dtype, so cos^2 + sin^2 = 1 only up to that dtype's rounding.
        assert_close(norm_out, norm_in, rope_tol(x.dtype), f"pair 2-norm ({layout}/{mode})")


@given(rope_case(layouts=("BSND",)))
def test_layouts_agree(case):
    q, k, cos, sin, _, mode = case
    want_q, want_k = rope(
        q,
        k,
        cos.expand(q.shape[0], *cos.shape[1:]),
        sin.expand(q.shape[0], *sin.shape[1:]),
        layout="BSND",
        rotary_mode=mode,
    )
    for layout in ("TND", "SBND", "BNSD", "BSH", "anything"):
        got_q, got_k = call(q, k, cos, sin, layout, mode)
        assert_bitwise_equal(got_q, want_q, f"query {layout} vs BSND")
        assert_bitwise_equal(got_k, want_k, f"key {layout} vs BSND")


@given(rope_case())
def test_inputs_untouched_and_outputs_fresh(case):
    q, k, cos, sin, layout, mode = case
    args = [to_layout(t, layout) for t in (q, k, cos, sin)]  # rope_case gives TND a full cos batch
    before = [t.clone() for t in args]
    outs = rope(*args, layout=layout, rotary_mode=mode)
    for t, saved in zip(args, before):
        assert_bitwise_equal(t, saved, "input unchanged")
    storages = {t.untyped_storage().data_ptr() for t in args}
    assert all(o.untyped_storage().data_ptr() not in storages for o in outs)
    assert outs[0].untyped_storage().data_ptr() != outs[1].untyped_storage().data_ptr()


def test_qwen3_call_shape():
    # Qwen3-MoE: TND, (T, Nq_r, 128) / (T, Nkv_r, 128) bf16, cos/sin = cat(freqs, freqs)[positions] (T, 1, 128).
    t, nq, nk, d = 6, 8, 2, 128
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(t).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().bfloat16().unsqueeze(1), emb.sin().bfloat16().unsqueeze(1)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(t, nq, d, generator=gen).bfloat16()
    k = torch.randn(t, nk, d, generator=gen).bfloat16()
    q_out, k_out = rope(q, k, cos, sin, layout="TND")
    assert_bitwise_equal(q_out, (q.float() * cos.float() + rotate_half(q.float()) * sin.float()).bfloat16(), "q")
    assert_bitwise_equal(k_out, (k.float() * cos.float() + rotate_half(k.float()) * sin.float()).bfloat16(), "k")
    assert torch.equal(q_out[0], q[0])  # position 0: cos = 1, sin = 0


def test_empty_tokens():
    q, k = torch.empty(0, 4, 64), torch.empty(0, 2, 64)
    q_out, k_out = rope(q, k, torch.empty(0, 1, 64), torch.empty(0, 1, 64), layout="TND")
    assert q_out.shape == (0, 4, 64) and k_out.shape == (0, 2, 64)


# --- registration: opcheck, torch.compile ---------------------------------------------------------------


def _samples():
    gen = torch.Generator().manual_seed(5)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return [
        (
            (r(5, 4, 16).bfloat16(), r(5, 2, 16).bfloat16(), r(5, 1, 16).bfloat16(), r(5, 1, 16).bfloat16()),
            {"layout": "TND"},
        ),
        ((r(2, 3, 4, 8), r(2, 3, 1, 8), r(2, 3, 1, 8), r(2, 3, 1, 8)), {}),
        (
            (r(2, 4, 3, 8).half(), r(2, 2, 3, 8).half(), r(1, 1, 3, 8).half(), r(1, 1, 3, 8).half()),
            {"layout": "BNSD", "rotary_mode": "interleave"},
        ),
        (
            (
                r(3, 2, 4, 8).transpose(0, 1),
                r(3, 2, 4, 8).transpose(0, 1),
                r(3, 2, 1, 8).transpose(0, 1),
                r(3, 2, 1, 8).transpose(0, 1),
            ),
            {"layout": "BSND", "rotary_mode": "quarter"},
        ),  # non-contiguous
    ]


@pytest.mark.parametrize("index", range(4))
def test_opcheck(index):
    args, kwargs = _samples()[index]
    torch.library.opcheck(rope.default, args, kwargs)


def test_torch_compile_fullgraph_matches_eager():
    def step(q, k, cos, sin):
        q2, k2 = torch.ops.npu.npu_apply_rotary_pos_emb(q, k, cos, sin, layout="TND")
        return torch.ops.npu.npu_apply_rotary_pos_emb(q2, k2, cos, sin, "TND", "interleave")

    args, _ = _samples()[0]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(*args), step(*args)):
        assert_bitwise_equal(got, want, "compiled vs eager")


# --- errors -------------------------------------------------------------------------------------------


def test_errors_name_op_and_argument():
    q, k, c = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    op = "npu_apply_rotary_pos_emb"
    with pytest.raises(ValueError, match=rf"{op}: rotary_mode must be one of .*got 'full'"):
        rope(q, k, c, c, layout="TND", rotary_mode="full")
    with pytest.raises(ValueError, match=rf"{op}: query must have 4 dims for layout 'BSH' \(BSND\)"):
        rope(q, k, c, c, layout="BSH")  # fallback to BSND, which is 4-D
    with pytest.raises(ValueError, match=rf"{op}: key has dtype torch.float16; expected query.dtype"):
        rope(q, k.half(), c, c, layout="TND")
    with pytest.raises(ValueError, match=rf"{op}: query has dtype torch.int64"):
        rope(q.long(), k.long(), c.long(), c.long(), layout="TND")
    with pytest.raises(ValueError, match=rf"{op}: key head dim 4 != query head dim 8"):
        rope(q, k[..., :4], c, c, layout="TND")
    with pytest.raises(ValueError, match=rf"{op}: sin shape \(4, 2, 8\) != cos shape \(4, 1, 8\)"):
        rope(q, k, c, torch.randn(4, 2, 8), layout="TND")
    with pytest.raises(NotImplementedError, match=rf"{op}: partial rotary .* not supported by the portable kernel"):
        rope(q, k, c[..., :4], c[..., :4], layout="TND")
    with pytest.raises(ValueError, match=rf"{op}: cos/sin N axis \(dim 1 in TND\) must be 1"):
        rope(q, k, torch.randn(4, 2, 8), torch.randn(4, 2, 8), layout="TND")
    with pytest.raises(ValueError, match=rf"{op}: head dim D=6 must be a multiple of 4 for rotary_mode 'quarter'"):
        rope(q[..., :6], k[..., :6], c[..., :6], c[..., :6], layout="TND", rotary_mode="quarter")
    with pytest.raises(ValueError, match=rf"{op}: key dim 0 is 3; expected query's 4"):
        rope(q, k[:3], c, c, layout="TND")
    with pytest.raises(ValueError, match=rf"{op}: cos/sin dim 0 is 1; expected query's 4 \(layout TND\)"):
        rope(q, k, c[:1], c[:1], layout="TND")  # batch broadcast exists only for layouts with a B axis


def test_strict_mode_enforces_a2a3_caps(monkeypatch):
    monkeypatch.setenv("QWEN3_MOE_STRICT_NPU_LIMITS", "1")
    q, k, c = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    with pytest.raises(ValueError, match=r"npu_apply_rotary_pos_emb: NPU limit: head dim D must be 64 or 128"):
        rope(q, k, c, c, layout="TND")
    monkeypatch.setenv("NPU_GOLDEN_SOC", "950")
    rope(q, k, c, c, layout="TND")


# --- NPU vs portable ----------------------------------------------------------------------------------


@pytest.mark.npu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", ["TND", "BSND"])
def test_npu_matches_portable(dtype, layout):
    gen = torch.Generator().manual_seed(13)
    b, s, nq, nk, d = 2, 5, 8, 2, 128
    q = torch.randn(b, s, nq, d, generator=gen).to(dtype)
    k = torch.randn(b, s, nk, d, generator=gen).to(dtype)
    angle = torch.rand(b, s, 1, d // 2, generator=gen) * 6.3
    emb = torch.cat((angle, angle), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    args = [to_layout(t, layout).contiguous() for t in (q, k, cos, sin)]
    npu = torch.device("npu")
    # The NPU kernel writes into its inputs (spec §10.4): hand it copies and compare only the returned values.
    got = torch.ops.npu.npu_apply_rotary_pos_emb(*[t.to(npu) for t in args], layout=layout)
    want = portable_kernel("npu_apply_rotary_pos_emb")(*args, layout=layout)
    for g, w, what in zip(got, want, ("query", "key")):
        # bf16: the kernel rounds ties away from zero, RNE here: differs on exact ties only (< 1 ulp).
        assert_close(g.cpu(), w, op_tolerance(dtype), f"{what} {layout} {dtype}")
