"""MX (microscaling) formats: element encodings, E8M0 scale bytes, FP4 packing, the three scale rules, and the
quantize / dequantize cores behind the MX operators (`mx.py`), the MX grouped matmul (`gmm.py`) and the offline
weight converter (`mx_quantize_weight`). Spec: mx_quant.md; section numbers below refer to it.

Conventions (normative, §0-§2):
- block = 32 consecutive elements along the quantized axis; one E8M0 byte per block, value 2^(byte-127),
  byte 0xFF = NaN. Scale bytes are always carried as torch.uint8 (never converted with a torch cast).
- runtime scale layout: `[..., ceil(nb/2), 2]` with `[..., i, j]` = block 2i+j; an odd last slot is byte 0.
- packed FP4 E2M1: torch.uint8, element 2t in the low nibble of byte t, element 2t+1 in the high nibble.
- FP8 elements are real torch float8 tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# torch_npu's dtype codes for the `int *_dtype` arguments (§1.6), under torch_npu's attribute names so that
# code written against `torch_npu.<name>` runs unchanged with `mx_format.<name>`.
int4 = 285
hifloat8 = 290
float8_e5m2 = 291
float8_e4m3fn = 292
float8_e8m0fnu = 293
float4_e2m1fn_x2 = 296
float4_e1m2fn_x2 = 297

BLOCK_SIZE = 32


@dataclass(frozen=True)
class MxFormat:
    """An MX element format: `emax` (exponent of the largest power of two), `maxval`, the fp8 torch dtype
    (None for packed FP4) and the fp32 bits of fp32(1/maxval) used by the RCEIL rule (§3.2)."""

    name: str
    emax: int
    maxval: float
    torch_dtype: torch.dtype | None
    inv_max_bits: int | None

    @property
    def packed(self) -> bool:
        return self.torch_dtype is None


E4M3 = MxFormat("float8_e4m3fn", 8, 448.0, torch.float8_e4m3fn, 0x3B124925)
E5M2 = MxFormat("float8_e5m2", 15, 57344.0, torch.float8_e5m2, 0x37924925)
E2M1 = MxFormat("float4_e2m1fn", 2, 6.0, None, None)

# dst_type / src_type code -> format; 23/24 are torch's ScalarType numbers, 291/292/296 torch_npu's.
FORMATS: dict[int, MxFormat] = {23: E5M2, 291: E5M2, 24: E4M3, 292: E4M3, 296: E2M1}
_TORCH_DTYPE_CODES = {
    torch.float8_e5m2: 23,
    torch.float8_e4m3fn: 24,
    torch.bfloat16: 15,
    torch.float16: 5,
    torch.float32: 6,
    torch.uint8: 0,
}

# FP4 E2M1 magnitudes by 3-bit code (§1.3).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_ROUND_MODES = ("rint", "round", "floor")


def dtype_code(value) -> int:
    """An `int` dtype argument as its integer code; accepts torch.dtype objects and IntEnum-like constants."""
    if isinstance(value, torch.dtype):
        if value not in _TORCH_DTYPE_CODES:
            raise ValueError(f"dtype {value} has no MX dtype code; known: {sorted(map(str, _TORCH_DTYPE_CODES))}")
        return _TORCH_DTYPE_CODES[value]
    return int(value)


# --- fp32 bit helpers ---------------------------------------------------------------------------------


def exponent_field(xf: torch.Tensor) -> torch.Tensor:
    """Biased fp32 exponent field as int32: 0 for zero/subnormal, 255 for Inf/NaN."""
    return (xf.contiguous().view(torch.int32) >> 23) & 0xFF


def pow2(exp: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^exp for integer exp in [-149, 127] (built from bits: subnormals included)."""
    exp = exp.to(torch.int32)
    normal = (exp + 127).clamp(1, 254) << 23
    subnormal = torch.ones_like(exp) << (exp + 149).clamp(0, 22)
    return torch.where(exp >= -126, normal, subnormal).view(torch.float32)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu storage) -> fp32 2^(b-127); 0xFF -> NaN (§1.5)."""
    b = as_scale_bytes(scale).to(torch.int32)
    value = pow2(b - 127)
    return torch.where(b == 255, torch.full_like(value, float("nan")), value)


def as_scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """The raw bytes of an E8M0 scale tensor: uint8 as is, float8_e8m0fnu reinterpreted (never converted)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise ValueError(f"MX scale has dtype {scale.dtype}; allowed: torch.uint8, torch.float8_e8m0fnu")
    return scale


# --- scale layout and FP4 packing ---------------------------------------------------------------------


