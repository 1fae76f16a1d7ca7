"""MX quantization operators (spec mx_quant.md) proven against an independent quantizer.

`equivalence/ops/mx_oracle.py` re-derives every rule in float64 numpy with ml_dtypes element casts and brute-force
FP4 rounding; the kernels are compared with it byte for byte on adversarial inputs (raw bit patterns, ties,
mantissa 1.5/1.75 boundaries, tiny/flush, zero, Inf/NaN and huge blocks, K not a multiple of 32/64, every
dst_type, scale_alg and round mode). The spec's worked examples (§10) are fixed golden vectors. Also: error
bounds of dequantize(quantize(x)), decode and idempotence, fused norm / SwiGLU + quantize == the unfused ops
bitwise, MX matmuls (npu_quant_matmul, npu_grouped_matmul) == dequantize then an fp32 matmul within the
summation error bound, the converter's quantizer (§8.2), shapes under fake tensors, opcheck, torch.compile,
named validation errors, and NPU-vs-portable comparisons.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import optimized  # noqa: F401  (registers torch.ops.npu.*)
from equivalence.ops import mx_oracle as oracle
from equivalence.support.compare import assert_bitwise_equal
from equivalence.support.mx_decode import (
    _decoded_close_within_one_step,
    bytes_of,
)
from equivalence.support.npu_capability import require_950
from optimized.ops import mx_format as mxf
from optimized.ops.registry import portable_kernel

npu = torch.ops.npu
QUANT = npu.npu_dynamic_mx_quant
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
E4M3, E5M2, FP4 = 24, 23, 296

# Every legal (dst_type, scale_alg, round_mode, dst_type_max, max_low_bound) of §3.4 the kernels implement.
CONFIGS = [
    (E4M3, 0, "rint", 0.0, 0.0),
    (E5M2, 0, "rint", 0.0, 0.0),
    (292, 1, "rint", 0.0, 0.0),
    (291, 1, "rint", 0.0, 0.0),
    (E4M3, 1, "rint", 0.0, 1e-3),
    (E5M2, 1, "rint", 0.0, 2.0**-120),
    (FP4, 0, "rint", 0.0, 0.0),
    (FP4, 0, "round", 0.0, 0.0),
    (FP4, 0, "floor", 0.0, 0.0),
    (FP4, 2, "rint", 0.0, 0.0),
    (FP4, 2, "round", 6.0, 0.0),
    (FP4, 2, "floor", 7.0, 0.0),
    (FP4, 2, "rint", 7.0, 0.0),
    (FP4, 2, "rint", 9.5, 0.0),
    (FP4, 2, "floor", 12.0, 0.0),
]


def quant(x, dst, alg=0, rm="rint", dtm=0.0, mlb=0.0, axis=-1, block_size=32):
    return QUANT(
        x,
        axis=axis,
        round_mode=rm,
        dst_type=dst,
        block_size=block_size,
        scale_alg=alg,
        dst_type_max=dtm,
        max_low_bound=mlb,
    )


def assert_matches_oracle(x, dst, alg=0, rm="rint", dtm=0.0, mlb=0.0, axis=-1, block_size=32):
    y, s = quant(x, dst, alg, rm, dtm, mlb, axis, block_size)
    y_ref, s_ref = oracle.quantize(
        x, dst, axis=axis, round_mode=rm, scale_alg=alg, block_size=block_size, dst_type_max=dtm, max_low_bound=mlb
    )
    label = f"dst={dst} alg={alg} {rm} dtm={dtm} mlb={mlb} axis={axis} bs={block_size} x{tuple(x.shape)} {x.dtype}"
    assert s.dtype == torch.uint8, label
    np.testing.assert_array_equal(s.numpy(), s_ref, err_msg=f"scale bytes: {label}")
    assert y.dtype == (torch.uint8 if dst == FP4 else mxf.FORMATS[mxf.dtype_code(dst)].torch_dtype), label
    np.testing.assert_array_equal(bytes_of(y), y_ref, err_msg=f"element bytes: {label}")
    return y, s


# --- bit-exact against the independent quantizer --------------------------------------------------------


@st.composite
def quant_cases(draw):
    dst, alg, rm, dtm, mlb = draw(st.sampled_from(CONFIGS))
    dtype = draw(st.sampled_from([BF16, FP16, FP32]))
    k = draw(st.one_of(st.integers(1, 130), st.sampled_from([31, 33, 63, 65, 96, 160, 4096])))
    if dst == FP4 and k % 2:
        k += 1
    lead = draw(st.lists(st.integers(1, 3), max_size=2))
    shape = lead + [k]
    axis = draw(st.sampled_from(range(-len(shape), len(shape)))) if draw(st.booleans()) else -1
    block_size = 32 if dtype == FP32 or alg == 2 else draw(st.sampled_from([32, 32, 64, 96]))
    kinds = draw(st.sampled_from([oracle.BLOCK_KINDS, ("gauss", "ties"), ("boundary", "tiny", "zero", "special")]))
    x = oracle.mx_inputs(draw(st.integers(0, 2**31 - 1)), shape, dtype, kinds)
    return x, dict(dst=dst, alg=alg, rm=rm, dtm=dtm, mlb=mlb, axis=axis, block_size=block_size)


@given(quant_cases())
def test_quantize_matches_independent_quantizer(case):
    x, kw = case
    assert_matches_oracle(x, **kw)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-alg{c[1]}-{c[2]}-dtm{c[3]}-mlb{c[4]:g}")
def test_every_config_and_dtype_matches_on_all_block_kinds(config):
    # A guaranteed sweep (hypothesis draws only 20 cases in CI): each legal configuration x input dtype, on
    # rows whose 128 blocks cover every adversarial block kind.
    dst, alg, rm, dtm, mlb = config
    for i, dtype in enumerate((BF16, FP16, FP32)):
        x = oracle.mx_inputs(100 + i, (3, 4096 + 34), dtype)  # 130 blocks: odd count, padded tail
        assert_matches_oracle(x, dst, alg, rm, dtm, mlb)


def test_non_last_axis_scale_layout_interleaves_the_pair():
    # x [P, D, Q] along axis 1 -> scale [P, ceil(D/64), Q, 2]; scale[p, i, q, j] is block 2i+j of column (p, q),
    # i.e. exactly the last-axis quantization of the transposed tensor with the pair dim moved (§2.2).
    x = oracle.mx_inputs(7, (2, 100, 6), BF16)
    y, s = assert_matches_oracle(x, E4M3, axis=1)
    assert s.shape == (2, 2, 6, 2)
    yt, st_ = quant(x.transpose(1, 2).contiguous(), E4M3)
    assert_bitwise_equal(y, yt.transpose(1, 2).contiguous(), "y along axis 1")
    assert_bitwise_equal(s, st_.permute(0, 2, 1, 3).contiguous(), "scale along axis 1")
    # FP4 along axis 0 still packs the LAST dim
    x4 = oracle.mx_inputs(8, (70, 4), BF16)
    y4, s4 = assert_matches_oracle(x4, FP4, axis=0)
    assert y4.shape == (70, 2) and s4.shape == (2, 4, 2)


def test_fp4_brute_force_rint_agrees_with_ml_dtypes():
    # The oracle's two FP4 encoders cross-check each other on every tie and both sides of each threshold.
    grid = np.array(sorted({t + d for t in np.arange(0, 8, 0.125) for d in (-(2**-20), 0.0, 2**-20)}))
    v = np.concatenate([grid, -grid, [-0.0, 7.0, -9.0]])
    lib = np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    np.testing.assert_array_equal(oracle.fp4_brute_force(v, "rint"), lib)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_brute_force_agrees_with_ml_dtypes(fmt):
    # The oracle's FP8 path (clamp, then the ml_dtypes cast) against exhaustive search over all 256 codes:
    # nearest finite value, ties to the even code, saturating; every midpoint and both its neighbours.
    np_type, maxval = oracle.FORMATS[fmt][2], oracle.FORMATS[fmt][1]
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(np_type).astype(np.float64)
    keep = np.isfinite(values) & ~((values == 0) & (codes != 0))
    table, table_codes = values[keep], codes[keep]
    order = np.argsort(table)
    table, table_codes = table[order], table_codes[order]
    mids = (table[1:] + table[:-1]) / 2
    v = np.concatenate([table, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), [1e9, -1e9]])
    dist = np.abs(np.clip(v, -maxval, maxval)[:, None] - table[None, :])
    best = dist == dist.min(1, keepdims=True)
    even = best & (table_codes[None, :] % 2 == 0)
    pick = np.where(even.any(1), np.argmax(even, 1), np.argmax(best, 1))
    want = table[pick]
    got = np.clip(v, -maxval, maxval).astype(np_type).astype(np.float64)
    np.testing.assert_array_equal(got, want)


# --- golden vectors (§10) -------------------------------------------------------------------------------

BLOCK_10_1 = [
    0x4049,
    0xBFC0,
    0x0000,
    0x3F40,
    0xBEC0,
    0x4000,
    0x3DCD,
    0xBD4D,
    0x3FA0,
    0xC030,
    0x3F30,
    0x3C80,
    0xBB00,
    0x3E9A,
    0x3F66,
    0xBF66,
    0x3F80,
    0xBF80,
    0x3F00,
    0xBF00,
    0x3E80,
    0x4020,
    0xC040,
    0x3E00,
    0x3FE0,
    0xBF20,
    0x3D80,
    0x3E4D,
    0xBC24,
    0x3EE0,
    0x4010,
    0xBF90,
]


def bf16_from_bits(bits) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(BF16)


def hexbytes(s: str) -> list[int]:
    return [int(b, 16) for b in s.split()]


def fp4_codes(y: torch.Tensor) -> list[int]:
    return mxf.unpack_fp4(y).flatten().tolist()


def test_golden_10_1_block_to_e4m3():
    x = bf16_from_bits(BLOCK_10_1)[None]
    assert x[0, :3].tolist() == [3.140625, -1.5, 0.0]
    want = hexbytes("7D F4 00 6C E4 78 55 CD 72 FB 6B 40 A8 62 6E EE 70 F0 68 E8 60 7A FC 58 76 EA 50 5D BA 66 79 F1")
    for alg in (0, 1):
        y, s = quant(x, E4M3, alg)
        assert y.dtype == torch.float8_e4m3fn and y.view(torch.uint8)[0].tolist() == want
        assert s.tolist() == [[[120, 0]]]


def test_golden_10_2_block_to_e2m1_all_round_modes():
    x = bf16_from_bits(BLOCK_10_1)[None]
    rint = [int(c, 16) for c in "7 D 0 3 A 6 0 8 4 F 3 0 8 1 4 C 4 C 2 A 1 6 F 0 6 A 0 1 8 2 6 C".split()]
    y, s = quant(x, FP4, 0, "rint")
    assert s.tolist() == [[[126, 0]]] and y.shape == (1, 16)
    assert y[0].tolist() == hexbytes("D7 30 6A 80 F4 03 18 C4 C4 A2 61 0F A6 10 28 C6")
    assert fp4_codes(y) == rint
    round_ = list(rint)
    round_[8], round_[21], round_[23], round_[25] = 0x5, 0x7, 0x1, 0xB
    assert fp4_codes(quant(x, FP4, 0, "round")[0]) == round_
    floor = [int(c, 16) for c in "7 D 0 3 A 6 0 9 4 F 2 0 9 1 3 C 4 C 2 A 1 6 F 0 5 B 0 0 9 1 6 D".split()]
    assert fp4_codes(quant(x, FP4, 0, "floor")[0]) == floor


def test_golden_10_3_scale_rules_disagree():
    x = torch.zeros(1, 32, dtype=BF16)
    x[0, :3] = torch.tensor([3.75, 1.0, -0.5])
    rows = [  # (dst, alg, dtm, byte, first element bytes / codes, decoded)
        (E4M3, 0, 0.0, 120, [0x7E, 0x70, 0xE8], [3.5, 1.0, -0.5]),
        (E4M3, 1, 0.0, 121, [0x77, 0x68, 0xE0], [3.75, 1.0, -0.5]),
        (FP4, 0, 0.0, 126, [0x7, 0x4, 0xA], [3.0, 1.0, -0.5]),
        (FP4, 2, 0.0, 127, [0x6, 0x2, 0x9], [4.0, 1.0, -0.5]),
        (FP4, 2, 6.0, 127, [0x6, 0x2, 0x9], [4.0, 1.0, -0.5]),
    ]
    for dst, alg, dtm, byte, first, decoded in rows:
        y, s = quant(x, dst, alg, dtm=dtm)
        assert s.tolist() == [[[byte, 0]]], (dst, alg)
        got = fp4_codes(y)[:3] if dst == FP4 else y.view(torch.uint8)[0, :3].tolist()
        assert got == first, (dst, alg)
        fmt = mxf.FORMATS[dst]
        assert mxf.dequantize(y, s, fmt)[0, :3].tolist() == decoded
    # the converter (§8.2): E4M3 = scale_alg 1, E2M1 = scale_alg 2 with dst_type_max 7, half-away ties
    data, scale = mxf.mx_quantize_weight(x, mxf.E4M3)
    assert scale.tolist() == [[121]] and data.view(torch.uint8)[0, :3].tolist() == [0x77, 0x68, 0xE0]
    data, scale = mxf.mx_quantize_weight(x, mxf.E2M1)
    assert scale.tolist() == [[127]] and fp4_codes(data)[:3] == [0x6, 0x2, 0x9]
    # scale_alg 2 on other amax values
    for amax, dtm, byte in ((3.0, 0.0, 126), (3.25, 0.0, 127), (3.5, 6.0, 127), (3.5, 7.0, 126)):
        xa = torch.zeros(1, 32, dtype=BF16)
        xa[0, 5] = amax
        assert quant(xa, FP4, 2, dtm=dtm)[1].tolist() == [[[byte, 0]]], (amax, dtm)


def test_golden_10_4_padding_and_pairing():
    x = (torch.arange(80, dtype=torch.float32) / 8).to(BF16)[None]
    y8, s8 = quant(x, E4M3)
    assert y8.shape == (1, 80) and s8.tolist() == [[[120, 121], [122, 0]]]
    y4, s4 = quant(x, FP4)
    assert y4.shape == (1, 40) and s4.tolist() == [[[126, 127], [128, 0]]]
    y, s = quant(torch.ones(1, 16, dtype=BF16), FP4)
    assert y.tolist() == [[0x66] * 8] and s.tolist() == [[[125, 0]]]
    _, s96 = quant(torch.ones(3, 96, dtype=BF16), E4M3)
    assert s96.shape == (3, 2, 2) and s96[:, 1, 1].tolist() == [0, 0, 0]


def test_golden_10_5_special_blocks():
    x = torch.zeros(4, 32, dtype=BF16)
    x[1] = 1.0
    x[1, 7] = float("inf")
    x[2] = -2.0
    x[2, 3] = float("nan")
    x[3, 0] = bf16_from_bits([0x0010])[0]  # 2^-129
    x[3, 1] = -bf16_from_bits([0x0010])[0]
    for dst in (E4M3, E5M2, FP4):
        y, s = quant(x, dst)
        assert s[:, 0, 0].tolist() == [0, 255, 255, 0], dst
        assert (y.view(torch.uint8)[:3] == 0).all(), f"zero and non-finite blocks: elements +0 ({dst})"
        first = [0x80] if dst == FP4 else [0x00, 0x80]  # flushed to zeros that keep their sign
        assert y.view(torch.uint8)[3].tolist()[: len(first)] == first, dst
    # tiny block: scale_alg 0 flushes; scale_alg 1 encodes with 2^127 (0.25 = E4M3 0x28)
    y0, s0 = quant(x[3:], E4M3, 0)
    y1, s1 = quant(x[3:], E4M3, 1)
    assert s0.tolist() == [[[0, 0]]] and y0.view(torch.uint8)[0, :2].tolist() == [0x00, 0x80]
    assert s1.tolist() == [[[0, 0]]] and y1.view(torch.uint8)[0, :2].tolist() == [0x28, 0xA8]
    assert mxf.dequantize(y1, s1, mxf.E4M3)[0, :2].tolist() == [2.0**-129, -(2.0**-129)]


def test_floor_mode_sees_the_fp32_scaled_value():
    # Elements are scaled in fp32 (§4.1). A negative element whose scaled value underflows fp32 becomes -0 and
    # floors to -0 (0x8); one that stays an fp32 subnormal floors to -0.5 (0x9). Other modes round both to -0.
    x = torch.zeros(1, 32, dtype=BF16)
    x[0, 0] = 2.0**100  # byte 100 + 127 - 2 = 225: scaled by 2^-98
    x[0, 2] = -(2.0**-60)  # -2^-158: below fp32's smallest subnormal 2^-149 -> -0.0
    x[0, 3] = -(2.0**-40)  # -2^-138: an fp32 subnormal
    y, s = quant(x, FP4, 0, "floor")
    assert s.tolist() == [[[225, 0]]] and fp4_codes(y)[:4] == [0x6, 0x0, 0x8, 0x9]
    assert fp4_codes(quant(x, FP4, 0, "rint")[0])[:4] == [0x6, 0x0, 0x8, 0x8]


def test_dtype_codes_as_int_enums_and_torch_dtypes():
    # torch_npu's dtype constants may be IntEnum-like (§13.9); torch dtypes arrive as their ScalarType numbers
    import enum

    class Codes(enum.IntEnum):
        FP4 = 296
        E4M3 = 292

    x = oracle.mx_inputs(5, (2, 64), BF16, kinds=("gauss",))
    for a, b in ((quant(x, Codes.FP4), quant(x, 296)), (quant(x, Codes.E4M3), quant(x, torch.float8_e4m3fn))):
        for got, want in zip(a, b):
            assert_bitwise_equal(got, want, "dtype code spellings")


# --- error bounds (§11.5) and idempotence -------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-alg{c[1]}-{c[2]}-dtm{c[3]}-mlb{c[4]:g}")
def test_dequantize_error_bound(config):
    # |dequant - x| <= 1/2 ulp_elem(v) * scale (rint, round) or 1 ulp (floor) for unsaturated elements of
    # finite, non-flushed blocks; saturation (|v| > maxval) only where the scale rule allows it.
    dst, alg, rm, dtm, mlb = config
    fmt = oracle.fmt_name(dst)
    x = oracle.mx_inputs(11, (4, 4096), BF16, kinds=("gauss", "ties", "boundary", "huge"))
    y, s = quant(x, dst, alg, rm, dtm, mlb)
    byte = s.flatten(-2)[:, : 4096 // 32].numpy().astype(np.int64).repeat(32, axis=1)
    dq = oracle.dequantize(bytes_of(y), s.numpy(), fmt)
    xd = x.double().numpy()
    scale = np.ldexp(1.0, byte - 127)
    v = xd / scale
    live = (byte > 0) & (byte < 255)
    maxval = oracle.FORMATS[fmt][1]
    saturated = np.abs(v) > maxval
    if alg == 1 or (alg == 2 and dtm not in (7.0,) and dtm <= 6.0):
        assert not saturated[live].any(), "this scale rule never saturates"
    ok = live & ~saturated
    ulps = np.abs(dq - xd)[ok] / (oracle.element_ulp(v, fmt) * scale)[ok]
    assert ulps.max() <= (1.0 if rm == "floor" else 0.5)
    assert np.all(np.abs(dq[live & saturated]) == maxval * scale[live & saturated])


# --- npu_anti_mx_quant (§6.7) ---------------------------------------------------------------------------

ANTI = npu.npu_anti_mx_quant


@given(quant_cases(), st.sampled_from([(6, FP32), (15, BF16), (5, FP16), (None, BF16)]))
def test_anti_quant_equals_independent_decode(case, out):
    # fp32 decode is exact, so the result is the float64 value rounded once to dst_type (NaN for 0xFF blocks)
    x, kw = case
    if kw["block_size"] != 32:
        kw["block_size"] = 32
    y, s = quant(x, **kw)
    dst_code, out_dtype = out
    src = kw["dst"]
    got = ANTI(y, s, axis=kw["axis"], dst_type=dst_code, src_type=src)
    want = oracle.dequantize(bytes_of(y), s.numpy(), oracle.fmt_name(src), axis=kw["axis"])
    assert_bitwise_equal(got, torch.from_numpy(want).to(out_dtype), "anti_mx_quant vs float64 decode")


@given(quant_cases())
def test_quantize_is_idempotent_through_decode(case):
    # quant(dequant(quant(x))) == quant(x): the decoded block's amax has the same exponent (§11.4)
    x, kw = case
    kw.update(alg=0, rm="rint", dtm=0.0, mlb=0.0, block_size=32)
    if kw["dst"] == FP4 and x.shape[-1] % 2:
        return
    y, s = quant(x, **kw)
    again = quant(ANTI(y, s, axis=kw["axis"], dst_type=6, src_type=kw["dst"]), **kw)
    assert_bitwise_equal(again[1], s, "scale after a round trip")
    assert_bitwise_equal(again[0], y, "elements after a round trip")


def test_anti_quant_accepts_e8m0_storage_and_pins_nan_blocks():
    x = torch.ones(2, 64, dtype=BF16)
    x[1, 40] = float("nan")
    y, s = quant(x, E4M3)
    a = ANTI(y, s, dst_type=6)
    b = ANTI(y, s.view(torch.float8_e8m0fnu), dst_type=torch.float32)
    assert_bitwise_equal(a, b, "uint8 vs float8_e8m0fnu scale storage")
    assert a[0].tolist() == [1.0] * 64 and a[1, :32].tolist() == [1.0] * 32 and a[1, 32:].isnan().all()


ANTI_ERRORS = {
    "src_mismatch": (
        lambda: ANTI(torch.zeros(2, 32, dtype=torch.float8_e5m2), torch.zeros(2, 1, 2, dtype=torch.uint8)),
        ValueError,
        r"npu_anti_mx_quant: x has dtype torch.float8_e5m2; src_type=292 needs",
    ),
    "src_code": (
        lambda: ANTI(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 1, 2, dtype=torch.uint8), src_type=290),
        ValueError,
        r"src_type=290 is not an MX element type; allowed codes",
    ),
    "fp4_dtype": (
        lambda: ANTI(torch.zeros(2, 32, dtype=torch.int8), torch.zeros(2, 1, 2, dtype=torch.uint8), src_type=296),
        ValueError,
        r"x has dtype torch.int8; allowed: torch.uint8",
    ),
    "scale_shape": (
        lambda: ANTI(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, 2, dtype=torch.uint8), src_type=296),
        ValueError,
        r"mxscale has shape \(2, 2, 2\); expected \(2, 1, 2\) for x of logical shape \(2, 32\)",
    ),
    "scale_dtype": (
        lambda: ANTI(torch.zeros(2, 32, dtype=torch.float8_e4m3fn), torch.zeros(2, 1, 2)),
        ValueError,
        r"mxscale has dtype torch.float32; allowed: torch.uint8, torch.float8_e8m0fnu",
    ),
    "dst": (
        lambda: ANTI(
            torch.zeros(2, 32, dtype=torch.float8_e4m3fn), torch.zeros(2, 1, 2, dtype=torch.uint8), dst_type=1
        ),
        ValueError,
        r"dst_type=1 is not allowed; allowed codes: 15 \(bfloat16\)",
    ),
    "axis": (
        lambda: ANTI(torch.zeros(2, 32, dtype=torch.float8_e4m3fn), torch.zeros(2, 1, 2, dtype=torch.uint8), axis=-3),
        ValueError,
        r"axis=-3 is out of range",
    ),
}


@pytest.mark.parametrize("name", sorted(ANTI_ERRORS))
def test_invalid_anti_quant_arguments_raise_naming_op_and_argument(name):
    call, error, match = ANTI_ERRORS[name]
    with pytest.raises(error, match=match):
        call()


# --- fused norm + quantize (§6.2, §6.3) == norm, then quantize, bitwise -----------------------------------

RMS_Q = npu.npu_rms_norm_dynamic_mx_quant
ADD_RMS_Q = npu.npu_add_rms_norm_dynamic_mx_quant
FUSED_CONFIGS = [(E4M3, 0, "rint"), (E5M2, 1, "rint"), (FP4, 0, "rint"), (FP4, 0, "round"), (FP4, 0, "floor")]


@st.composite
def norm_cases(draw):
    dst, alg, rm = draw(st.sampled_from(FUSED_CONFIGS))
    dtype = draw(st.sampled_from([BF16, FP16]))
    k = 2 * draw(st.integers(1, 80))
    lead = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 50.0]))
    x1 = (torch.randn(lead + [k], generator=g) * magnitude).to(dtype)
    x2 = (torch.randn(lead + [k], generator=g) * magnitude).to(dtype)
    if draw(st.booleans()):
        x1[..., 0, :] = 0  # an all-zero row: rstd = 1/sqrt(eps), blocks of zeros
    gamma_dims = draw(st.sampled_from([1, 2])) if len(lead) >= 1 and draw(st.booleans()) else 1
    gshape = (lead + [k])[-gamma_dims:]
    gamma = (torch.rand(gshape, generator=g) * 2).to(draw(st.sampled_from([dtype, FP32])))
    beta = (torch.randn(gshape, generator=g)).to(gamma.dtype) if draw(st.booleans()) else None
    eps = draw(st.sampled_from([1e-6, 1e-5]))
    return x1, x2, gamma, beta, eps, dict(dst_type=dst, scale_alg=alg, round_mode=rm)


def _norm_then_quant(s_f32, dtype, gamma, beta, eps, kw):
    dims = tuple(range(-gamma.dim(), 0))
    rstd = 1.0 / torch.sqrt(s_f32.square().mean(dims, keepdim=True) + eps)
    t = s_f32 * rstd * gamma.float()
    if beta is not None:
        t = t + beta.float()
    return QUANT(t.to(dtype), **kw), rstd


@given(norm_cases())
def test_rms_norm_mx_quant_equals_norm_then_quant(case):
    x, _, gamma, beta, eps, kw = case
    y, scale, rstd = RMS_Q(x, gamma, beta=beta, epsilon=eps, **kw)
    (y_ref, scale_ref), rstd_ref = _norm_then_quant(x.float(), x.dtype, gamma, beta, eps, kw)
    assert_bitwise_equal(y, y_ref, "y")
    assert_bitwise_equal(scale, scale_ref, "mxscale")
    assert_bitwise_equal(rstd, rstd_ref, "rstd")
    if beta is None and gamma.dtype in (x.dtype, FP32):  # the same as the plain npu_rms_norm op, then quantize
        normed, rstd_op = npu.npu_rms_norm(x, gamma, eps)
        for a, b in zip((y, scale, rstd), (*QUANT(normed, **kw), rstd_op)):
            assert_bitwise_equal(a, b, "npu_rms_norm then npu_dynamic_mx_quant")


@given(case=norm_cases())
def test_add_rms_norm_mx_quant_equals_add_norm_then_quant(monkeypatch_950, case):
    x1, x2, gamma, beta, eps, kw = case
    y, x_out, scale, rstd = ADD_RMS_Q(x1, x2, gamma, beta=beta, epsilon=eps, **kw)
    s = x1.float() + x2.float()  # the norm reads the fp32 sum, not the rounded residual
    (y_ref, scale_ref), rstd_ref = _norm_then_quant(s, x1.dtype, gamma, beta, eps, kw)
    assert_bitwise_equal(x_out, s.to(x1.dtype), "x_out")
    assert_bitwise_equal(y, y_ref, "y")
    assert_bitwise_equal(scale, scale_ref, "mxscale")
    assert_bitwise_equal(rstd, rstd_ref, "rstd")
    if beta is None and gamma.dtype == x1.dtype:  # Ascend 950 npu_add_rms_norm (fp32 sum) then quantize
        normed, rstd_op, x_op = npu.npu_add_rms_norm(x1, x2, gamma, eps)
        for a, b in zip((y, x_out, scale, rstd), (QUANT(normed, **kw)[0], x_op, QUANT(normed, **kw)[1], rstd_op)):
            assert_bitwise_equal(a, b, "950 npu_add_rms_norm then npu_dynamic_mx_quant")


@pytest.fixture(scope="module")
def monkeypatch_950():
    mp = pytest.MonkeyPatch()
    mp.setenv("NPU_GOLDEN_SOC", "950")
    yield
    mp.undo()


def test_fused_norm_non_finite_rows():
    # an Inf makes its row's rstd 0: the Inf's block becomes NaN (Inf * 0) -> byte 255, elements +0; the row's
    # other blocks become (signed) zeros -> byte 0 (§6.2)
    x = torch.randn(2, 64).to(BF16)
    x[1, 5] = float("inf")
    y, scale, rstd = RMS_Q(x, torch.ones(64, dtype=BF16), dst_type=E4M3)
    assert rstd[1].item() == 0.0 and scale[1].tolist() == [[255, 0]]
    assert (y[1, :32].view(torch.uint8) == 0).all() and (y[1, 32:].float() == 0).all()
    assert (scale[0] != 255).all()


# --- SwiGLU + quantize (§6.4) == npu_swiglu then quantize ------------------------------------------------

SWIGLU_Q = npu.npu_swiglu_mx_quant


@st.composite
def swiglu_cases(draw):
    dst, alg, rm = draw(st.sampled_from(FUSED_CONFIGS))
    dtype = draw(st.sampled_from([BF16, FP16]))
    rows = draw(st.integers(1, 9))
    h = 2 * draw(st.integers(1, 70))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = (torch.randn(rows, 2 * h, generator=g) * draw(st.sampled_from([0.01, 1.0, 8.0]))).to(dtype)
    if draw(st.booleans()):
        x = x.reshape(1, rows, 2 * h)
    return x, draw(st.booleans()), dict(dst_type=dst, scale_alg=alg, round_mode=rm)


@given(swiglu_cases())
def test_swiglu_mx_quant_equals_swiglu_then_quant(case):
    x, left, kw = case
    y, scale = SWIGLU_Q(x, activate_left=left, **kw)
    first, second = x.chunk(2, -1)
    gate_first = x if left else torch.cat([second, first], -1)  # npu_swiglu: silu(first half) * second half
    y_ref, scale_ref = QUANT(npu.npu_swiglu(gate_first, -1), **kw)
    assert_bitwise_equal(y, y_ref, "y")
    assert_bitwise_equal(scale, scale_ref, "mxscale")


@given(swiglu_cases(), st.data())
def test_swiglu_mx_quant_group_index_zeroes_rows_past_the_groups(case, data):
    x, left, kw = case
    x = x.reshape(-1, x.shape[-1])
    rows = x.shape[0]
    counts = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4).filter(lambda c: sum(c) <= rows))
    mode = data.draw(st.sampled_from([0, 1]))
    gi = torch.tensor(counts if mode == 0 else np.cumsum(counts).tolist(), dtype=torch.int64)
    y, scale = SWIGLU_Q(x, group_index=gi, group_mode=mode, activate_left=left, **kw)
    y_all, scale_all = SWIGLU_Q(x, activate_left=left, **kw)
    n = sum(counts)
    assert_bitwise_equal(y[:n], y_all[:n], "rows inside the groups")
    assert_bitwise_equal(scale[:n], scale_all[:n], "scales inside the groups")
    assert (y[n:].view(torch.uint8) == 0).all() and (scale[n:] == 0).all(), "rows past the groups are zero"


def test_swiglu_mx_quant_with_group_index_takes_zero_rows():
    # An EP rank that receives no expert slots runs the W4A8 experts on [0, 2*I] rows with all-zero counts.
    x = torch.zeros(0, 128, dtype=BF16)
    y, scale = SWIGLU_Q(x, group_index=torch.zeros(2, dtype=torch.int64), activate_left=True, dst_type=E4M3)
    assert y.shape == (0, 64) and scale.shape == (0, 1, 2)


def test_swiglu_along_other_dims():
    x = (torch.randn(6, 4, 64) * 3).to(BF16)
    y, s = SWIGLU_Q(x, activate_dim=0, axis=-1, dst_type=E4M3, activate_left=True)
    y_ref, s_ref = QUANT(npu.npu_swiglu(x, 0), dst_type=E4M3)
    assert_bitwise_equal(y, y_ref, "activate_dim 0")
    assert_bitwise_equal(s, s_ref, "activate_dim 0 scales")
    y, s = SWIGLU_Q(x, axis=0, dst_type=E5M2, activate_left=True)
    y_ref, s_ref = QUANT(npu.npu_swiglu(x, -1), dst_type=E5M2, axis=0)
    assert s.shape == (1, 4, 32, 2)
    assert_bitwise_equal(y, y_ref, "quant axis 0")
    assert_bitwise_equal(s, s_ref, "quant axis 0 scales")


def test_golden_10_6_swiglu_and_zero_inputs():
    ones = torch.ones(4, 8, dtype=BF16)
    y, s = SWIGLU_Q(ones)  # default FP4, alg 0: silu(1) -> bf16 0.73046875 -> byte 124, codes 6.0 -> 0x77
    assert y.tolist() == [[0x77, 0x77]] * 4 and s.tolist() == [[[124, 0]]] * 4
    y, s = SWIGLU_Q(ones, dst_type=torch.float8_e4m3fn, scale_alg=1)  # 0.73046875 * 512 = 374 -> 384
    assert s.tolist() == [[[118, 0]]] * 4 and y.float().unique().tolist() == [384.0]
    # every MX op on zeros: elements 0, scale bytes 0
    z = torch.zeros(3, 64, dtype=BF16)
    outs = [
        QUANT(z),
        QUANT(z, dst_type=E4M3, scale_alg=1),
        SWIGLU_Q(torch.cat([z, z], -1)),
        RMS_Q(z, torch.ones(64, dtype=BF16))[:2],
        ADD_RMS_Q(z, z, torch.ones(64, dtype=BF16), dst_type=E4M3)[::2],
    ]
    for y, s in outs:
        assert (y.view(torch.uint8) == 0).all() and (s == 0).all()


FUSED_ERRORS = {
    "rms_dtype": (
        lambda: RMS_Q(torch.ones(2, 32), torch.ones(32)),
        ValueError,
        r"npu_rms_norm_dynamic_mx_quant: x has dtype torch.float32; allowed: torch.bfloat16, torch.float16",
    ),
    "rms_gamma_shape": (
        lambda: RMS_Q(_X, torch.ones(32, dtype=BF16)),
        ValueError,
        r"npu_rms_norm_dynamic_mx_quant: gamma has shape \(32,\); expected \(64,\)",
    ),
    "rms_gamma_dtype": (
        lambda: RMS_Q(_X, torch.ones(64, dtype=FP16)),
        ValueError,
        r"gamma has dtype torch.float16; allowed: torch.bfloat16 \(x.dtype\), torch.float32",
    ),
    "rms_beta": (
        lambda: RMS_Q(_X, torch.ones(64, dtype=BF16), beta=torch.ones(64)),
        ValueError,
        r"beta is torch.float32\(64,\); expected gamma's torch.bfloat16\(64,\)",
    ),
    "rms_fp4_alg1": (
        lambda: RMS_Q(_X, torch.ones(64, dtype=BF16), scale_alg=1),
        ValueError,
        r"npu_rms_norm_dynamic_mx_quant: scale_alg=1 is not allowed with dst_type float4_e2m1fn; "
        r"allowed: 0",
    ),
    "rms_fp8_alg2": (
        lambda: RMS_Q(_X, torch.ones(64, dtype=BF16), scale_alg=2, dst_type=24),
        ValueError,
        r"scale_alg=2 is not allowed with dst_type float8_e4m3fn; allowed: 0, 1",
    ),
    "add_x2": (
        lambda: ADD_RMS_Q(_X, _X[:1], torch.ones(64, dtype=BF16)),
        ValueError,
        r"npu_add_rms_norm_dynamic_mx_quant: x2 is torch.bfloat16\(1, 64\); expected x1's",
    ),
    "add_dst": (
        lambda: ADD_RMS_Q(_X, _X, torch.ones(64, dtype=BF16), dst_type=15),
        ValueError,
        r"npu_add_rms_norm_dynamic_mx_quant: dst_type=15 is not an MX element type",
    ),
    "swiglu_odd": (
        lambda: SWIGLU_Q(torch.ones(3, 6, dtype=BF16), activate_dim=0),
        ValueError,
        r"npu_swiglu_mx_quant: x has odd size 3 along activate_dim=0",
    ),
    "swiglu_rank": (
        lambda: SWIGLU_Q(torch.ones(64, dtype=BF16)),
        ValueError,
        r"npu_swiglu_mx_quant: x must have 2 to 7 dims; got shape \(64,\)",
    ),
    "swiglu_mode1": (lambda: SWIGLU_Q(_X, swiglu_mode=1), NotImplementedError, r"swiglu_mode=1"),
    "swiglu_fp4_alg1": (lambda: SWIGLU_Q(_X, scale_alg=1), ValueError, r"scale_alg=1 .* allowed: 0"),
    "swiglu_max_dtype_value": (
        lambda: SWIGLU_Q(_X, max_dtype_value=6.0),
        ValueError,
        r"max_dtype_value=6.0; allowed: 0",
    ),
    "swiglu_fp4_odd": (
        lambda: SWIGLU_Q(torch.ones(2, 2, dtype=BF16)),
        ValueError,
        r"the activation \(x with activate_dim halved\) has shape \(2, 1\); FP4 output packs",
    ),
    "swiglu_group_dtype": (
        lambda: SWIGLU_Q(_X, group_index=torch.tensor([1], dtype=torch.int32)),
        ValueError,
        r"group_index has dtype torch.int32; allowed: torch.int64",
    ),
    "swiglu_group_rows": (
        lambda: SWIGLU_Q(_X, group_index=torch.tensor([2, 1])),
        ValueError,
        r"group_index covers 3 rows but x has 2",
    ),
    "swiglu_group_cumsum": (
        lambda: SWIGLU_Q(_X, group_index=torch.tensor([2, 1]), group_mode=1),
        ValueError,
        r"group_index \(group_mode=1, cumsum\) must be non-negative and non-decreasing",
    ),
    "swiglu_group_axis": (
        lambda: SWIGLU_Q(torch.ones(64, 4, dtype=BF16), group_index=torch.tensor([1]), activate_dim=0, dst_type=24),
        NotImplementedError,
        r"group_index with activate_dim=0",
    ),
}


@pytest.mark.parametrize("name", sorted(FUSED_ERRORS))
def test_invalid_fused_arguments_raise_naming_op_and_argument(name):
    call, error, match = FUSED_ERRORS[name]
    with pytest.raises(error, match=match):
        call()


# --- MX matmuls (§6.5, §6.6) == dequantize, then an fp32-accumulated matmul ---------------------------------
# The float64 reference indexes every scale byte explicitly, [k // 64, n, (k // 32) % 2] for weights and
# [m, k // 64, (k // 32) % 2] for activations, with random (distinct) bytes per block and pair slot, so a layout
# mistake cannot cancel out. fp32 accumulation in any order is within gamma_K * sum|x_k w_k| of the exact sum
# (the standard summation bound, K products and K-1 additions with unit roundoff 2^-24).

QMM = npu.npu_quant_matmul
GMM = npu.npu_grouped_matmul


def _random_elements(g, shape, fmt: str) -> torch.Tensor:
    """Random finite element bytes: fp8 tensors, or uint8 packed FP4 (last dim = shape[-1] / 2)."""
    if fmt == "e2m1":
        return torch.randint(0, 256, tuple(shape[:-1]) + (shape[-1] // 2,), generator=g, dtype=torch.uint8)
    dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    b = torch.randint(0, 256, tuple(shape), generator=g, dtype=torch.uint8)
    finite = b.view(dtype).float().isfinite()
    return torch.where(finite, b, b & 0x3F).view(dtype)  # non-finite codes -> small finite ones


def _random_scales(g, shape, lo=112, hi=142) -> torch.Tensor:
    return torch.randint(lo, hi, tuple(shape), generator=g, dtype=torch.uint8)


def _decode_rows(data: torch.Tensor, fmt: str) -> np.ndarray:
    return oracle.decode(bytes_of(data), fmt)


def _act_ref(x: np.ndarray, xs: torch.Tensor) -> np.ndarray:
    """x [..., M, K] * 2^(xs[..., m, k // 64, (k // 32) % 2] - 127), float64."""
    k = np.arange(x.shape[-1])
    return x * np.ldexp(1.0, xs.numpy()[..., k // 64, (k // 32) % 2].astype(np.int64) - 127)


def _weight_ref(w: np.ndarray, ws: np.ndarray) -> np.ndarray:
    """w [K, N] * 2^(ws[k // 64, n, (k // 32) % 2] - 127), float64."""
    k = np.arange(w.shape[0])[:, None]
    n = np.arange(w.shape[1])[None, :]
    return w * np.ldexp(1.0, ws[k // 64, n, (k // 32) % 2].astype(np.int64) - 127)


def assert_fp32_matmul_bound(got: torch.Tensor, a: np.ndarray, b: np.ndarray, bias=None) -> None:
    exact = a @ b + (0.0 if bias is None else bias)
    k = a.shape[-1]
    u = 2.0**-24
    gamma = (k + 1) * u / (1 - (k + 1) * u)
    bound = gamma * (np.abs(a) @ np.abs(b) + (0.0 if bias is None else np.abs(bias))) + 2.0**-149
    err = np.abs(got.double().numpy() - exact)
    assert np.all(err <= bound), f"fp32 matmul error {err.max():.3e} exceeds the summation bound {bound.max():.3e}"


@st.composite
def qmm_cases(draw):
    mode = draw(st.sampled_from(["e4m3", "e5m2", "e2m1"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    m, n = draw(st.integers(1, 6)), 2 * draw(st.integers(1, 12))
    k = draw(st.sampled_from([32, 64, 96, 128, 160])) if mode == "e2m1" else draw(st.integers(1, 130))
    batch = draw(st.sampled_from([(), (2,)]))
    x1 = _random_elements(g, batch + (m, k), mode)
    kb = math.ceil(k / 64)
    xs = _random_scales(g, batch + (m, kb, 2))
    if mode == "e2m1":  # A4W4: x2 [K, N/2] packed along N
        x2 = _random_elements(g, (k, n), mode)
    else:  # the linear's stored [N, K] weight, passed transposed: a [K, N] view
        x2 = _random_elements(g, (n, k), mode).t()
    ws = _random_scales(g, (n, kb, 2)).transpose(0, 1)  # [ceil(K/64), N, 2] view of the stored layout
    bias = torch.randn(n, generator=g) if draw(st.booleans()) else None
    return mode, x1, x2, xs, ws, bias


@given(qmm_cases())
def test_quant_matmul_mx_equals_dequantize_then_matmul(case):
    mode, x1, x2, xs, ws, bias = case
    kw = dict(pertoken_scale=xs, bias=bias, scale_dtype=293, pertoken_scale_dtype=293, group_sizes=[1, 1, 32])
    if mode == "e2m1":
        kw.update(x1_dtype=296, x2_dtype=296)
    out32 = QMM(x1, x2, ws, output_dtype=torch.float32, **kw)
    a = _act_ref(_decode_rows(x1, mode), xs)
    b_vals = _decode_rows(x2, mode) if mode == "e2m1" else _decode_rows(x2.t(), mode).T
    b = _weight_ref(b_vals, ws.numpy())
    assert out32.shape == x1.shape[:-1] + (b.shape[1],) and out32.dtype == torch.float32
    assert_fp32_matmul_bound(out32, a, b, None if bias is None else bias.double().numpy())
    out16 = QMM(x1, x2, ws, output_dtype=torch.bfloat16, **kw)  # the same fp32 result, rounded once (RNE)
    assert_bitwise_equal(out16, out32.to(torch.bfloat16), "bf16 output = fp32 result rounded")
    assert_bitwise_equal(QMM(x1, x2, ws, **kw), out16, "output_dtype None -> bfloat16")


def test_quant_matmul_mxfp8_linear_from_quantized_bf16():
    # The attention-linear pipeline: x and W quantized by npu_dynamic_mx_quant, W passed as [K, N] / [K/64, N, 2]
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(5, 256, generator=g).to(BF16), torch.randn(48, 256, generator=g).to(BF16) * 0.05
    xq, xs = quant(x, E4M3)
    wq, wsc = quant(w, E4M3)
    out = QMM(
        xq,
        wq.t(),
        wsc.transpose(0, 1),
        pertoken_scale=xs,
        scale_dtype=293,
        pertoken_scale_dtype=293,
        output_dtype=6,
        group_sizes=[1, 1, 32],
    )
    a = oracle.dequantize(bytes_of(xq), xs.numpy(), "e4m3")
    b = oracle.dequantize(bytes_of(wq), wsc.numpy(), "e4m3").T
    assert_fp32_matmul_bound(out, a, b)


@st.composite
def gmm_cases(draw):
    mode = draw(st.sampled_from(["w4a8", "w4a8", "w8a8", "a4w4"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    e, n = draw(st.integers(1, 4)), 2 * draw(st.integers(1, 8))
    k = draw(st.sampled_from([32, 64, 96, 128])) if mode != "w8a8" else draw(st.integers(1, 100))
    counts = draw(st.lists(st.integers(0, 4), min_size=e, max_size=e))
    m = sum(counts) + draw(st.integers(0, 2))  # rows past the last group
    kb = math.ceil(k / 64)
    xf = "e2m1" if mode == "a4w4" else "e4m3"
    x = _random_elements(g, (m, k), xf)
    xs = _random_scales(g, (m, kb, 2))
    stored_scale = _random_scales(g, (e, n, kb, 2))  # reshape_mx_scale of the checkpoint [E, N, K/32]
    ws = stored_scale.transpose(1, 2)  # [E, ceil(K/64), N, 2] view
    if mode == "w4a8":  # stored [E, N, K/2] (packed along K), passed as the [E, K/2, N] view
        w = _random_elements(g, (e, n, k), "e2m1").transpose(1, 2)
        kw = dict(antiquant_scale=[ws], weight_dtype=296)
        w_vals = np.stack([_decode_rows(w[i].t(), "e2m1").T for i in range(e)]) if e else None
    elif mode == "w8a8":
        w = _random_elements(g, (e, n, k), "e4m3").transpose(1, 2)
        kw = dict(scale=[ws], scale_dtype=293)
        w_vals = np.stack([_decode_rows(w[i].t(), "e4m3").T for i in range(e)])
    else:  # A4W4: weight [E, K, N/2] contiguous, packed along N
        w = _random_elements(g, (e, k, n), "e2m1")
        kw = dict(scale=[ws], scale_dtype=293, weight_dtype=296, x_dtype=296)
        w_vals = np.stack([_decode_rows(w[i], "e2m1") for i in range(e)])
    list_type = draw(st.sampled_from([0, 1]))
    group_list = torch.tensor(counts if list_type == 1 else np.cumsum(counts).tolist(), dtype=torch.int64)
    kw.update(
        per_token_scale=[xs],
        per_token_scale_dtype=293,
        group_list=group_list,
        group_type=0,
        group_list_type=list_type,
        split_item=draw(st.sampled_from([2, 3])),
    )
    return xf, x, w, w_vals, xs, ws, counts, kw


@given(gmm_cases())
def test_grouped_matmul_mx_equals_dequantize_then_matmul(case):
    xf, x, w, w_vals, xs, ws, counts, kw = case
    (out32,) = GMM([x], [w], output_dtype=torch.float32, **kw)
    a = _act_ref(_decode_rows(x, xf), xs)
    m, n = x.shape[0], ws.shape[2]
    assert out32.shape == (m, n)
    start = 0
    for e, c in enumerate(counts):
        b = _weight_ref(w_vals[e], ws[e].numpy())
        assert_fp32_matmul_bound(out32[start : start + c], a[start : start + c], b)
        start += c
    assert (out32[start:] == 0).all(), "rows past the last group are 0"
    (out16,) = GMM([x], [w], output_dtype=torch.bfloat16, **kw)
    assert_bitwise_equal(out16, out32.to(torch.bfloat16), "bf16 output = fp32 result rounded")
    assert_bitwise_equal(GMM([x], [w], **kw)[0], out16, "output_dtype None -> bfloat16")


def test_golden_10_7_gmm_w4a8_indexing():
    x = torch.tensor([[1.0] * 32 + [2.0] * 32], dtype=BF16)
    xq, xs = quant(x, E4M3)
    assert xs.tolist() == [[[119, 120]]] and xq.view(torch.uint8).unique().tolist() == [0x78]
    w, ws = mxf.mx_quantize_weight(torch.full((1, 64), 0.5, dtype=BF16), mxf.E2M1)  # converter: [N=1, K/2]
    assert w.tolist() == [[0x66] * 32] and ws.tolist() == [[124, 124]]
    weight = w[None].transpose(1, 2)  # [E=1, K/2=32, N=1]
    scale = ws[None].reshape(1, 1, 1, 2).transpose(1, 2)  # reshape_mx_scale, then [E, K/64, N, 2]
    (y,) = GMM(
        [xq],
        [weight],
        antiquant_scale=[scale],
        per_token_scale=[xs],
        group_list=torch.tensor([1]),
        group_type=0,
        group_list_type=1,
        split_item=3,
        weight_dtype=296,
        per_token_scale_dtype=293,
        output_dtype=torch.bfloat16,
    )
    assert y.tolist() == [[48.0]]


def test_w4a8_experts_pipeline():
    # converter weights x npu_dynamic_mx_quant activations through GMM1 -> swiglu_mx_quant -> GMM2: each grouped
    # matmul within the fp32 summation bound of the float64 dequantized product, its bf16 output that fp32
    # result rounded once
    g = torch.Generator().manual_seed(4)
    e, h, inter, counts = 3, 64, 64, [2, 0, 3]
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * 0.1).to(BF16)
    w2 = (torch.randn(e, h, inter, generator=g) * 0.1).to(BF16)
    q13, s13 = mxf.mx_quantize_weight(w13, mxf.E2M1)  # [E, 2I, H/2], [E, 2I, H/32]
    q2, s2 = mxf.mx_quantize_weight(w2, mxf.E2M1)
    x = torch.randn(sum(counts), h, generator=g).to(BF16)
    xq, xs = quant(x, E4M3)
    tok = torch.tensor(counts)
    common = dict(
        group_list=tok, group_type=0, group_list_type=1, split_item=3, weight_dtype=296, per_token_scale_dtype=293
    )

    def gmm_checked(aq, a_scale, q, s):
        wv, sv = [q.transpose(1, 2)], [s.unflatten(-1, (-1, 2)).transpose(1, 2)]
        (out32,) = GMM([aq], wv, antiquant_scale=sv, per_token_scale=[a_scale], output_dtype=torch.float32, **common)
        (out16,) = GMM([aq], wv, antiquant_scale=sv, per_token_scale=[a_scale], output_dtype=BF16, **common)
        assert_bitwise_equal(out16, out32.to(BF16), "bf16 output = fp32 result rounded")
        a = oracle.dequantize(bytes_of(aq), a_scale.numpy(), "e4m3")
        start = 0
        for i, c in enumerate(counts):
            b = oracle.dequantize(q[i].numpy(), mxf.pair_scales(s[i]).numpy(), "e2m1").T
            assert_fp32_matmul_bound(out32[start : start + c], a[start : start + c], b)
            start += c
        return out16

    h1 = gmm_checked(xq, xs, q13, s13)
    hq, hs = SWIGLU_Q(h1, group_index=tok, activate_left=True, dst_type=torch.float8_e4m3fn)
    out = gmm_checked(hq, hs, q2, s2)
    assert out.shape == (5, h)


MM_ERRORS = {
    "qmm_not_mx": (
        lambda: QMM(torch.zeros(2, 32, dtype=torch.int8), torch.zeros(32, 4, dtype=torch.int8), torch.ones(4)),
        NotImplementedError,
        r"npu_quant_matmul: scale_dtype=None, "
        r"pertoken_scale_dtype=None \(only the MX modes",
    ),
    "qmm_half_mx": (
        lambda: QMM(_F8, _F8.t(), _S2, pertoken_scale=_S1, scale_dtype=293),
        ValueError,
        r"npu_quant_matmul: pertoken_scale_dtype=None in MX mode; allowed: 293",
    ),
    "qmm_group_sizes": (
        lambda: QMM(
            _F8, _F8.t(), _S2, pertoken_scale=_S1, scale_dtype=293, pertoken_scale_dtype=293, group_sizes=[1, 1, 64]
        ),
        ValueError,
        r"group_sizes=\[1, 1, 64\] in MX mode",
    ),
    "qmm_x2_dtype": (
        lambda: QMM(_F8, _F8.t().to(torch.float16), _S2, pertoken_scale=_S1, scale_dtype=293, pertoken_scale_dtype=293),
        ValueError,
        r"x2 is torch.float16 with x2_dtype=None; allowed: torch.float8_e4m3fn / torch.float8_e5m2, "
        r"or torch.uint8 with x2_dtype=296",
    ),
    "qmm_a8w4": (
        lambda: QMM(
            _F8,
            torch.zeros(64, 4, dtype=torch.uint8),
            _S2,
            pertoken_scale=_S1,
            scale_dtype=293,
            pertoken_scale_dtype=293,
            x2_dtype=296,
        ),
        NotImplementedError,
        r"MX A8W4 linear",
    ),
    "qmm_k": (
        lambda: QMM(_F8, _F8[:, :32].t(), _S2, pertoken_scale=_S1, scale_dtype=293, pertoken_scale_dtype=293),
        ValueError,
        r"x2 has shape \(32, 3\); expected \[K=64, N\]",
    ),
    "qmm_scale_shape": (
        lambda: QMM(_F8, _F8.t(), _S2[:, :2], pertoken_scale=_S1, scale_dtype=293, pertoken_scale_dtype=293),
        ValueError,
        r"npu_quant_matmul: scale has shape \(1, 2, 2\); expected \(1, 3, 2\)",
    ),
    "qmm_no_x_scale": (
        lambda: QMM(_F8, _F8.t(), _S2, scale_dtype=293, pertoken_scale_dtype=293),
        ValueError,
        r"pertoken_scale is required in MX mode",
    ),
    "qmm_dtype_code": (
        lambda: QMM(_F8, _F8.t(), _S2, pertoken_scale=_S1, scale_dtype=293, pertoken_scale_dtype=293, x1_dtype=23),
        ValueError,
        r"x1_dtype=23 contradicts x1.dtype torch.float8_e4m3fn",
    ),
    "qmm_output_dtype": (
        lambda: QMM(_F8, _F8.t(), _S2, pertoken_scale=_S1, scale_dtype=293, pertoken_scale_dtype=293, output_dtype=1),
        ValueError,
        r"output_dtype=1 is not allowed; allowed codes: 15",
    ),
    "gmm_split": (
        lambda: GMM(
            [_F8],
            [_W4],
            antiquant_scale=[_WS],
            per_token_scale=[_S1],
            per_token_scale_dtype=293,
            weight_dtype=296,
            group_list=torch.tensor([3]),
            group_type=0,
            split_item=0,
        ),
        ValueError,
        r"npu_grouped_matmul: MX mode takes group_type=0 with split_item 2 or 3",
    ),
    "gmm_no_weight_scale": (
        lambda: GMM(
            [_F8],
            [_W4],
            per_token_scale=[_S1],
            per_token_scale_dtype=293,
            weight_dtype=296,
            group_list=torch.tensor([3]),
            **_M3,
        ),
        ValueError,
        r"antiquant_scale \(the W4A8 weight scale\) must be a list of one tensor in MX mode",
    ),
    "gmm_weight_shape": (
        lambda: GMM(
            [_F8],
            [_W4[:, :16]],
            antiquant_scale=[_WS],
            per_token_scale=[_S1],
            per_token_scale_dtype=293,
            weight_dtype=296,
            group_list=torch.tensor([3]),
            **_M3,
        ),
        ValueError,
        r"weight\[0\] has shape \(1, 16, 3\); FP4 expects \[E, K/2, N\]",
    ),
    "gmm_ws_shape": (
        lambda: GMM(
            [_F8],
            [_W4],
            antiquant_scale=[_WS[:, :, :2]],
            per_token_scale=[_S1],
            per_token_scale_dtype=293,
            weight_dtype=296,
            group_list=torch.tensor([3]),
            **_M3,
        ),
        ValueError,
        r"weight scale has shape \(1, 1, 2, 2\); expected \(1, 1, 3, 2\)",
    ),
    "gmm_bias": (
        lambda: GMM(
            [_F8],
            [_W4],
            bias=[torch.zeros(1, 3)],
            antiquant_scale=[_WS],
            per_token_scale=[_S1],
            per_token_scale_dtype=293,
            weight_dtype=296,
            group_list=torch.tensor([3]),
            **_M3,
        ),
        ValueError,
        r"npu_grouped_matmul: bias must be None in MX mode",
    ),
    "gmm_rows": (
        lambda: GMM(
            [_F8],
            [_W4],
            antiquant_scale=[_WS],
            per_token_scale=[_S1],
            per_token_scale_dtype=293,
            weight_dtype=296,
            group_list=torch.tensor([4]),
            **_M3,
        ),
        ValueError,
        r"group_list sums to 4 rows but x\[0\] has M=3",
    ),
    "gmm_scale_dtype": (
        lambda: GMM(
            [_F8],
            [_F8.t()[None]],
            scale=[_WS],
            per_token_scale=[_S1],
            per_token_scale_dtype=293,
            group_list=torch.tensor([3]),
            **_M3,
        ),
        ValueError,
        r"MX weight scale in `scale` needs scale_dtype=293",
    ),
}
_F8 = torch.ones(3, 64).to(torch.float8_e4m3fn)
_S1 = torch.full((3, 1, 2), 127, dtype=torch.uint8)
_S2 = torch.full((1, 3, 2), 127, dtype=torch.uint8)
_W4 = torch.zeros(1, 32, 3, dtype=torch.uint8)
_WS = torch.full((1, 1, 3, 2), 127, dtype=torch.uint8)
_M3 = dict(group_type=0, group_list_type=1, split_item=3)


@pytest.mark.parametrize("name", sorted(MM_ERRORS))
def test_invalid_mx_matmul_arguments_raise_naming_op_and_argument(name):
    call, error, match = MM_ERRORS[name]
    with pytest.raises(error, match=match):
        call()


# --- converter quantizer (§8.2) -----------------------------------------------------------------------


@given(
    st.sampled_from([mxf.E4M3, mxf.E2M1]),
    st.sampled_from([BF16, FP32]),
    st.integers(1, 3),
    st.sampled_from([2, 30, 32, 64, 66, 128, 200]),
    st.integers(0, 2**31 - 1),
)
def test_converter_quantizer_matches_independent_quantizer(fmt, dtype, rows, k, seed):
    w = oracle.mx_inputs(seed, (rows, k), dtype, kinds=("gauss", "ties", "boundary", "tiny", "zero"))
    data, scale = mxf.mx_quantize_weight(w, fmt)
    data_ref, scale_ref = oracle.convert_weight(w, "e4m3" if fmt is mxf.E4M3 else "e2m1")
    np.testing.assert_array_equal(scale.numpy(), scale_ref)
    np.testing.assert_array_equal(bytes_of(data), data_ref)
    assert data.dtype == (torch.float8_e4m3fn if fmt is mxf.E4M3 else torch.uint8)
    assert scale.shape == (rows, math.ceil(k / 32)) and data.shape == (rows, k if fmt is mxf.E4M3 else k // 2)
    if dtype == BF16:  # §8.2 facts: the converter's scales are scale_alg 1 (E4M3) / scale_alg 2, dtm 7 (E2M1)
        _, s = quant(w, E4M3, 1) if fmt is mxf.E4M3 else quant(w, FP4, 2, dtm=7.0)
        np.testing.assert_array_equal(mxf.unpair_scales(s, scale.shape[-1]).numpy(), scale.numpy())


def test_converter_rounds_half_away_from_zero():
    # scale byte 127 (amax 4 -> 2^ceil(log2(4/7)) = 1): FP4 ties 0.25 -> 0.5, 2.5 -> 3, 5 -> 6, -1.25 -> -1.5;
    # the operator's rint gives 0, 2, 4, -1 on the same values
    w = torch.zeros(1, 32, dtype=BF16)
    w[0, :5] = torch.tensor([4.0, 0.25, 2.5, 5.0, -1.25])
    data, scale = mxf.mx_quantize_weight(w, mxf.E2M1)
    assert scale.tolist() == [[127]] and fp4_codes(data)[:5] == [0x6, 0x1, 0x5, 0x7, 0xB]
    # E4M3: amax 448 -> byte 127; 17 and 19 are ties between 16/18 and 18/20: away from zero -> 18, 20
    w8 = torch.zeros(1, 32, dtype=BF16)
    w8[0, :3] = torch.tensor([448.0, 17.0, -19.0])
    data, scale = mxf.mx_quantize_weight(w8, mxf.E4M3)
    assert scale.tolist() == [[127]] and data[0, :3].float().tolist() == [448.0, 18.0, -20.0]
    zero, zscale = mxf.mx_quantize_weight(torch.zeros(2, 64, dtype=BF16), mxf.E2M1)
    assert zscale.tolist() == [[0, 0], [0, 0]] and (zero == 0).all()


# --- packing helpers (§1.3) -----------------------------------------------------------------------------


def test_fp4_packing_low_nibble_first_and_round_trip():
    codes = torch.arange(16, dtype=torch.uint8).reshape(2, 8)
    packed = mxf.pack_fp4(codes)
    assert packed.tolist() == [[0x10, 0x32, 0x54, 0x76], [0x98, 0xBA, 0xDC, 0xFE]]
    assert torch.equal(mxf.unpack_fp4(packed), codes)
    # packed along dim 0 of a transposed view: [K/2, N] logical, stride-1 axis = 0 after transpose
    w = torch.randint(0, 16, (6, 8), dtype=torch.uint8)
    along0 = mxf.pack_fp4(w, dim=0)
    assert along0.shape == (3, 8) and torch.equal(mxf.unpack_fp4(along0, dim=0), w)
    assert torch.equal(mxf.unpack_fp4(mxf.pack_fp4(w.t().contiguous()).t(), dim=0), w)
    assert mxf.decode_fp4(torch.tensor([0, 1, 7, 8, 9, 15])).tolist() == [0.0, 0.5, 6.0, -0.0, -0.5, -6.0]
    assert math.copysign(1.0, mxf.decode_fp4(torch.tensor([8])).item()) == -1.0


def test_e8m0_bytes_decode_exactly():
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = mxf.e8m0_to_float(b)
    assert got[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127] and got[6].isnan()
    assert torch.equal(mxf.e8m0_to_float(b.view(torch.float8_e8m0fnu)).nan_to_num(7.0), got.nan_to_num(7.0))
    assert (
        mxf.float4_e2m1fn_x2,
        mxf.float8_e8m0fnu,
        mxf.float8_e4m3fn,
        mxf.float8_e5m2,
        mxf.hifloat8,
        mxf.float4_e1m2fn_x2,
        mxf.int4,
    ) == (296, 293, 292, 291, 290, 297, 285)


# --- shapes under fake tensors, opcheck, torch.compile -----------------------------------------------------


def _quant_samples():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 80, generator=g).to(BF16)
    return [
        ((x,), {}),
        ((x,), {"dst_type": 24}),
        ((x.half(),), {"dst_type": 23, "scale_alg": 1}),
        ((x.float().t(),), {"dst_type": 292, "axis": 0}),  # non-contiguous, non-last axis
        ((x[:, :64].reshape(2, 3, 32),), {"dst_type": 296, "round_mode": "floor", "scale_alg": 2, "axis": 1}),
        ((x,), {"dst_type": 24, "block_size": 64, "scale_alg": None}),
    ]


def _anti_samples():
    out = []
    for (x,), kw in _quant_samples()[1:5]:
        y, s = QUANT(x, **kw)
        dst = kw["dst_type"]
        out.append(((y, s), {"axis": kw.get("axis", -1), "src_type": dst, "dst_type": {23: 5, 24: 15}.get(dst, 6)}))
    return out


def opcheck(op, args, kwargs):
    """torch.library.opcheck; its schema check (SchemaCheckMode) multiplies input tensors to detect
    mutation, which CPU float8 tensors do not support, so fp8 inputs run the other three checks."""
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    tensors += [
        t
        for a in list(args) + list(kwargs.values())
        if isinstance(a, (list, tuple))
        for t in a
        if isinstance(t, torch.Tensor)
    ]
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in tensors):
        utils = utils[1:]
    torch.library.opcheck(op, args, kwargs, test_utils=utils)


def _fused_samples():
    g = torch.Generator().manual_seed(9)
    x1, x2 = torch.randn(3, 96, generator=g).to(BF16), torch.randn(3, 96, generator=g).to(BF16)
    gamma = torch.rand(96, generator=g).to(BF16)
    return [
        (RMS_Q, (x1, gamma), {"dst_type": 24}),
        (RMS_Q, (x1.half(), gamma.float()), {"beta": torch.randn(96, generator=g), "round_mode": "floor"}),
        (ADD_RMS_Q, (x1, x2, gamma), {"dst_type": 292, "scale_alg": 1, "epsilon": 1e-5}),
        (SWIGLU_Q, (x1,), {"dst_type": 24, "activate_left": True}),
        (SWIGLU_Q, (x1.half(),), {"group_index": torch.tensor([1, 1]), "group_mode": 0}),
    ]


def _matmul_samples():
    g = torch.Generator().manual_seed(13)
    x1, x2 = _random_elements(g, (3, 96), "e4m3"), _random_elements(g, (8, 96), "e4m3").t()
    xs, ws = _random_scales(g, (3, 2, 2)), _random_scales(g, (8, 2, 2)).transpose(0, 1)
    mx = dict(scale_dtype=293, pertoken_scale_dtype=293, group_sizes=[1, 1, 32])
    w4 = _random_elements(g, (2, 8, 96), "e2m1").transpose(1, 2)
    ws4 = _random_scales(g, (2, 8, 2, 2)).transpose(1, 2)
    gmm = dict(
        group_list=torch.tensor([1, 2]), group_type=0, group_list_type=1, split_item=3, per_token_scale_dtype=293
    )
    return [
        (QMM, (x1, x2, ws), dict(pertoken_scale=xs, output_dtype=15, **mx)),
        (
            QMM,
            (
                _random_elements(g, (2, 3, 64), "e2m1"),
                _random_elements(g, (64, 8), "e2m1"),
                _random_scales(g, (1, 8, 2)),
            ),
            dict(
                pertoken_scale=_random_scales(g, (2, 3, 1, 2)),
                x1_dtype=296,
                x2_dtype=296,
                bias=torch.randn(8, generator=g),
                **mx,
            ),
        ),
        (
            GMM,
            ([x1], [w4]),
            dict(antiquant_scale=[ws4], per_token_scale=[xs], weight_dtype=296, output_dtype=torch.bfloat16, **gmm),
        ),
    ]


@pytest.mark.parametrize("index", range(3))
def test_matmul_opcheck(index):
    op, args, kwargs = _matmul_samples()[index]
    opcheck(op.default, args, kwargs)


@pytest.mark.parametrize("index", range(5))
def test_fused_opcheck(index):
    op, args, kwargs = _fused_samples()[index]
    opcheck(op.default, args, kwargs)


@pytest.mark.parametrize("index", range(6))
def test_quant_opcheck(index):
    args, kwargs = _quant_samples()[index]
    opcheck(QUANT.default, args, kwargs)


@pytest.mark.parametrize("index", range(4))
def test_anti_quant_opcheck(index):
    args, kwargs = _anti_samples()[index]
    opcheck(ANTI.default, args, kwargs)


def test_fake_shapes_match_eager():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cases = [(QUANT, a, k) for a, k in _quant_samples()] + [(ANTI, a, k) for a, k in _anti_samples()]
    cases += _fused_samples() + _matmul_samples()
    for op, args, kwargs in cases:
        eager = op(*args, **kwargs)
        with FakeTensorMode() as mode:

            def to_fake(v):
                if isinstance(v, (list, tuple)):
                    return type(v)(to_fake(t) for t in v)
                return mode.from_tensor(v) if isinstance(v, torch.Tensor) else v

            fake = op(*to_fake(list(args)), **{k: to_fake(v) for k, v in kwargs.items()})
        eager, fake = (eager, fake) if isinstance(eager, (tuple, list)) else ((eager,), (fake,))
        for e, f in zip(eager, fake):
            assert (e.shape, e.dtype) == (f.shape, f.dtype), op


def test_torch_compile_fullgraph_matches_eager():
    def step(x, gamma):
        y8, s8 = npu.npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn)
        y4, s4 = npu.npu_dynamic_mx_quant(x, dst_type=296, round_mode="round", scale_alg=2)
        back = npu.npu_anti_mx_quant(y4, s4, dst_type=torch.float32, src_type=296)
        yn, res, sn, _ = npu.npu_add_rms_norm_dynamic_mx_quant(x, x, gamma, dst_type=torch.float8_e4m3fn)
        yr, sr, _ = npu.npu_rms_norm_dynamic_mx_quant(res, gamma)
        ys, ss = npu.npu_swiglu_mx_quant(x, activate_left=True, dst_type=torch.float8_e4m3fn)
        mm = npu.npu_quant_matmul(
            y8,
            y8[:8].t(),
            s8[:8].transpose(0, 1),
            pertoken_scale=s8,
            scale_dtype=293,
            pertoken_scale_dtype=293,
            output_dtype=torch.bfloat16,
            group_sizes=[1, 1, 32],
        )
        (gm,) = npu.npu_grouped_matmul(
            [y8],
            [y4.view(2, 2, 48).transpose(1, 2)],
            antiquant_scale=[s4.view(2, 2, 2, 2).transpose(1, 2)],
            per_token_scale=[s8],
            group_list=torch.tensor([1, 3]),
            group_type=0,
            group_list_type=1,
            split_item=3,
            weight_dtype=296,
            per_token_scale_dtype=293,
        )
        return y8, s8, y4, s4, back, npu.npu_anti_mx_quant(y8, s8), yn, res, sn, yr, sr, ys, ss, mm, gm

    x = oracle.mx_inputs(3, (4, 96), BF16, kinds=("gauss", "ties", "zero"))
    gamma = torch.rand(96).to(BF16)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(x, gamma), step(x, gamma)):
        assert_bitwise_equal(got, want, "compiled vs eager")


# --- validation errors name the operator, the argument and what is allowed ------------------------------

_X = torch.ones(2, 64, dtype=BF16)
QUANT_ERRORS = {
    "dtype": (lambda: QUANT(_X.double()), ValueError, r"npu_dynamic_mx_quant: input has dtype torch.float64; allowed"),
    "rank": (lambda: QUANT(torch.ones([1] * 8, dtype=BF16)), ValueError, r"input must have 1 to 7 dims"),
    "axis": (lambda: QUANT(_X, axis=2), ValueError, r"axis=2 is out of range .* \(allowed \[-2, 1\]\)"),
    "dst": (lambda: QUANT(_X, dst_type=1), ValueError, r"dst_type=1 is not an MX element type; allowed codes: 23/291"),
    "e1m2": (lambda: QUANT(_X, dst_type=297), NotImplementedError, r"dst_type=297 \(float4_e1m2fn_x2\)"),
    "fp8_alg2": (
        lambda: QUANT(_X, dst_type=24, scale_alg=2),
        ValueError,
        r"scale_alg=2 is not allowed with dst_type float8_e4m3fn; allowed: 0, 1",
    ),
    "fp4_alg1": (
        lambda: QUANT(_X, scale_alg=1),
        ValueError,
        r"scale_alg=1 is not allowed with dst_type float4_e2m1fn; allowed: 0, 2",
    ),
    "fp8_round": (
        lambda: QUANT(_X, dst_type=23, round_mode="round"),
        ValueError,
        r"round_mode='round' is not allowed with dst_type float8_e5m2; allowed: 'rint'",
    ),
    "fp4_mode": (
        lambda: QUANT(_X, round_mode="ceil"),
        ValueError,
        r"round_mode='ceil' .* allowed: 'rint', 'round', 'floor'",
    ),
    "block": (
        lambda: QUANT(_X, block_size=48),
        ValueError,
        r"block_size=48; allowed: a multiple of 32 in \[32, 1024\]",
    ),
    "block_fp32": (lambda: QUANT(_X.float(), block_size=64), ValueError, r"block_size=64 with a float32 input"),
    "block_alg2": (lambda: QUANT(_X, scale_alg=2, block_size=64), ValueError, r"block_size=64 with scale_alg=2"),
    "dtm_range": (
        lambda: QUANT(_X, scale_alg=2, dst_type_max=5.0),
        ValueError,
        r"dst_type_max=5.0; allowed: 0.0 or a value in \[6.0, 12.0\]",
    ),
    "dtm_alg0": (lambda: QUANT(_X, dst_type_max=6.0), ValueError, r"dst_type_max=6.0 with scale_alg=0; allowed: 0.0"),
    "mlb_alg0": (
        lambda: QUANT(_X, dst_type=24, max_low_bound=1.0),
        ValueError,
        r"max_low_bound=1.0 with scale_alg=0; allowed: 0.0",
    ),
    "mlb_negative": (
        lambda: QUANT(_X, dst_type=24, scale_alg=1, max_low_bound=-1.0),
        ValueError,
        r"max_low_bound=-1.0; allowed: >= 0.0",
    ),
    "fp4_odd": (
        lambda: QUANT(torch.ones(2, 33, dtype=BF16)),
        ValueError,
        r"input has shape \(2, 33\); FP4 output packs pairs along the last dim, which must be even",
    ),
}


@pytest.mark.parametrize("name", sorted(QUANT_ERRORS))
def test_invalid_quantize_arguments_raise_naming_op_and_argument(name):
    call, error, match = QUANT_ERRORS[name]
    with pytest.raises(error, match=match):
        call()


# --- NPU kernel vs portable kernel (same inputs, bytes except inside 0xFF blocks) -------------------------


def _mask_nonfinite_blocks(y: np.ndarray, s: np.ndarray, fp4: bool) -> np.ndarray:
    per_block = s.reshape(s.shape[:-2] + (-1,))
    elems_per_byte = 16 if fp4 else 32
    bad = np.repeat(per_block == 255, elems_per_byte, axis=-1)[..., : y.shape[-1]]
    return np.where(bad, 0, y)


@pytest.mark.npu
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-alg{c[1]}-{c[2]}-dtm{c[3]}-mlb{c[4]:g}")
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_npu_quantize_matches_portable(config, dtype):
    dst, alg, rm, dtm, mlb = config
    x = oracle.mx_inputs(21, (8, 4096 + 64), dtype)
    kwargs = dict(dst_type=dst, scale_alg=alg, round_mode=rm, dst_type_max=dtm, max_low_bound=mlb)
    require_950("npu_dynamic_mx_quant")  # decided before the call: a kernel error on a 950 fails the test
    y, s = QUANT(x.to("npu"), **kwargs)
    y_cpu, s_cpu = portable_kernel("npu_dynamic_mx_quant")(x, **kwargs)
    assert_bitwise_equal(s.cpu(), s_cpu, "scale bytes")
    a, b = bytes_of(y.cpu()), bytes_of(y_cpu)
    np.testing.assert_array_equal(
        _mask_nonfinite_blocks(a, s_cpu.numpy(), dst == FP4), _mask_nonfinite_blocks(b, s_cpu.numpy(), dst == FP4)
    )


@pytest.mark.npu
@pytest.mark.parametrize("dst", [E4M3, FP4])
def test_npu_fused_ops_match_portable(dst):
    g = torch.Generator().manual_seed(22)
    x1, x2 = torch.randn(16, 1024, generator=g).to(BF16), torch.randn(16, 1024, generator=g).to(BF16)
    gamma = (torch.rand(1024, generator=g) + 0.5).to(BF16)
    cases = [
        ("npu_rms_norm_dynamic_mx_quant", (x1, gamma), dict(dst_type=dst), (0, 1)),
        ("npu_add_rms_norm_dynamic_mx_quant", (x1, x2, gamma), dict(dst_type=dst), (0, 2)),
        ("npu_swiglu_mx_quant", (x1,), dict(dst_type=dst, activate_left=True), (0, 1)),
    ]
    fmt = oracle.fmt_name(dst)
    require_950("the fused MX quantization operators")
    for name, args, kwargs, (iy, isc) in cases:
        got = getattr(npu, name)(*(a.to("npu") for a in args), **kwargs)
        want = portable_kernel(name)(*args, **kwargs)
        _decoded_close_within_one_step(got[iy].cpu(), got[isc].cpu(), want[iy], want[isc], fmt)


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


@pytest.mark.npu
def test_npu_mx_matmuls_match_portable():
    from equivalence.support.compare import assert_close, op_tolerance

    g = torch.Generator().manual_seed(23)
    x, w = torch.randn(24, 256, generator=g).to(BF16), (torch.randn(3, 64, 256, generator=g) * 0.05).to(BF16)
    xq, xs = quant(x, E4M3)
    wq, ws = quant(w[0], E4M3)
    q4, s4 = mxf.mx_quantize_weight(w, mxf.E2M1)
    mm_args = (xq, wq.t(), ws.transpose(0, 1))
    mm_kw = dict(
        pertoken_scale=xs,
        scale_dtype=293,
        pertoken_scale_dtype=293,
        output_dtype=torch.bfloat16,
        group_sizes=[1, 1, 32],
    )
    gmm_args = ([xq], [q4.transpose(1, 2)])
    gmm_kw = dict(
        antiquant_scale=[s4.unflatten(-1, (-1, 2)).transpose(1, 2)],
        per_token_scale=[xs],
        group_list=torch.tensor([10, 0, 9]),
        group_type=0,
        group_list_type=1,
        split_item=3,
        weight_dtype=296,
        per_token_scale_dtype=293,
        output_dtype=torch.bfloat16,
    )
    require_950("the MX matmuls")
    for name, args, kwargs, rows in (
        ("npu_quant_matmul", mm_args, mm_kw, 24),
        ("npu_grouped_matmul", gmm_args, gmm_kw, 19),
    ):
        got = getattr(npu, name)(*_to_device(args, "npu"), **_to_device(kwargs, "npu"))
        want = portable_kernel(name)(*args, **kwargs)
        got, want = (got[0], want[0]) if isinstance(want, list) else (got, want)
        assert_close(got.cpu()[:rows], want[:rows], op_tolerance(torch.bfloat16), f"{name}: NPU vs portable")
