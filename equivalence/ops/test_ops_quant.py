"""npu_dynamic_quant (spec §8) proven against independent plain math.

Covers: an fp64 reference with the spec's fp32 rounding points and an fp8 rounding written as "nearest value of
the fp8 table, ties to even code, saturate at the max" (independent of PyTorch's cast), int4 packing unpacked
nibble by nibble, shapes/dtypes per mode, max |y| == DTYPE_MAX, de-quantization error bounds, scale vs
amax/DTYPE_MAX within 1 ulp, no NaN from saturation, smooth_scales = 1 == None, group_index == per-group calls,
zero rows, opcheck, torch.compile, errors, and NPU-vs-portable comparisons.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import optimized  # noqa: F401  (registers torch.ops.npu.*)
from equivalence.support.compare import assert_bitwise_equal, assert_close
from equivalence.support.npu_capability import require_dynamic_quant
from optimized.ops.registry import portable_kernel

quant = torch.ops.npu.npu_dynamic_quant
# dst_type -> DTYPE_MAX (spec §8 step 3). quint4x2 is returned packed in int32.
DMAX = {torch.int8: 127.0, torch.quint4x2: 7.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
MODES = ("pertoken", "pertensor", "perchannel")


# --- independent reference ----------------------------------------------------------------------------


def fp8_table(dtype: torch.dtype):
    """All finite values of an fp8 format, ascending, with their 8-bit codes."""
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    values = codes.view(dtype).double()
    finite = values.isfinite()
    values, codes = values[finite], codes[finite].to(torch.int64)
    order = torch.argsort(values, stable=True)
    values, codes = values[order], codes[order]
    keep = torch.ones_like(values, dtype=torch.bool)
    keep[1:] = values[1:] != values[:-1]  # +0 / -0: keep one
    return values[keep], codes[keep]


def fp8_round_saturate(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round to the nearest representable fp8 value, ties to the even code, saturating at +-max (values)."""
    values, codes = fp8_table(dtype)
    q = q.double().clamp(values[0], values[-1])
    hi = torch.searchsorted(values, q.contiguous()).clamp(1, len(values) - 1)
    lo = hi - 1
    d_lo, d_hi = q - values[lo], values[hi] - q
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    return torch.where(pick_hi, values[hi], values[lo])


def reference(x: torch.Tensor, dst: torch.dtype, mode: str, smooth=None, group_index=None):
    """(values of y as float64, scale fp32, q fp32) following spec §8 with fp32 rounding at each step, in fp64."""
    f32 = lambda t: t.float().double()  # noqa: E731  (round an fp64 value to fp32)
    xf = x.double()
    if smooth is not None:
        s = smooth.double()
        if group_index is not None:
            bounds = [0] + group_index.tolist()
            rows = xf.reshape(-1, x.shape[-1]).clone()
            for e in range(len(bounds) - 1):  # loop over groups (few), not tokens
                rows[bounds[e] : bounds[e + 1]] *= s[e]
            xf = rows.reshape(x.shape)
        else:
            xf = xf * (s.unsqueeze(-1) if mode == "perchannel" else s)
        xf = f32(xf)  # the product of two 16-bit floats, rounded to fp32
    dmax = DMAX[dst]
    if mode == "pertoken":
        amax = xf.abs().amax(-1, keepdim=True)
    elif mode == "pertensor":
        amax = xf.abs().max().reshape([1] * x.dim())
    else:
        amax = xf.abs().amax(-2, keepdim=True)
    scale = f32(amax * f32(torch.tensor(1.0 / dmax)))
    q = torch.where(scale > 0, f32(xf / scale), torch.zeros_like(xf))
    if dst in FP8:
        y = fp8_round_saturate(q, dst)
    else:
        lim = (-128.0, 127.0) if dst == torch.int8 else (-8.0, 7.0)
        y = torch.round(q).clamp(*lim)  # torch.round: half to even
    squeeze = {
        "pertoken": lambda t: t.squeeze(-1),
        "pertensor": lambda t: t.reshape(1),
        "perchannel": lambda t: t.squeeze(-2),
    }[mode]
    return y, squeeze(scale).float(), q


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 words -> signed 4-bit values; element j of a word lives in bits [4j, 4j+4)."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=-1)
    signed = torch.where(nibbles >= 8, nibbles - 16, nibbles)
    return signed.reshape(packed.shape[:-1] + (packed.shape[-1] * 8,))


