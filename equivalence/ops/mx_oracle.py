"""An independent MX quantizer for the tests (spec mx_quant.md), written without the portable kernels' code.

Everything is float64 numpy: block exponents come from `np.frexp` (no fp32 bit tricks), scales are exact
powers of two from `np.ldexp`, element casts go through `ml_dtypes` (float8_e4m3fn, float8_e5m2,
float4_e2m1fn; RNE with subnormals) after clamping, and the non-RNE FP4 modes and every tie rule are brute
force: pick the nearest (or floor) value among the 16 FP4 codes. The converter's quantizer (§8.2) is written
literally (half-away-from-zero rounding on the element grid).

Inputs: `torch.Tensor` (read exactly through `.double()`); outputs: numpy uint8 arrays laid out like the
operators' outputs (fp8 bytes or packed FP4, scale bytes in the `[..., ceil(nb/2), 2]` pair layout).
`mx_inputs` makes the adversarial inputs of §11 (raw bit patterns, ties, power-of-two boundaries, tiny,
zero and non-finite blocks).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

# name -> (emax, maxval, ml_dtypes type, mantissa bits, min normal exponent)
FORMATS = {
    "e4m3": (8, 448.0, ml_dtypes.float8_e4m3fn, 3, -6),
    "e5m2": (15, 57344.0, ml_dtypes.float8_e5m2, 2, -14),
    "e2m1": (2, 6.0, ml_dtypes.float4_e2m1fn, 1, 0),
}
CODES = {23: "e5m2", 291: "e5m2", 24: "e4m3", 292: "e4m3", 296: "e2m1"}
FP4_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def fmt_name(dst) -> str:
    if isinstance(dst, torch.dtype):
        return {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}[dst]
    return CODES[int(dst)]


# --- exponents ----------------------------------------------------------------------------------------


def floor_log2(a: np.ndarray) -> np.ndarray:
    """floor(log2 a) for finite a > 0 (exact, via frexp: a = m * 2^e with m in [0.5, 1))."""
    return np.frexp(a)[1].astype(np.int64) - 1


def ceil_log2(a: np.ndarray) -> np.ndarray:
    m, e = np.frexp(a)
    return np.where(m == 0.5, e - 1, e).astype(np.int64)


def bf16_image(amax: np.ndarray, input_dtype: torch.dtype) -> np.ndarray:
    """amax as the bf16 value scale_alg 2 reads (§3.3): exact for bf16, RNE for fp16, truncation for fp32."""
    a32 = amax.astype(np.float32)
    if input_dtype == torch.float16:
        return a32.astype(ml_dtypes.bfloat16).astype(np.float64)
    if input_dtype == torch.float32:
        return (a32.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    return amax


# --- scale bytes --------------------------------------------------------------------------------------


def scale_bytes(
    blocks: np.ndarray,
    fmt: str,
    scale_alg: int,
    input_dtype: torch.dtype,
    dst_type_max: float = 0.0,
    max_low_bound: float = 0.0,
):
    """(byte int64 [..., nb], flush bool [..., nb]) for float64 blocks [..., nb, bs]; flush = elements -> ±0."""
    emax, maxval = FORMATS[fmt][:2]
    with np.errstate(invalid="ignore"):
        amax = np.max(np.abs(blocks), axis=-1)  # NaN propagates
    nonfinite = ~np.isfinite(amax)
    zero = amax == 0
    safe = np.where(nonfinite | zero, 1.0, amax)
    if scale_alg == 0:  # floor(log2 amax) - emax, clamped at byte 0; byte 0 flushes
        byte = np.where(zero, 0, np.maximum(floor_log2(safe) + 127 - emax, 0))
        flush = byte == 0
    elif scale_alg == 1:  # 2^ceil(log2(fp32(a * fp32(1/max)))), byte 0 encodes with 2^127
        a = np.maximum(safe, max_low_bound).astype(np.float32)
        s = (a * np.float32(1.0 / maxval)).astype(np.float64)  # one fp32 multiply, RNE
        byte = np.where(zero | (s == 0), 0, np.clip(ceil_log2(np.where(s == 0, 1.0, s)) + 127, 0, 254))
        flush = zero
    elif dst_type_max in (0.0, 6.0, 7.0):  # 2^ceil(log2(bf16(amax) / d))
        d = 7.0 if dst_type_max == 7.0 else 6.0
        byte = np.where(zero, 0, np.clip(ceil_log2(bf16_image(safe, input_dtype) / d) + 127, 0, 254))
        flush = byte == 0
    else:  # fp32(a * fp32(1/d)) like scale_alg 1, but an fp32-subnormal product gives byte 0
        s = (safe.astype(np.float32) * np.float32(1.0 / dst_type_max)).astype(np.float64)
        byte = np.where(zero | (s < 2.0**-126), 0, np.clip(ceil_log2(np.where(s == 0, 1.0, s)) + 127, 0, 254))
        flush = zero
    byte = np.where(nonfinite, 255, byte)
    return byte, flush


# --- element rounding ---------------------------------------------------------------------------------


def fp4_brute_force(v: np.ndarray, round_mode: str) -> np.ndarray:
    """4-bit codes by exhaustive search over the 16 codes: nearest (ties to even code / away from zero) or
    floor on the signed value; saturating at ±6; a value rounding to zero keeps its sign."""
    neg = np.signbit(v)
    if round_mode == "floor":
        signed = np.concatenate([-FP4_MAGNITUDES[::-1], FP4_MAGNITUDES[1:]])  # -6 .. 6
        idx = np.searchsorted(signed, np.clip(v, -6.0, 6.0), side="right") - 1  # largest value <= v
        value = signed[idx]
        mag = np.searchsorted(FP4_MAGNITUDES, np.abs(value))
        neg = neg | (value < 0)
        return (mag | (neg.astype(np.int64) << 3)).astype(np.uint8)
    m = np.minimum(np.abs(v), 6.0)[..., None]
    dist = np.abs(m - FP4_MAGNITUDES)
    best = dist.min(-1, keepdims=True)
    tied = dist == best
    codes = np.arange(8)
    if round_mode == "rint":  # among the nearest, the even code (mantissa bit 0)
        mag = np.where(tied & (codes % 2 == 0), codes, -1).max(-1)
        mag = np.where(mag < 0, np.where(tied, codes, -1).max(-1), mag)
    else:  # "round": ties away from zero = the larger magnitude
        mag = np.where(tied, codes, -1).max(-1)
    return (mag | (neg.astype(np.int64) << 3)).astype(np.uint8)


def encode(v: np.ndarray, fmt: str, round_mode: str) -> np.ndarray:
    """Element codes (fp8 bytes or 4-bit FP4 codes) of float64 values already divided by the scale."""
    _, maxval, np_type = FORMATS[fmt][:3]
    if fmt != "e2m1" or round_mode == "rint":  # ml_dtypes: RNE with subnormals, after saturation
        codes = np.clip(v, -maxval, maxval).astype(np_type).view(np.uint8)
        return codes & 0xF if fmt == "e2m1" else codes
    return fp4_brute_force(v, round_mode)


# --- quantize / dequantize ----------------------------------------------------------------------------


def _blocks(a: np.ndarray, block_size: int):
    k = a.shape[-1]
    nb = math.ceil(k / block_size)
    padded = np.zeros(a.shape[:-1] + (nb * block_size,))
    padded[..., :k] = a
    return padded.reshape(a.shape[:-1] + (nb, block_size)), nb


def _pairs(byte: np.ndarray) -> np.ndarray:
    nb = byte.shape[-1]
    out = np.zeros(byte.shape[:-1] + (nb + nb % 2,), dtype=np.uint8)
    out[..., :nb] = byte
    return out.reshape(byte.shape[:-1] + ((nb + nb % 2) // 2, 2))


def pack(codes: np.ndarray) -> np.ndarray:
    """Element 2t -> low nibble, 2t+1 -> high nibble of byte t (last axis)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def quantize(
    x: torch.Tensor,
    dst,
    *,
    axis: int = -1,
    round_mode: str = "rint",
    scale_alg: int = 0,
    block_size: int = 32,
    dst_type_max: float = 0.0,
    max_low_bound: float = 0.0,
):
    """(y bytes, scale bytes) as `npu_dynamic_mx_quant` lays them out (numpy uint8)."""
    fmt = fmt_name(dst)
    axis = axis % x.dim()
    a = np.moveaxis(x.double().numpy(), axis, -1)
    k = a.shape[-1]
    blocks, nb = _blocks(a, block_size)
    byte, flush = scale_bytes(blocks, fmt, scale_alg, x.dtype, dst_type_max, max_low_bound)
    safe = np.where(byte == 255, 127, byte)
    with np.errstate(invalid="ignore", over="ignore"):
        v = blocks * np.ldexp(1.0, 127 - safe)[..., None]  # exact: a power-of-two scaling in float64
        v = v.astype(np.float32).astype(np.float64)  # the spec scales in fp32 (§4.1): tiny products underflow
    v = np.where(flush[..., None], np.copysign(0.0, blocks), v)
    v = np.where((byte == 255)[..., None], 0.0, v)  # non-finite blocks: +0 elements
    codes = encode(v, fmt, round_mode).reshape(a.shape[:-1] + (nb * block_size,))[..., :k]
    codes = np.moveaxis(codes, -1, axis)
    y = pack(codes) if fmt == "e2m1" else codes
    scale = np.moveaxis(_pairs(byte.astype(np.uint8)), -2, axis)
    return np.ascontiguousarray(y), np.ascontiguousarray(scale)