def pair_scales(byte: torch.Tensor) -> torch.Tensor:
    """Per-block bytes `[..., nb]` -> runtime layout `[..., ceil(nb/2), 2]`, odd tail slot = byte 0 (§2.2)."""
    nb = byte.shape[-1]
    if nb % 2:
        byte = torch.nn.functional.pad(byte, (0, 1), value=0)
    return byte.unflatten(-1, (byte.shape[-1] // 2, 2))


def unpair_scales(pairs: torch.Tensor, nb: int) -> torch.Tensor:
    """Runtime layout `[..., ceil(nb/2), 2]` -> per-block bytes `[..., nb]`."""
    return pairs.flatten(-2)[..., :nb]


def pack_fp4(codes: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """4-bit codes (uint8, even length along `dim`) -> bytes: element 2t low nibble, 2t+1 high nibble (§1.3)."""
    c = codes.movedim(dim, -1).to(torch.uint8)
    if c.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the packed axis has odd length {c.shape[-1]}; FP4 packs element pairs")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).movedim(-1, dim)


def unpack_fp4(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Bytes -> 4-bit codes (uint8) with `dim` doubled: byte t gives elements 2t (low) and 2t+1 (high)."""
    b = packed.movedim(dim, -1)
    codes = torch.stack((b & 0xF, (b >> 4) & 0xF), dim=-1).flatten(-2)
    return codes.movedim(-1, dim)


def decode_fp4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes -> fp32 values (sign bit 3, -0.0 for code 8)."""
    table = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.to(torch.int64)]


def decode_elements(data: torch.Tensor, fmt: MxFormat, dim: int = -1) -> torch.Tensor:
    """Element values as fp32: fp8 tensors upcast, packed FP4 unpacked along `dim` and decoded."""
    if fmt.packed:
        return decode_fp4(unpack_fp4(data, dim))
    return data.float()


def expand_scales(pairs: torch.Tensor, length: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Runtime-layout scale bytes `[..., ceil(nb/2), 2]` -> fp32 factor per element `[..., length]`."""
    nb = math.ceil(length / block_size)
    per_block = e8m0_to_float(unpair_scales(as_scale_bytes(pairs), nb))
    return per_block.repeat_interleave(block_size, dim=-1)[..., :length]


def dequantize(data: torch.Tensor, pairs: torch.Tensor, fmt: MxFormat, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """fp32 decode of an MX tensor quantized along its last axis: element value * 2^(byte-127) (§5)."""
    values = decode_elements(data, fmt)
    return values * expand_scales(pairs, values.shape[-1], block_size)


def fp4_packed_axis(shape, k: int) -> int | None:
    """Which axis of a packed FP4 weight `[..., K or K/2, N or N/2]` holds the pairs, decided by the K the
    activation implies (§7.1): -2 for `[..., K/2, N]` (packed along K), -1 for `[..., K, N/2]`; None if neither."""
    if 2 * shape[-2] == k:
        return -2
    if shape[-2] == k:
        return -1
    return None


def dequantize_weight(w: torch.Tensor, scale: torch.Tensor, fmt: MxFormat, k: int) -> torch.Tensor:
    """fp32 logical `[..., K, N]` weight from its view (any strides) and scale `[..., ceil(K/64), N, 2]`:
    element (k, n) uses byte `scale[..., k // 64, n, (k // 32) % 2]` (§5, §6.5, §6.6)."""
    if fmt.packed:
        axis = fp4_packed_axis(w.shape, k)
        if axis is None:
            raise ValueError(
                f"dequantize_weight: FP4 weight view {tuple(w.shape)} is neither [..., K/2, N] nor "
                f"[..., K, N/2] for K={k}"
            )
        values = decode_fp4(unpack_fp4(w, axis))
    else:
        values = w.float()
    factors = expand_scales(scale.movedim(-3, -2), k).transpose(-1, -2)  # [..., N, K] -> [..., K, N]
    return values * factors


# --- scale rules (§3) ---------------------------------------------------------------------------------


def _recip_from_byte(byte: torch.Tensor) -> torch.Tensor:
    """2^(127-byte) in fp32 for byte in [0, 254] (byte 254 -> 2^-127, an fp32 subnormal)."""
    return pow2(127 - byte.clamp(0, 254))


def _rceil_byte(amax: torch.Tensor, inv_bits: int, subnormal_rule: bool) -> torch.Tensor:
    """byte = ceil-exponent of fp32(amax * INV), computed on the bits as the kernel does (§3.2)."""
    inv = torch.tensor(inv_bits, dtype=torch.int32).view(torch.float32).item()
    bits = (amax * inv).view(torch.int32)
    e, m = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    bump = (e > 0) & (e < 254) & (m > 0)
    if subnormal_rule:
        bump = bump | ((e == 0) & (m > 0x400000))
    return e + bump.to(torch.int32)


def _bf16_bits(amax: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
    """The bf16 image of amax (§3.3): RNE for fp16 inputs, truncation for fp32, exact for bf16."""
    if input_dtype == torch.float16:
        return amax.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return (amax.view(torch.int32) >> 16) & 0xFFFF


def block_scales(
    blocks: torch.Tensor,
    fmt: MxFormat,
    scale_alg: int,
    input_dtype: torch.dtype,
    dst_type_max: float = 0.0,
    max_low_bound: float = 0.0,
):
    """Scale bytes (int32 `[..., nb]`) and fp32 reciprocals for fp32 blocks `[..., nb, bs]`.

    A reciprocal of 0 flushes the block to signed zeros (the NPU's rule for byte 0 under alg 0 and the
    bf16 form of alg 2); byte 255 marks a non-finite block.
    """
    if scale_alg == 0:
        emax_field = exponent_field(blocks).amax(-1)
        byte = torch.where(emax_field == 255, 255, (emax_field - fmt.emax).clamp_min(0))
        flush = byte == 0
    else:
        amax = blocks.abs().amax(-1)  # NaN-propagating
        nonfinite = ~torch.isfinite(amax)
        zero = amax == 0
        if scale_alg == 1:
            a = amax.clamp_min(max_low_bound) if max_low_bound > 0 else amax
            byte = torch.where(zero, 0, _rceil_byte(a, fmt.inv_max_bits, subnormal_rule=True))
            flush = zero
        elif dst_type_max in (0.0, 6.0, 7.0):
            h = _bf16_bits(amax, input_dtype)
            exp = h & 0x7F80
            eb = (h + (0x1F if dst_type_max == 7.0 else 0x3F)) & 0x7F80
            eb = torch.where(exp < 0x100, 0x100, eb)
            byte = torch.where(exp == 0x7F80, 255, (eb - 0x100) >> 7)
            flush = byte == 0
        else:
            inv_bits = torch.tensor(1.0 / dst_type_max, dtype=torch.float32).view(torch.int32).item()
            byte = _rceil_byte(amax, inv_bits, subnormal_rule=False)
            flush = zero
        byte = torch.where(nonfinite, 255, byte)
    recip = torch.where(flush, 0.0, _recip_from_byte(byte))
    return byte.to(torch.int32), recip


# --- element encoding (§4) ----------------------------------------------------------------------------


def encode_fp8(v: torch.Tensor, fmt: MxFormat) -> torch.Tensor:
    """fp32 -> fp8 bytes (uint8): RNE with subnormals, saturated to ±maxval (clamp first: §4.2)."""
    return v.clamp(-fmt.maxval, fmt.maxval).to(fmt.torch_dtype).view(torch.uint8)


# (threshold, inclusive) steps of the magnitude code (§4.3): code = number of steps passed.
_FP4_STEPS = {
    "rint": ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)),
    "round": ((0.25, True), (0.75, True), (1.25, True), (1.75, True), (2.5, True), (3.5, True), (5.0, True)),
}
_FLOOR_UP = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # positive values: truncate the magnitude
_FLOOR_DOWN = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)  # negative values: the magnitude rounds up


def encode_fp4(v: torch.Tensor, round_mode: str) -> torch.Tensor:
    """fp32 -> 4-bit E2M1 codes (uint8, unpacked), saturating at ±6; signed zeros keep their sign."""
    m, neg = v.abs(), torch.signbit(v)
    code = torch.zeros(v.shape, dtype=torch.int32, device=v.device)
    if round_mode == "floor":
        up = sum(((m >= t).to(torch.int32) for t in _FLOOR_UP), code)
        down = sum(((m > t).to(torch.int32) for t in _FLOOR_DOWN), code).clamp_max(7)
        code = torch.where(neg, down, up)
    else:
        for t, inclusive in _FP4_STEPS[round_mode]:
            code = code + ((m >= t) if inclusive else (m > t)).to(torch.int32)
    return (code | (neg.to(torch.int32) << 3)).to(torch.uint8)


# --- quantize -----------------------------------------------------------------------------------------


def quantize_lastdim(
    x: torch.Tensor,
    fmt: MxFormat,
    *,
    round_mode: str = "rint",
    scale_alg: int = 0,
    block_size: int = BLOCK_SIZE,
    dst_type_max: float = 0.0,
    max_low_bound: float = 0.0,
):
    """MX-quantize along the last axis, no validation: (codes uint8 `[..., K]` unpacked, bytes int32 `[..., nb]`).

    codes are fp8 bytes or 4-bit FP4 codes; elements of non-finite blocks are +0 (§4.4).
    """
    k = x.shape[-1]
    nb = math.ceil(k / block_size)
    xf = torch.nn.functional.pad(x.float(), (0, nb * block_size - k))
    blocks = xf.unflatten(-1, (nb, block_size))
    byte, recip = block_scales(blocks, fmt, scale_alg, x.dtype, dst_type_max, max_low_bound)
    v = blocks * recip.unsqueeze(-1)
    codes = encode_fp4(v, round_mode) if fmt.packed else encode_fp8(v, fmt)
    codes = torch.where((byte == 255).unsqueeze(-1), 0, codes).to(torch.uint8)
    return codes.flatten(-2)[..., :k], byte


def mx_quantize(
    x: torch.Tensor,
    fmt: MxFormat,
    *,
    axis: int = -1,
    round_mode: str = "rint",
    scale_alg: int = 0,
    block_size: int = BLOCK_SIZE,
    dst_type_max: float = 0.0,
    max_low_bound: float = 0.0,
):
    """`npu_dynamic_mx_quant` semantics without validation: (y, scale) per §6.1.

    y: fp8 tensor shaped like x, or uint8 packed FP4 with the LAST dim halved whatever the axis.
    scale: uint8, x's shape with `axis` -> ceil(nb/2) and a trailing pair dim (§2.2).
    """
    axis = axis % x.dim()
    codes, byte = quantize_lastdim(
        x.movedim(axis, -1),
        fmt,
        round_mode=round_mode,
        scale_alg=scale_alg,
        block_size=block_size,
        dst_type_max=dst_type_max,
        max_low_bound=max_low_bound,
    )
    codes = codes.movedim(-1, axis)
    y = pack_fp4(codes) if fmt.packed else codes.view(fmt.torch_dtype)
    scale = pair_scales(byte.to(torch.uint8)).movedim(-2, axis)
    return y.contiguous(), scale.contiguous()


# --- offline weight conversion (§8.2) -----------------------------------------------------------------


def mx_quantize_weight(w: torch.Tensor, fmt: MxFormat):
    """The checkpoint converter's quantizer (§8.2), blocks of 32 along the last axis, zero-padded tail.

    Scale: 2^(floor(log2 amax) - emax), the exponent bumped when amax's mantissa > 1.75, clamped below at
    2^-127; elements rounded half AWAY from zero on the element grid, then clamped to ±maxval.
    Returns (data, scale): data float8_e4m3fn `[..., K]` (E4M3) or uint8 `[..., K/2]` packed FP4 (E2M1);
    scale uint8 `[..., ceil(K/32)]` (per-block bytes, not paired: the checkpoint layout of §8.1).
    """
    if fmt not in (E4M3, E2M1):
        raise ValueError(f"mx_quantize_weight: format {fmt.name}; allowed: {E4M3.name}, {E2M1.name}")
    k = w.shape[-1]
    if fmt.packed and k % 2:
        raise ValueError(f"mx_quantize_weight: FP4 needs an even last dim; got shape {tuple(w.shape)}")
    nb = math.ceil(k / BLOCK_SIZE)
    x = torch.nn.functional.pad(w.float(), (0, nb * BLOCK_SIZE - k)).unflatten(-1, (nb, BLOCK_SIZE))
    mantissa, exponent = torch.frexp(x.abs().amax(-1))  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    shared = (exponent - 1 + (mantissa > 0.875).to(exponent.dtype) - fmt.emax).clamp_min(-127)
    shared = torch.where(mantissa > 0, shared, torch.full_like(shared, -127))  # an all-zero block: byte 0
    a = x * pow2(-shared).unsqueeze(-1)  # exact: power-of-two scaling
    byte = (shared + 127).to(torch.uint8)
    if fmt is E4M3:
        magnitude = a.abs()
        p = (torch.frexp(magnitude).exponent - 1).clamp_min(-6)  # binade; subnormal spacing 2^-9 below 2^-6
        units = torch.floor(magnitude * pow2(3 - p) + 0.5)  # half away from zero on the element grid
        q = torch.copysign((units * pow2(p - 3)).clamp_max(fmt.maxval), a)
        data = q.flatten(-2)[..., :k].to(torch.float8_e4m3fn)
    else:
        data = pack_fp4(encode_fp4(a, "round").flatten(-2)[..., :k])  # ties away from zero, saturating at 6
    return data.contiguous(), byte.contiguous()


def scale_name(weight_name: str) -> str:
    """The checkpoint name of an MX weight's per-block scale bytes (`...weight` -> `...weight_scale`)."""
    return weight_name.removesuffix("weight") + "weight_scale"