def y_values(y: torch.Tensor, dst: torch.dtype) -> torch.Tensor:
    return unpack_int4(y).double() if dst == torch.quint4x2 else y.double()


def assert_dequant_bound(values: torch.Tensor, scale_b: torch.Tensor, xf: torch.Tensor, dst: torch.dtype) -> None:
    """Spec §8: |f32(y)*scale - x| <= scale * (half a quantization step at y): 1/2 for ints, half the ulp of y's
    binade for fp8; plus the fp32 division's relative error (2^-23 of |x| covers q's rounding)."""
    err = (values * scale_b - xf).abs()
    if dst in FP8:
        mant, emin = (3, -6) if dst == torch.float8_e4m3fn else (2, -14)
        exp = torch.floor(torch.log2(values.abs().clamp_min(2.0**emin)))
        half_step = 2.0 ** (exp - mant) / 2
    else:
        half_step = torch.full_like(values, 0.5)
    bound = scale_b * half_step + xf.abs() * 2.0**-23
    assert torch.all(err <= bound), f"dequantization error exceeds the bound by {(err - bound).max().item()}"


# --- strategies ---------------------------------------------------------------------------------------


@st.composite
def quant_case(draw, modes=MODES, dsts=tuple(DMAX)):
    dst = draw(st.sampled_from(dsts))
    mode = draw(st.sampled_from(modes))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    rank = draw(st.integers(2, 4))
    shape = [draw(st.integers(1, 4)) for _ in range(rank - 2)] + [draw(st.integers(1, 9)), 8 * draw(st.integers(1, 6))]
    if dst != torch.quint4x2 and draw(st.booleans()):
        shape[-1] = draw(st.integers(1, 50))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 300.0]))
    x = torch.randn(shape, generator=gen) * magnitude
    if draw(st.booleans()):  # outliers
        x = x * torch.where(torch.rand(shape, generator=gen) < 0.05, 50.0, 1.0)
    if draw(st.booleans()):  # an all-zero token row (and channel)
        x[..., 0, :] = 0
    x = x.to(dtype)
    if draw(st.booleans()) and rank >= 3:  # non-contiguous input
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    smooth = None
    if draw(st.booleans()):
        n = shape[-2] if mode == "perchannel" else shape[-1]
        smooth = (torch.rand(n, generator=gen) * 2 + 0.1).to(dtype)
    return x, dst, mode, smooth


def run(x, dst, mode, smooth=None, group_index=None):
    return quant(x, smooth_scales=smooth, group_index=group_index, dst_type=dst, quant_mode=mode)


# --- properties ---------------------------------------------------------------------------------------


@given(quant_case())
def test_matches_reference_bitwise(case):
    x, dst, mode, smooth = case
    y, scale = run(x, dst, mode, smooth)
    y_ref, scale_ref, _ = reference(x, dst, mode, smooth)
    assert_bitwise_equal(scale, scale_ref, f"scale ({mode})")
    assert torch.equal(y_values(y, dst), y_ref), f"y differs from the reference ({dst}, {mode})"