def decode(y: np.ndarray, fmt: str) -> np.ndarray:
    """Element bytes -> float64 values; packed FP4 is unpacked along the last axis."""
    if fmt == "e2m1":
        codes = np.stack([y & 0xF, y >> 4], axis=-1).reshape(y.shape[:-1] + (2 * y.shape[-1],))
        mag = FP4_MAGNITUDES[codes & 7]
        return np.where(codes & 8, -mag, mag)
    return y.view(FORMATS[fmt][2]).astype(np.float64)


def dequantize(y: np.ndarray, scale: np.ndarray, fmt: str, block_size: int = 32, axis: int = -1) -> np.ndarray:
    """float64 values: element * 2^(byte-127), NaN where byte is 0xFF; `axis` = the quantized axis."""
    values = decode(y, fmt)
    axis = axis % values.ndim
    values = np.moveaxis(values, axis, -1)
    scale = np.moveaxis(scale, axis, -2)
    k = values.shape[-1]
    per_block = scale.reshape(scale.shape[:-2] + (-1,)).astype(np.int64)
    s = per_block[..., np.arange(k) // block_size]
    out = np.where(s == 255, np.nan, values * np.ldexp(1.0, s - 127))
    return np.moveaxis(out, -1, axis)


def element_ulp(v: np.ndarray, fmt: str) -> np.ndarray:
    """Spacing of the element grid in the binade of |v| (subnormal spacing below the min normal)."""
    mant, emin = FORMATS[fmt][3], FORMATS[fmt][4]
    e = floor_log2(np.where(v == 0, 1.0, np.abs(v)))
    return np.ldexp(1.0, np.maximum(e, emin) - mant)


# --- converter quantizer (§8.2), written literally ----------------------------------------------------


def convert_weight(w: torch.Tensor, fmt: str):
    """(data bytes, per-block scale bytes [..., ceil(K/32)]) of the offline converter."""
    emax, maxval, np_type, mb, pmin = FORMATS[fmt]
    blocks, nb = _blocks(w.double().numpy(), 32)
    k = w.shape[-1]
    amax = np.abs(blocks).max(-1)
    safe = np.where(amax == 0, 1.0, amax)
    e = floor_log2(safe)
    e = e + (safe / np.ldexp(1.0, e) > 1.75)  # "round2decimal": bump when the mantissa exceeds 1.75
    shared = np.where(amax == 0, -127, np.maximum(e - emax, -127))
    a = blocks / np.ldexp(1.0, shared)[..., None]
    p = np.where(a == 0, pmin, np.maximum(floor_log2(np.where(a == 0, 1.0, np.abs(a))), pmin))
    q = np.copysign(np.floor(np.abs(a) * np.ldexp(1.0, mb - p) + 0.5) * np.ldexp(1.0, p - mb), a)
    q = np.clip(q, -maxval, maxval)
    if fmt == "e2m1":
        mag = np.searchsorted(FP4_MAGNITUDES, np.abs(q))
        codes = (mag | (np.signbit(q).astype(np.int64) << 3)).astype(np.uint8)
        data = pack(codes.reshape(blocks.shape[:-2] + (-1,))[..., :k])
    else:
        data = q.astype(np_type).view(np.uint8).reshape(blocks.shape[:-2] + (-1,))[..., :k]
    return np.ascontiguousarray(data), (shared + 127).astype(np.uint8)


# --- adversarial inputs (§11) -------------------------------------------------------------------------

BLOCK_KINDS = ("gauss", "raw", "ties", "boundary", "tiny", "zero", "special", "huge")


def mx_inputs(seed: int, shape, dtype: torch.dtype, kinds=BLOCK_KINDS, block_size: int = 32) -> torch.Tensor:
    """A tensor whose 32-element blocks along the last axis each get a kind: gaussian at a random binade,
    raw bit patterns (subnormals, NaN, Inf included), exact ties on the element grids, values next to
    power-of-two and mantissa 1.5 / 1.75 boundaries, tiny (flush region), all-zero, gaussian with an
    Inf/NaN/-0 planted, and huge (near the dtype's max)."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    k = shape[-1]
    nb = math.ceil(k / block_size)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    n = (rows, nb * block_size)
    binade = torch.randint(-30, 30, (rows, nb, 1), generator=g).float()
    gauss = (torch.randn(n, generator=g).view(rows, nb, block_size) * torch.exp2(binade)).view(n)
    bits = {torch.float32: 32}.get(dtype, 16)
    raw = torch.randint(0, 2**bits, n, generator=g, dtype=torch.int64)
    raw = (raw.to(torch.int32).view(torch.float32) if bits == 32 else raw.to(torch.int16).view(dtype)).float()
    ties = torch.randint(-96, 97, n, generator=g).float().view(rows, nb, block_size) / 16
    ties = ties * torch.exp2(torch.floor(binade / 3))  # multiples of 1/16 at a power-of-two scale: exact ties
    mant = torch.tensor([1.0, 1.5, 1.5 + 2**-7, 1.75, 1.75 + 2**-7, 2 - 2**-7, 1.25, 1 + 2**-7])
    pick = mant[torch.randint(0, len(mant), n, generator=g)]
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    boundary = sign * pick * torch.exp2(torch.randint(-3, 4, n, generator=g).float())
    tiny = gauss.view(rows, nb, block_size) / torch.exp2(binade) * 2.0**-122
    huge_max = {torch.float16: 60000.0, torch.bfloat16: 3e38, torch.float32: 3e38}[dtype]
    huge = torch.rand(n, generator=g) * huge_max * sign
    special = gauss.clone()
    plant = torch.randint(0, block_size, (rows, nb), generator=g) + torch.arange(nb) * block_size
    values = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    special.scatter_(1, plant, values[torch.randint(0, 4, (rows, nb), generator=g)])
    table = {
        "gauss": gauss,
        "raw": raw,
        "ties": ties.reshape(n),
        "boundary": boundary,
        "tiny": tiny.reshape(n),
        "zero": torch.zeros(n),
        "special": special,
        "huge": huge,
    }
    choice = torch.tensor([BLOCK_KINDS.index(kd) for kd in kinds])[
        torch.randint(0, len(kinds), (rows, nb), generator=g)
    ]
    stacked = torch.stack([table[kd] for kd in BLOCK_KINDS])  # [kinds, rows, nb*bs]
    per_elem = choice.repeat_interleave(block_size, dim=1)
    x = stacked.gather(0, per_elem.unsqueeze(0)).squeeze(0)[:, :k]
    return x.reshape(shape).to(dtype)
