"""RMSNorm family (spec §1-§3) proven against independent fp64 / plain-torch math.

Covers: npu_rms_norm vs an fp64 reference, rstd shape/dtype, unit RMS with gamma = 1, scale invariance,
rank-2 gamma; npu_add_rms_norm residual sum bit-exact, symmetry, rstd/y vs npu_rms_norm on the rounded sum;
npu_add_rms_norm_cast y1 == f32(y2) (variant A), agreement with npu_add_rms_norm; variant B (NPU_GOLDEN_SOC=950);
opcheck, torch.compile, error messages, and NPU-vs-portable comparisons.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import optimized  # noqa: F401  (registers torch.ops.npu.*)
from equivalence.support.compare import assert_bitwise_equal, assert_close, op_tolerance
from optimized.ops.registry import portable_kernel

ops = torch.ops.npu
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# (x dtype, gamma dtype) pairs npu_rms_norm accepts (spec §1).
RMS_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
]


def norm_tol(dtype: torch.dtype) -> str:
    return f"op.norm.{str(dtype).removeprefix('torch.')}"


@contextlib.contextmanager
def soc(variant: str):
    """Select the norm precision variant through the package-wide env switch (spec §2)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NPU_GOLDEN_SOC", variant)
        yield


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of representable values between a and b (same float dtype), elementwise; +0 == -0."""
    assert a.dtype == b.dtype and a.shape == b.shape
    width = {2: torch.int16, 4: torch.int32}[a.element_size()]
    sign_mask = (1 << (8 * a.element_size() - 1)) - 1

    def ordered(t):
        bits = t.contiguous().view(width).to(torch.int64)
        return torch.where(bits < 0, -(bits & sign_mask), bits)

    return (ordered(a) - ordered(b)).abs()


def max_ulp(a: torch.Tensor, b: torch.Tensor) -> int:
    return int(ulp_distance(a, b).max()) if a.numel() else 0


# --- strategies ---------------------------------------------------------------------------------------


@st.composite
def norm_inputs(draw, dtypes=RMS_PAIRS, need_noncontig=True):
    """(x, gamma, eps): x of rank 1-4, gamma over the trailing g axes, optionally a non-contiguous x."""
    x_dtype, g_dtype = draw(st.sampled_from(dtypes))
    rank = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 5)) for _ in range(rank - 1)] + [draw(st.integers(1, 96))]
    g = draw(st.integers(1, rank))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    eps = draw(st.sampled_from([0.0, 1e-6, 1e-5]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    noncontig = need_noncontig and draw(st.booleans())
    base_shape = shape[:-1] + [shape[-1] * (2 if noncontig else 1)]
    x = (torch.randn(base_shape, generator=gen) * magnitude).to(x_dtype)
    if noncontig:
        x = x[..., ::2]
    gamma = (torch.rand(shape[rank - g :], generator=gen) * 2 - 0.5).to(g_dtype)
    return x, gamma, eps


@st.composite
def add_norm_inputs(draw, dtypes=FLOATS):
    dtype = draw(st.sampled_from(dtypes))
    x1, gamma, eps = draw(norm_inputs(dtypes=[(dtype, dtype)]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x2 = (torch.randn(x1.shape, generator=gen) * draw(st.sampled_from([1e-2, 1.0, 10.0]))).to(dtype)
    return x1, x2, gamma, eps


def fp64_rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float):
    """Independent reference: y = x / sqrt(mean(x^2) + eps) * gamma over the trailing gamma.dim() axes, fp64."""
    xd = x.double()
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    rstd = 1.0 / torch.sqrt((xd * xd).sum(dims, keepdim=True) / gamma.numel() + eps)
    return xd * rstd * gamma.double(), rstd


# --- npu_rms_norm -------------------------------------------------------------------------------------


@given(norm_inputs())
def test_rms_norm_matches_fp64_reference(inputs):
    x, gamma, eps = inputs
    y, rstd = ops.npu_rms_norm(x, gamma, eps)
    y_ref, rstd_ref = fp64_rms_norm(x, gamma, eps)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rstd.dtype == torch.float32
    assert rstd.shape == x.shape[: x.dim() - gamma.dim()] + (1,) * gamma.dim()
    assert_close(y, y_ref, norm_tol(x.dtype), "y vs fp64")
    assert_close(rstd, rstd_ref, "op.norm.rstd", "rstd vs fp64")
    # cast point (spec §1 step 4): given the fp32 rstd, y is rounded exactly once
    assert_bitwise_equal(y, (x.float() * rstd * gamma.float()).to(x.dtype), "y = rne(f32(x) * rstd * f32(gamma))")


def test_rms_norm_single_rounding_pinned():
    # y = rne(f32(x) * rstd * f32(gamma)), one rounding; the HF two-rounding form differs on some elements.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen).to(torch.bfloat16)
    gamma = (torch.rand(256, generator=gen) + 0.5).to(torch.bfloat16)
    y, rstd = ops.npu_rms_norm(x, gamma, 1e-6)
    xf = x.float()
    once = (xf * rstd * gamma.float()).to(torch.bfloat16)
    twice = (xf * rstd).to(torch.bfloat16).float().mul(gamma.float()).to(torch.bfloat16)
    assert_bitwise_equal(y, once, "single rounding")
    assert not torch.equal(y, twice)
    assert max_ulp(y, twice) <= 1  # spec §10.3: <= 1 ulp from the HF reference


@given(norm_inputs(need_noncontig=False))
def test_rms_norm_unit_gamma_gives_unit_rms(inputs):
    x, gamma, _ = inputs
    x = x + (x == 0).to(x.dtype)  # no all-zero rows
    ones = torch.ones_like(gamma)
    y, _ = ops.npu_rms_norm(x, ones, 0.0)
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    mean_sq = y.float().square().mean(dims)
    assert_close(mean_sq, torch.ones_like(mean_sq), norm_tol(x.dtype), "mean(y^2) with gamma = 1")


@given(norm_inputs(need_noncontig=False), st.sampled_from([2.0, 8.0]), st.floats(0.01, 100.0))
def test_rms_norm_scale_invariant(inputs, pow2, c):
    x, gamma, _ = inputs
    # eps = 0 and a power-of-two factor (upwards: no fp16 subnormal loss, |x| <= 240 no overflow): every step
    # scales exactly, so y is bit-identical.
    assert_bitwise_equal(ops.npu_rms_norm(x * pow2, gamma, 0.0)[0], ops.npu_rms_norm(x, gamma, 0.0)[0], "y(2^k x)")
    # any c > 0 on fp32 input: equal up to fp32 rounding of c*x.
    xf = x.float().clone()
    xf[xf == 0] = 1.0
    assert_close(
        ops.npu_rms_norm(xf * c, gamma.float(), 0.0)[0],
        ops.npu_rms_norm(xf, gamma.float(), 0.0)[0],
        "op.norm.float32",
        "y(c x)",
    )


def test_rms_norm_rank2_gamma_normalizes_two_axes():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 8, generator=gen)
    gamma = torch.rand(4, 8, generator=gen)
    y, rstd = ops.npu_rms_norm(x, gamma)
    assert rstd.shape == (2, 3, 1, 1)
    y_flat, rstd_flat = ops.npu_rms_norm(x.reshape(2, 3, 32), gamma.reshape(32))
    assert_close(y, y_flat.reshape(2, 3, 4, 8), "op.norm.float32", "rank-2 gamma == flattened axes")
    assert_close(rstd, rstd_flat.reshape(2, 3, 1, 1), "op.norm.rstd", "rstd")


def test_rms_norm_edge_cases():
    eps = 1e-6
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    x[1] = 1
    x[1, 3] = float("inf")
    y, rstd = ops.npu_rms_norm(x, torch.ones(8, dtype=torch.bfloat16), eps)
    assert torch.equal(y[0], torch.zeros(8, dtype=torch.bfloat16))  # all-zero row: y = 0
    assert rstd[0, 0].item() == pytest.approx(1 / eps**0.5, rel=1e-6)  # ... and rstd = 1/sqrt(eps)
    # Inf propagates as a non-finite value: mean(x^2) = inf, rstd = 0, y = inf * 0 = NaN at the Inf slot
    # (spec §1 says "Inf in -> Inf out", which the spec's own formula cannot produce; the formula wins).
    assert rstd[1, 0].item() == 0.0 and y[1].isnan()[3]
    x_nan = torch.ones(1, 4)
    x_nan[0, 0] = float("nan")
    assert ops.npu_rms_norm(x_nan, torch.ones(4))[0].isnan().all()
    half = torch.float16
    empty_y, empty_rstd = ops.npu_rms_norm(torch.empty(0, 3, 16, dtype=half), torch.ones(16, dtype=half))
    assert empty_y.shape == (0, 3, 16) and empty_rstd.shape == (0, 3, 1) and empty_rstd.dtype == torch.float32


# --- npu_add_rms_norm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["a2a3", "950"])
@given(inputs=add_norm_inputs())
def test_add_rms_norm_residual_sum_bit_exact_and_symmetric(variant, inputs):
    x1, x2, gamma, eps = inputs
    with soc(variant):
        y, rstd, x = ops.npu_add_rms_norm(x1, x2, gamma, eps)
        y_swapped, rstd_swapped, x_swapped = ops.npu_add_rms_norm(x2, x1, gamma, eps)
    # fp64 holds the sum closely enough that one more rounding to x1.dtype is the correctly rounded sum
    # (double rounding is innocuous when 53 >= 2p + 2).
    assert_bitwise_equal(x, (x1.double() + x2.double()).to(x1.dtype), "x == rne(f32(x1) + f32(x2))")
    for a, b, what in ((y, y_swapped, "y"), (rstd, rstd_swapped, "rstd"), (x, x_swapped, "x")):
        assert_bitwise_equal(a, b, f"{what} symmetric in (x1, x2)")
    assert y.dtype == x.dtype == x1.dtype and rstd.dtype == torch.float32
    assert rstd.shape == x1.shape[: x1.dim() - gamma.dim()] + (1,) * gamma.dim()


@given(add_norm_inputs())
def test_add_rms_norm_variant_a_vs_rms_norm_and_fp64(inputs):
    x1, x2, gamma, eps = inputs
    with soc("a2a3"):
        y, rstd, x = ops.npu_add_rms_norm(x1, x2, gamma, eps)
    y_ref, rstd_ref = ops.npu_rms_norm(x, gamma, eps)
    assert_close(rstd, rstd_ref, "op.norm.rstd", "rstd == npu_rms_norm(x)[1]")
    assert max_ulp(y, y_ref) <= 1, "y within 1 ulp of npu_rms_norm(x)[0]"
    t = x.float() * rstd  # variant A cast points (spec §2): round t, then round t * gamma (fp32: no rounding)
    want = t * gamma.float() if x.dtype == torch.float32 else (t.to(x.dtype).float() * gamma.float()).to(x.dtype)
    assert_bitwise_equal(y, want, "variant A cast points")
    y64, rstd64 = fp64_rms_norm(x, gamma, eps)  # variant A normalizes the ROUNDED sum
    assert_close(y, y64, norm_tol(x.dtype), "y vs fp64")
    assert_close(rstd, rstd64, "op.norm.rstd", "rstd vs fp64")


@given(add_norm_inputs())
def test_add_rms_norm_variant_b_uses_unrounded_sum(inputs):
    x1, x2, gamma, eps = inputs
    with soc("950"):
        y, rstd, x = ops.npu_add_rms_norm(x1, x2, gamma, eps)
    with soc("a2a3"):
        y_a, _, x_a = ops.npu_add_rms_norm(x1, x2, gamma, eps)
    assert_bitwise_equal(x, x_a, "x identical in both variants")
    xs = x1.double() + x2.double()  # the unrounded sum, to fp64 precision
    dims = tuple(range(x1.dim() - gamma.dim(), x1.dim()))
    rstd64 = 1.0 / torch.sqrt(xs.square().mean(dims, keepdim=True) + eps)
    assert_close(y, xs * rstd64 * gamma.double(), norm_tol(x1.dtype), "variant B y vs fp64 of the unrounded sum")
    assert_close(rstd, rstd64, "op.norm.rstd", "variant B rstd vs fp64 of the unrounded sum")
    xs32 = x1.float() + x2.float()  # variant B cast points: one rounding of the fp32 product
    assert_bitwise_equal(y, (xs32 * rstd * gamma.float()).to(x1.dtype), "variant B cast points")
    # spec §2: the variants are ~1 ulp apart (two perturbations of <= 1/2 ulp each can add up to 2).
    assert max_ulp(y, y_a) <= 2


def test_variant_switch_pinned():
    # bf16: variant A rounds the sum before the norm and t before gamma; B does not. Find a visible difference.
    gen = torch.Generator().manual_seed(3)
    x1 = torch.randn(32, 128, generator=gen).to(torch.bfloat16)
    x2 = torch.randn(32, 128, generator=gen).to(torch.bfloat16)
    gamma = (torch.rand(128, generator=gen) + 0.5).to(torch.bfloat16)
    with soc("a2a3"):
        y_a, rstd_a, _ = ops.npu_add_rms_norm(x1, x2, gamma)
    with soc("950"):
        y_b, rstd_b, _ = ops.npu_add_rms_norm(x1, x2, gamma)
    y_default = ops.npu_add_rms_norm(x1, x2, gamma)[0]
    assert_bitwise_equal(y_default, y_a, "variant A is the default")
    xs = x1.float() + x2.float()
    assert_bitwise_equal(rstd_b, 1.0 / torch.sqrt(xs.square().mean(-1, keepdim=True) + 1e-6), "B: rstd of fp32 sum")
    xf = xs.to(torch.bfloat16).float()
    rstd = 1.0 / torch.sqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
    assert_bitwise_equal(rstd_a, rstd, "A: rstd of the rounded sum")
    want_a = ((xf * rstd).to(torch.bfloat16).float() * gamma.float()).to(torch.bfloat16)
    assert_bitwise_equal(y_a, want_a, "A cast points")
    assert_bitwise_equal(y_b, (xs * rstd_b * gamma.float()).to(torch.bfloat16), "B cast points")
    assert not torch.equal(y_a, y_b)


# --- npu_add_rms_norm_cast ----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["a2a3", "950"])
@given(inputs=add_norm_inputs(dtypes=(torch.bfloat16, torch.float16)))
def test_add_rms_norm_cast(variant, inputs):
    x1, x2, gamma, eps = inputs
    with soc(variant):
        y1, y2, rstd, x = ops.npu_add_rms_norm_cast(x1, x2, gamma, eps)
        y, rstd_plain, x_plain = ops.npu_add_rms_norm(x1, x2, gamma, eps)
    assert y1.dtype == torch.float32 and y1.shape == x1.shape
    assert y2.dtype == x.dtype == x1.dtype and y2.shape == x.shape == x1.shape
    assert rstd.dtype == torch.float32 and rstd.shape == rstd_plain.shape
    for a, b, what in ((y2, y, "y2"), (rstd, rstd_plain, "rstd"), (x, x_plain, "x")):
        assert_bitwise_equal(a, b, f"{what} == npu_add_rms_norm's")
    if variant == "a2a3":
        assert_bitwise_equal(y1, y2.float(), "y1 == f32(y2) (variant A)")
    else:
        assert_bitwise_equal(y1.to(x1.dtype), y2, "y2 == rne(y1) (variant B: y1 unrounded)")
        xs = x1.double() + x2.double()
        dims = tuple(range(x1.dim() - gamma.dim(), x1.dim()))
        ref = xs / torch.sqrt(xs.square().mean(dims, keepdim=True) + eps) * gamma.double()
        assert_close(y1, ref, "op.norm.float32", "variant B y1 vs fp64")


# --- registration: opcheck, torch.compile ---------------------------------------------------------------


def _samples():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 16, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    x2 = torch.randn(3, 4, 16, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    g = torch.rand(16, generator=gen).to(torch.bfloat16)
    g2 = torch.rand(4, 16, generator=gen).to(torch.float32)
    return [
        (ops.npu_rms_norm.default, (x, g), {"epsilon": 1e-5}),
        (ops.npu_rms_norm.default, (x.transpose(0, 1), g), {}),  # non-contiguous self
        (ops.npu_rms_norm.default, (x, g2.to(torch.float32)), {}),
        (ops.npu_add_rms_norm.default, (x, x2, g), {}),
        (ops.npu_add_rms_norm.default, (x.float(), x2.float(), g2), {"epsilon": 1e-3}),
        (ops.npu_add_rms_norm_cast.default, (x, x2, g), {}),
        (ops.npu_add_rms_norm_cast.default, (x.half(), x2.half(), g.half()), {}),
    ]


@pytest.mark.parametrize("index", range(7))
def test_opcheck(index):
    op, args, kwargs = _samples()[index]
    torch.library.opcheck(op, args, kwargs)


def test_torch_compile_fullgraph_matches_eager():
    def step(h, residual, w_in, w_q, q):
        y0, _ = torch.ops.npu.npu_rms_norm(h, w_in, 1e-6)
        y, _, res = torch.ops.npu.npu_add_rms_norm(residual, y0, w_in, 1e-6)
        y1, y2, _, res2 = torch.ops.npu.npu_add_rms_norm_cast(y, res, w_in, 1e-6)
        qn, _ = torch.ops.npu.npu_rms_norm(q, w_q, 1e-6)
        return y1, y2, res2, qn

    gen = torch.Generator().manual_seed(7)
    args = (
        torch.randn(5, 64, generator=gen).bfloat16(),
        torch.randn(5, 64, generator=gen).bfloat16(),
        torch.rand(64, generator=gen).bfloat16(),
        torch.rand(16, generator=gen).bfloat16(),
        torch.randn(5, 4, 16, generator=gen).bfloat16(),
    )
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(*args), step(*args)):
        assert_bitwise_equal(got, want, "compiled vs eager")


# --- errors -------------------------------------------------------------------------------------------


def test_errors_name_op_and_argument():
    bf = torch.bfloat16
    x = torch.randn(2, 8, dtype=bf)
    g = torch.ones(8, dtype=bf)
    with pytest.raises(ValueError, match=r"npu_rms_norm: gamma must have 1 to self.dim\(\)=2 dims"):
        ops.npu_rms_norm(x, torch.ones(1, 2, 8, dtype=bf))
    with pytest.raises(ValueError, match=r"npu_rms_norm: gamma has shape \(4,\); expected \(8,\)"):
        ops.npu_rms_norm(x, torch.ones(4, dtype=bf))
    with pytest.raises(ValueError, match=r"npu_rms_norm: \(self, gamma\) dtypes .*bfloat16.*float16.* not allowed"):
        ops.npu_rms_norm(x, g.half())
    with pytest.raises(ValueError, match=r"npu_rms_norm: self has dtype torch.int32"):
        ops.npu_rms_norm(x.int(), g)
    with pytest.raises(ValueError, match=r"npu_rms_norm: epsilon must be >= 0; got -1"):
        ops.npu_rms_norm(x, g, -1.0)
    with pytest.raises(ValueError, match=r"npu_rms_norm: self must have 1 to 8 dims"):
        ops.npu_rms_norm(torch.ones([1] * 9, dtype=bf), torch.ones(1, dtype=bf))
    with pytest.raises(ValueError, match=r"npu_add_rms_norm: x2 has shape \(2, 4\); expected \(2, 8\)"):
        ops.npu_add_rms_norm(x, torch.ones(2, 4, dtype=bf), g)
    with pytest.raises(ValueError, match=r"npu_add_rms_norm: x2 has dtype torch.float16; expected x1.dtype"):
        ops.npu_add_rms_norm(x, x.half(), g)
    with pytest.raises(ValueError, match=r"npu_add_rms_norm: gamma has dtype torch.float32; expected x1.dtype"):
        ops.npu_add_rms_norm(x, x, g.float())
    with pytest.raises(ValueError, match=r"npu_add_rms_norm_cast: x1 has dtype torch.float32; allowed"):
        ops.npu_add_rms_norm_cast(x.float(), x.float(), g.float())
    with pytest.raises(ValueError, match=r"NPU_GOLDEN_SOC='910'"):
        with soc("910"):
            ops.npu_add_rms_norm(x, x, g)


# --- NPU vs portable ----------------------------------------------------------------------------------


@pytest.mark.npu
@pytest.mark.parametrize("x_dtype,g_dtype", RMS_PAIRS)
@pytest.mark.parametrize("shape,g_rank", [((7, 4096), 1), ((7, 4, 128), 1), ((2, 3, 4, 8), 2)])
def test_npu_rms_norm_matches_portable(x_dtype, g_dtype, shape, g_rank):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=gen).to(x_dtype)
    gamma = torch.rand(shape[-g_rank:], generator=gen).to(g_dtype)
    npu = torch.device("npu")
    y, rstd = torch.ops.npu.npu_rms_norm(x.to(npu), gamma.to(npu), 1e-6)
    y_cpu, rstd_cpu = portable_kernel("npu_rms_norm")(x, gamma, 1e-6)
    assert_close(y.cpu(), y_cpu, op_tolerance(x_dtype), "npu_rms_norm y")
    assert_close(rstd.cpu(), rstd_cpu, "op.norm.rstd", "npu_rms_norm rstd")


@pytest.mark.npu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("cast", [False, True])
def test_npu_add_rms_norm_matches_portable(dtype, cast):
    if cast and dtype == torch.float32:
        pytest.skip("npu_add_rms_norm_cast takes fp16/bf16 only")
    gen = torch.Generator().manual_seed(12)
    x1, x2 = (torch.randn(9, 4096, generator=gen).to(dtype) for _ in range(2))
    gamma = torch.rand(4096, generator=gen).to(dtype)
    name = "npu_add_rms_norm_cast" if cast else "npu_add_rms_norm"
    npu = torch.device("npu")
    got = getattr(torch.ops.npu, name)(x1.to(npu), x2.to(npu), gamma.to(npu), 1e-6)
    want = portable_kernel(name)(x1, x2, gamma, 1e-6)
    # The host may be A2/A3 or 950; the variants are ~1 ulp apart, inside the per-dtype op tolerance.
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert_close(g.cpu(), w, op_tolerance(w.dtype), name)
    assert_bitwise_equal(got[-1].cpu(), want[-1], f"{name} residual sum")