@given(quant_case())
def test_shapes_dtypes_bounds(case):
    x, dst, mode, smooth = case
    y, scale = run(x, dst, mode, smooth)
    shape = tuple(x.shape)
    y_dtype = torch.int32 if dst == torch.quint4x2 else dst
    y_shape = shape[:-1] + (shape[-1] // 8,) if dst == torch.quint4x2 else shape
    scale_shape = {"pertoken": shape[:-1], "pertensor": (1,), "perchannel": shape[:-2] + shape[-1:]}[mode]
    assert y.dtype == y_dtype and tuple(y.shape) == y_shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == scale_shape

    values = y_values(y, dst)
    dmax = DMAX[dst]
    axis = {"pertoken": (-1,), "pertensor": tuple(range(x.dim())), "perchannel": (-2,)}[mode]
    scale_b = {"pertoken": scale.unsqueeze(-1), "pertensor": scale, "perchannel": scale.unsqueeze(-2)}[mode].double()
    # rows with amax > 0 reach exactly DTYPE_MAX; all-zero rows give y = 0 and scale 0 (spec: accept 0 or 1)
    row_max = values.abs().amax(axis, keepdim=True)
    assert torch.all(torch.where(scale_b > 0, row_max == dmax, row_max == 0))
    if dst in FP8:
        assert not y.float().isnan().any(), "saturation: no NaN from finite input"
    if smooth is None:  # (with smoothing the same bounds hold for x * smooth; the reference test covers it)
        # scale == amax / DTYPE_MAX within 1 ulp (it is amax * f32(1/DTYPE_MAX))
        exact = (x.double().abs().amax(axis) / dmax).float().reshape(scale.shape)
        assert torch.all((scale.view(torch.int32) - exact.view(torch.int32)).abs() <= 1)
        assert_dequant_bound(values, scale_b, x.double(), dst)


@given(quant_case(modes=("pertoken", "pertensor")))
def test_smooth_scales_of_one_equal_none(case):
    x, dst, mode, _ = case
    ones = torch.ones(x.shape[-1], dtype=x.dtype)
    for a, b in zip(run(x, dst, mode, ones), run(x, dst, mode, None)):
        assert_bitwise_equal(a, b, "smooth_scales = 1")


@given(quant_case(modes=("pertoken",)), st.data())
def test_group_index_equals_per_group_calls(case, data):
    x, dst, _, _ = case
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    e = data.draw(st.integers(1, 5))
    cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=e - 1, max_size=e - 1)))
    group_index = torch.tensor(cuts + [n], dtype=torch.int32)  # non-decreasing, empty groups allowed
    smooth = (torch.rand(e, x.shape[-1]) * 2 + 0.1).to(x.dtype)
    y, scale = run(x, dst, "pertoken", smooth, group_index)
    bounds = [0] + group_index.tolist()
    ys, scales = [], []
    for g in range(e):  # loop over groups
        if bounds[g + 1] > bounds[g]:
            yg, sg = run(rows[bounds[g] : bounds[g + 1]], dst, "pertoken", smooth[g])
            ys.append(yg)
            scales.append(sg)
    assert_bitwise_equal(y.reshape(n, -1), torch.cat(ys), "y == per-group calls")
    assert_bitwise_equal(scale.reshape(n), torch.cat(scales), "scale == per-group calls")
    y_ref, scale_ref, _ = reference(x, dst, "pertoken", smooth, group_index)
    assert_bitwise_equal(scale, scale_ref, "scale vs reference")
    assert torch.equal(y_values(y, dst), y_ref)


@pytest.mark.parametrize(
    "dst,x_exp,smooth_exp,scale_exp,y_max,y_min",
    [
        (torch.float8_e5m2, -133, None, -149, 57344.0, -57344.0),  # q = 2^16 would be inf without the clamp
        (torch.float8_e4m3fn, -126, -14, -149, 448.0, -448.0),  # q = 2^9: NaN without the clamp (spec §8)
        (torch.int8, -126, -14, -147, 127.0, -128.0),  # int8 saturates to [-128, 127]; 128 would wrap to -128
    ],
)
def test_saturation_when_scale_underflows(dst, x_exp, smooth_exp, scale_exp, y_max, y_min):
    # A tiny amax makes scale an fp32 subnormal rounded far from amax/DTYPE_MAX, so q = x/scale exceeds
    # DTYPE_MAX; the clamp before the cast (spec §8 step 5) saturates it.
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    x[0, 1] = 2.0**x_exp
    x[0, 2] = -(2.0**x_exp)
    smooth = None if smooth_exp is None else torch.full((8,), 2.0**smooth_exp, dtype=torch.bfloat16)
    y, scale = quant(x, smooth_scales=smooth, dst_type=dst)
    assert scale[0].item() == 2.0**scale_exp and scale[1].item() == 0.0
    assert y[0].float().tolist() == [0.0, y_max, y_min] + [0.0] * 5
    y_ref, scale_ref, q = reference(x, dst, "pertoken", smooth)
    assert q.abs().max().item() > y_max
    assert torch.equal(y.double(), y_ref) and torch.equal(scale, scale_ref)


def test_reference_fp8_rounding_saturates():
    # PyTorch's bare casts do not saturate everywhere: fp32 -> e5m2 overflows to inf (and, per spec §8, e4m3fn
    # to NaN on some builds; this CPU build happens to saturate e4m3fn), fp32 -> int8 wraps.
    assert torch.tensor([61440.0]).to(torch.float8_e5m2).float().isinf().all()
    assert torch.tensor([128.0]).to(torch.int8).item() == -128
    assert fp8_round_saturate(torch.tensor([61440.0, -1e6]), torch.float8_e5m2).tolist() == [57344.0, -57344.0]
    q = torch.tensor([448.0, 460.0, 470.0, -1000.0, 0.0146484375, 17.0, 19.0])
    # ties to even code: 15 * 2^-10 is halfway between the subnormal 7 * 2^-9 (code 7) and 2^-6 (code 8) -> 2^-6;
    # 17 is halfway between 16 (code 0x58) and 18 (0x59) -> 16; 19 -> 20 (0x5A)
    want = [448.0, 448.0, 448.0, -448.0, 0.015625, 16.0, 20.0]
    assert fp8_round_saturate(q, torch.float8_e4m3fn).tolist() == want
    assert q.clamp(-448, 448).to(torch.float8_e4m3fn).float().tolist() == want  # the kernel's clamp + cast


def test_int4_packing_layout():
    # q = [1, -2, 3, -4, 5, -6, 7, 0]: element 2k in the low nibble of byte k, little-endian int32.
    x = torch.tensor([[1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0, 0.0]], dtype=torch.bfloat16)
    y, scale = quant(x, dst_type=torch.quint4x2)
    assert y.dtype == torch.int32 and y.shape == (1, 1)
    assert scale.item() == pytest.approx(1.0, rel=1e-6)
    assert y.view(torch.uint8).tolist() == [[0xE1, 0xC3, 0xA5, 0x07]]
    assert unpack_int4(y).tolist() == [[1, -2, 3, -4, 5, -6, 7, 0]]


def test_zero_rows_and_dtype_codes():
    x = torch.zeros(3, 16, dtype=torch.float16)
    x[1, 3] = 2.0
    y, scale = quant(x, dst_type=24)  # the int code the dispatcher passes for float8_e4m3fn
    assert scale.tolist() == [0.0, pytest.approx(2.0 / 448, rel=1e-6), 0.0]
    assert torch.equal(y[0].float(), torch.zeros(16)) and torch.equal(y[2].float(), torch.zeros(16))
    assert y[1, 3].float().item() == 448.0
    for alias, code in ((292, torch.float8_e4m3fn), (291, torch.float8_e5m2), (1, torch.int8)):
        for a, b in zip(quant(x, dst_type=alias), quant(x, dst_type=code)):
            assert_bitwise_equal(a, b, f"dst_type={alias}")
    for a, b in zip(quant(x), quant(x, dst_type=torch.int8)):  # None -> int8
        assert_bitwise_equal(a, b, "default dst_type")


def test_qwen3_fp8_kv_call():
    # (T, Nkv_r*128) bf16 -> y (T, Nkv_r*128) float8_e4m3fn, one scale per token shared by all heads.
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(7, 2 * 128, generator=gen).bfloat16()
    y, scale = quant(k, dst_type=torch.float8_e4m3fn, quant_mode="pertoken")
    assert y.shape == (7, 256) and y.dtype == torch.float8_e4m3fn and scale.shape == (7,)
    assert_dequant_bound(y.double(), scale.unsqueeze(-1).double(), k.double(), torch.float8_e4m3fn)


# --- registration: opcheck, torch.compile ---------------------------------------------------------------


def _samples():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 16, generator=gen).bfloat16()
    return [
        ((x,), {}),
        ((x,), {"dst_type": 24, "quant_mode": "pertoken"}),
        (
            (x.half().reshape(2, 3, 16),),
            {"dst_type": 16, "quant_mode": "pertensor", "smooth_scales": torch.rand(16, generator=gen).half()},
        ),
        ((x.t(),), {"dst_type": 23, "quant_mode": "perchannel"}),  # non-contiguous
        (
            (x,),
            {
                "smooth_scales": torch.rand(2, 16, generator=gen).bfloat16(),
                "group_index": torch.tensor([2, 6], dtype=torch.int32),
            },
        ),
    ]


@pytest.mark.parametrize("index", range(5))
def test_opcheck(index):
    args, kwargs = _samples()[index]
    torch.library.opcheck(quant.default, args, kwargs)


def test_torch_compile_fullgraph_matches_eager():
    def step(k, smooth, group_index):
        y8, s8 = torch.ops.npu.npu_dynamic_quant(k, dst_type=torch.float8_e4m3fn)
        y4, s4 = torch.ops.npu.npu_dynamic_quant(k, dst_type=torch.quint4x2, quant_mode="pertensor")
        yg, sg = torch.ops.npu.npu_dynamic_quant(k, smooth_scales=smooth, group_index=group_index)
        return y8, s8, y4, s4, yg, sg

    gen = torch.Generator().manual_seed(6)
    args = (
        torch.randn(6, 16, generator=gen).bfloat16(),
        torch.rand(2, 16, generator=gen).bfloat16(),
        torch.tensor([2, 6], dtype=torch.int32),
    )
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(*args), step(*args)):
        assert_bitwise_equal(got, want, "compiled vs eager")


# --- errors -------------------------------------------------------------------------------------------


def test_errors_name_op_and_argument():
    op = "npu_dynamic_quant"
    x = torch.randn(4, 16).bfloat16()
    with pytest.raises(ValueError, match=rf"{op}: input must have 2 to 8 dims .*got shape \(16,\)"):
        quant(x[0])
    with pytest.raises(ValueError, match=rf"{op}: input has dtype torch.float32; allowed"):
        quant(x.float())
    with pytest.raises(ValueError, match=rf"{op}: dst_type=3 not supported; allowed codes"):
        quant(x, dst_type=torch.int32)
    with pytest.raises(NotImplementedError, match=rf"{op}: dst_type=290 \(hifloat8\) not supported by the portable"):
        quant(x, dst_type=290)
    with pytest.raises(NotImplementedError, match=rf"{op}: dst_type_max=100.0"):
        quant(x, dst_type_max=100.0)
    with pytest.raises(ValueError, match=rf"{op}: quant_mode must be one of .*got 'perblock'"):
        quant(x, quant_mode="perblock")
    with pytest.raises(ValueError, match=rf"{op}: dst_type quint4x2 needs input.shape\[-1\] % 8 == 0; got 12"):
        quant(x[:, :12], dst_type=torch.quint4x2)
    with pytest.raises(ValueError, match=rf"{op}: smooth_scales has shape \(4,\); expected \(16,\) for pertoken"):
        quant(x, smooth_scales=torch.ones(4).bfloat16())
    with pytest.raises(ValueError, match=rf"{op}: smooth_scales has dtype torch.float16; expected input.dtype"):
        quant(x, smooth_scales=torch.ones(16).half())
    gi = torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"{op}: group_index needs quant_mode 'pertoken'; got 'pertensor'"):
        quant(x, smooth_scales=torch.ones(2, 16).bfloat16(), group_index=gi, quant_mode="pertensor")
    with pytest.raises(ValueError, match=rf"{op}: group_index needs smooth_scales"):
        quant(x, group_index=gi)
    with pytest.raises(ValueError, match=rf"{op}: smooth_scales has shape \(16,\); expected \(E, H\) = \(2, 16\)"):
        quant(x, smooth_scales=torch.ones(16).bfloat16(), group_index=gi)
    with pytest.raises(ValueError, match=rf"{op}: group_index must be non-decreasing, .* row count 4; got \[3, 1\]"):
        quant(x, smooth_scales=torch.ones(2, 16).bfloat16(), group_index=torch.tensor([3, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=rf"{op}: group_index must be .* row count 4; got \[1, 3\]"):
        quant(x, smooth_scales=torch.ones(2, 16).bfloat16(), group_index=torch.tensor([1, 3], dtype=torch.int32))


# --- NPU vs portable ----------------------------------------------------------------------------------


@pytest.mark.npu
@pytest.mark.parametrize("dst", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.quint4x2])
@pytest.mark.parametrize("mode", MODES)
def test_npu_matches_portable(dst, mode):
    gen = torch.Generator().manual_seed(15)
    x = (torch.randn(33, 2 * 128, generator=gen) * 3).bfloat16()
    x[5] = 0
    npu = torch.device("npu")
    require_dynamic_quant(dst, mode)  # the device's declaration, before the call: a kernel error fails the test
    y, scale = torch.ops.npu.npu_dynamic_quant(x.to(npu), dst_type=dst, quant_mode=mode)
    y_cpu, scale_cpu = portable_kernel("npu_dynamic_quant")(x, dst_type=dst, quant_mode=mode)
    assert y.dtype == y_cpu.dtype and y.shape == y_cpu.shape and scale.shape == scale_cpu.shape
    scale = scale.cpu()
    live = scale_cpu > 0
    # scale: amax * f32(1/DTYPE_MAX) in fp32 on both sides (1 ulp if the NPU divides instead)
    assert_close(scale[live], scale_cpu[live], "op.float32", "scale")
    assert torch.all((scale[~live] == 0) | (scale[~live] == 1)), "all-zero rows: scale 0 (or 1)"
    # y: the same fp32 q rounded by the same rule; rows that are all zero are unspecified on the NPU
    a, b = y_values(y.cpu(), dst), y_values(y_cpu, dst)
    if mode == "pertoken":
        a, b = a[live], b[live]
    assert torch.equal(a, b), f"{int((a != b).sum())} quantized values differ"
