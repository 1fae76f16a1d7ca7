"""MX fake quantization for the reference model: quantize, then dequantize, at the points the quantized model does.

A plain restatement of the MX rules (spec mx_quant.md, a4w4_hadamard.md) in float64 so every step is exact, the tight
oracle of the quantized optimized model; nothing here comes from `optimized/`. A block is 32 values of the last axis
sharing one scale 2^(byte - 127). Weights, as the converter writes them: exponent floor(log2 amax), +1 when amax's
mantissa exceeds 1.75, minus the format's emax, elements half away from zero. Activations, as the model quantizes
them at run time: E4M3 exponent floor(log2 amax) - 8, FP4 floor(log2 amax) - 2, half to even, saturated at the
format's max, a block whose scale byte would be 0 written as zeros.

`SCHEMES` gives each scheme's (attention weight, expert weight, activation) formats; the points are the q/k/v/o and
expert weights and those linears' inputs (the SwiGLU product formed in fp32 and rounded once); norms, router,
embeddings and lm_head stay unquantized. With the Hadamard rotation the inputs are rotated online and the weights
offline as the model and converter do.

    model = load_fake_quant_model(path, torch.bfloat16, scheme="w4a8")  # "w8a8", "w4a4" (hadamard_weight_path=)
    fake_quantize(model, "w4a8")     # in place, on a model already loaded
    fake_quantize_kv_cache(model)    # and the per-token FP8 KV cache (what later steps read)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 32


@dataclass(frozen=True)
class ElementFormat:
    name: str
    emax: int  # exponent of the largest binade (448 = 1.75 * 2^8, 6 = 1.5 * 2^2)
    mantissa_bits: int
    min_exponent: int  # exponent of the smallest normal binade; below it the grid spacing stays fixed
    max: float


E4M3 = ElementFormat("float8_e4m3fn", emax=8, mantissa_bits=3, min_exponent=-6, max=448.0)
E2M1 = ElementFormat("float4_e2m1", emax=2, mantissa_bits=1, min_exponent=0, max=6.0)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 |a|) for a != 0, exactly (frexp: a = m * 2^e with 0.5 <= |m| < 1)."""
    _, exponent = torch.frexp(a)
    return exponent.double() - 1


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> float64 [..., ceil(K/32), 32], the tail padded with zeros (they never change a block's amax)."""
    k = x.shape[-1]
    padded = F.pad(x.double(), (0, -k % BLOCK))
    return padded.unflatten(-1, (-1, BLOCK))


def round_to_grid(a: torch.Tensor, fmt: ElementFormat, ties: str) -> torch.Tensor:
    """Round float64 `a` to the nearest value of `fmt` (ties "even" or "away" from zero), saturating at fmt.max."""
    magnitude = a.abs()
    exponent = torch.where(magnitude > 0, _floor_log2(magnitude), torch.zeros_like(a)).clamp_min(fmt.min_exponent)
    step = torch.exp2(exponent - fmt.mantissa_bits)  # grid spacing of a's binade
    units = magnitude / step  # exact: division by a power of two
    units = torch.round(units) if ties == "even" else torch.floor(units + 0.5)
    return torch.copysign((units * step).clamp_max(fmt.max), a)  # the sign survives a rounding to zero


@dataclass
class MXTensor:
    """Elements on the format's grid (float64, unscaled) and one scale byte per 32-block: value = q * 2^(s-127)."""

    elements: torch.Tensor  # [..., K] float64
    scale: torch.Tensor  # [..., ceil(K/32)] uint8 (255 = NaN block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        k = self.elements.shape[-1]
        factor = torch.exp2(self.scale.double() - 127)
        factor = torch.where(self.scale == 255, torch.nan, factor)
        blocks = _blocks(self.elements) * factor[..., None]
        return blocks.flatten(-2)[..., :k].to(dtype)


def quantize_weight(w: torch.Tensor, fmt: ElementFormat) -> MXTensor:
    """The converter's rule (§8.2) along the last axis: scale 2^ceil-ish(amax), ties away from zero."""
    x = _blocks(w)  # [..., nb, 32]
    amax = x.abs().amax(-1)  # [..., nb]
    e = _floor_log2(amax)
    mantissa = amax / torch.exp2(e)  # in [1, 2)
    e = torch.where(mantissa > 1.75, e + 1, e)
    shared = (e - fmt.emax).clamp_min(-127)
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -127))  # zero block: byte 0
    q = round_to_grid(x / torch.exp2(shared)[..., None], fmt, ties="away")
    return MXTensor(q.flatten(-2)[..., : w.shape[-1]], (shared + 127).to(torch.uint8))


def quantize_activation(x: torch.Tensor, fmt: ElementFormat = E4M3) -> MXTensor:
    """Run-time MX quantization, MXFP8 E4M3 or MXFP4 E2M1 (§3.1 scale_alg 0, round half to even, §4.4 non-finite
    blocks)."""
    b = _blocks(x)
    amax = b.abs().amax(-1)
    finite = torch.isfinite(b).all(-1)
    exponent = torch.where(amax > 0, _floor_log2(torch.where(finite, amax, 1.0)), torch.full_like(amax, -1000.0))
    byte = (exponent + 127 - fmt.emax).clamp(0, 254)  # fp32-exponent of amax minus emax, >= 0
    byte = torch.where(finite, byte, torch.full_like(byte, 255))
    flush = (byte == 0) | (byte == 255)  # tiny blocks -> signed zeros; NaN blocks -> 0
    scaled = torch.where(finite[..., None], b, 0.0) / torch.exp2(byte - 127)[..., None]
    q = round_to_grid(scaled, fmt, ties="even")
    q = torch.where(flush[..., None], q * 0.0, q)
    return MXTensor(q.flatten(-2)[..., : x.shape[-1]], byte.to(torch.uint8))


def fake_quant_weight(w: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    return quantize_weight(w, fmt).dequantize(w.dtype)


def fake_quant_activation(x: torch.Tensor, fmt: ElementFormat = E4M3) -> torch.Tensor:
    return quantize_activation(x, fmt).dequantize(x.dtype)


ROTATION = 128  # the rotation's block: 128 consecutive features of a linear's input (not a head)


def rotate(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x [..., K] times t [128, 128] on every 128-feature block, in float32, rounded back to x's dtype."""
    if x.shape[-1] % ROTATION:
        raise ValueError(f"the rotation needs a multiple of {ROTATION} features, got {x.shape[-1]}")
    return (x.float().reshape(-1, ROTATION) @ t.float()).reshape(x.shape).to(x.dtype)


class FakeQuantLinear(nn.Module):
    """y = MX(x) @ MX(W)^T, both operands quantize-dequantized (exact in bf16 and fp32); activations MXFP8 (`act`
    E4M3) or MXFP4 (E2M1). With `rotation` T: x is rotated first, and W (stored as `source_dtype`) was rotated by
    inverse(T)^T and rounded to that dtype before its quantization, as the converter does."""

    def __init__(
        self,
        linear: nn.Linear,
        fmt: ElementFormat,
        act: ElementFormat = E4M3,
        rotation: torch.Tensor | None = None,
        source_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        w = linear.weight.detach()
        if rotation is not None:
            w = rotate(w.to(source_dtype or w.dtype), torch.linalg.inv(rotation.float()).T).to(w.dtype)
        self.weight = nn.Parameter(fake_quant_weight(w, fmt), requires_grad=False)
        self.act = act
        self.rotation = rotation  # a plain attribute: stays float32 when the model is cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotation is not None:
            x = rotate(x, self.rotation)
        return F.linear(fake_quant_activation(x, self.act), self.weight)


class FakeQuantMLP(nn.Module):
    """SwiGLU with quantized linears; the product silu(gate) * up is formed in fp32 and rounded once to the
    activation dtype before down_proj quantizes it (the W4A8 path's fused SwiGLU + MX quantization, §6.4)."""

    def __init__(self, mlp: nn.Module, fmt: ElementFormat, act: ElementFormat = E4M3):
        super().__init__()
        self.gate_proj = FakeQuantLinear(mlp.gate_proj, fmt, act)
        self.up_proj = FakeQuantLinear(mlp.up_proj, fmt, act)
        self.down_proj = FakeQuantLinear(mlp.down_proj, fmt, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = F.silu(self.gate_proj(x).float()) * self.up_proj(x).float()
        return self.down_proj(product.to(x.dtype))


# scheme -> (attention weights, expert weights, activations) element formats
SCHEMES = {"w4a8": (E4M3, E2M1, E4M3), "w8a8": (E4M3, E4M3, E4M3), "w4a4": (E2M1, E2M1, E2M1)}
ROTATION_KEYS = ("input_transform.transform.linear.weight", "out_transform.transform.linear.weight")


def load_rotations(directory, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(T_in, T_out) float32 of each decoder layer from `directory/layer_{i}_self_attn.pt` (§1.2)."""
    from pathlib import Path

    out = []
    for i in range(num_layers):
        data = torch.load(Path(directory) / f"layer_{i}_self_attn.pt", map_location="cpu", weights_only=True)
        out.append(tuple(data[key].float() for key in ROTATION_KEYS))
    return out


def fake_quantize(
    model: nn.Module, scheme: str = "w4a8", rotations=None, source_dtype: torch.dtype | None = None
) -> nn.Module:
    """Replace the reference model's quantized linears by FakeQuantLinear, in place (W4A8 / W8A8 placement,
    §8.1/§9; W4A4 with optional per-layer rotations (T_in, T_out), the weights stored as `source_dtype`)."""
    if scheme not in SCHEMES:
        raise ValueError(f"fake-quant scheme {scheme!r} is not supported; supported: {', '.join(SCHEMES)}")
    if rotations is not None and scheme != "w4a4":
        raise ValueError(f"the Hadamard rotation applies to W4A4 only, not {scheme}")
    attn_fmt, expert_fmt, act = SCHEMES[scheme]
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        t_in, t_out = rotations[i] if rotations is not None else (None, None)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t = t_out if name == "o_proj" else t_in
            setattr(attn, name, FakeQuantLinear(getattr(attn, name), attn_fmt, act, t, source_dtype))
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts = nn.ModuleList(FakeQuantMLP(expert, expert_fmt, act) for expert in layer.mlp.experts)
        else:
            layer.mlp = FakeQuantMLP(layer.mlp, attn_fmt, act)
    return model


# ------------------------------------------------------------------------------- per-token FP8 KV cache
#
# The recipe's FP8 KV cache (spec npu_ops_attention_norm.md §8, §5.7): each token's K (and V) row over the KV
# heads one rank holds gets one fp32 scale, amax times the fp32 constant 1/448; elements are x / scale in fp32,
# rounded half to even onto the E4M3 grid and saturated at 448; the value read back is element * scale.
# A prompt attends to its own 16-bit K/V (prefill); every later step reads the cache: all of it quantized.

KV_MAX = E4M3.max


def fake_quant_kv(x: torch.Tensor, heads_per_scale: int) -> torch.Tensor:
    """x [B, KV, S, D] -> quantize-dequantized per token, one scale per `heads_per_scale` consecutive KV heads."""
    b, kv, s, d = x.shape
    if kv % heads_per_scale:
        raise ValueError(f"heads_per_scale={heads_per_scale} does not divide the {kv} KV heads")
    rows = x.double().transpose(1, 2).reshape(b, s, kv // heads_per_scale, heads_per_scale * d)
    f32 = lambda t: t.float().double()  # noqa: E731  (round to fp32, keep computing in fp64)
    scale = f32(rows.abs().amax(-1, keepdim=True) * f32(torch.tensor(1.0 / KV_MAX)))
    q = torch.where(scale > 0, f32(rows / torch.where(scale > 0, scale, 1.0)), torch.zeros_like(rows))
    values = round_to_grid(q, E4M3, ties="even") * scale
    return values.reshape(b, s, kv, d).transpose(1, 2).to(x.dtype)


class FakeQuantKVLayerCache:
    """A reference LayerCache whose stored K/V are per-token FP8 quantize-dequantized."""

    def __init__(self, heads_per_scale: int):
        from reference.model import LayerCache

        self.inner, self.heads_per_scale = LayerCache(), heads_per_scale

    @property
    def length(self) -> int:
        return self.inner.length

    def update(self, k: torch.Tensor, v: torch.Tensor):
        prefill = self.inner.length == 0
        ks, vs = self.inner.update(fake_quant_kv(k, self.heads_per_scale), fake_quant_kv(v, self.heads_per_scale))
        return (k, v) if prefill else (ks, vs)


def fake_quantize_kv_cache(model: nn.Module, heads_per_scale: int | None = None) -> nn.Module:
    """Make `model.new_cache()` hand out the FP8 per-token cache, in place. heads_per_scale: the KV heads one
    scale covers (default all: one rank; a TP-sharded model shares a scale over each rank's KV heads)."""
    from reference.model import KVCache

    heads = heads_per_scale or model.config.num_key_value_heads

    def new_cache() -> KVCache:
        cache = KVCache(model.config.num_hidden_layers)
        cache.layers = [FakeQuantKVLayerCache(heads) for _ in cache.layers]
        return cache

    model.new_cache = new_cache
    return model


def _stored_dtype(path) -> torch.dtype:
    """The dtype the checkpoint stores its attention weights in (the converter's rotation rounds back to it)."""
    from pathlib import Path

    from safetensors import safe_open

    names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            if "model.layers.0.self_attn.q_proj.weight" in f.keys():
                return names[f.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype()]
    raise ValueError(f"{path}: no model.layers.0.self_attn.q_proj.weight in its safetensors files")


def load_fake_quant_model(
    path,
    dtype: torch.dtype = torch.bfloat16,
    router_dtype: str = "activation",
    scheme: str = "w4a8",
    hadamard_weight_path=None,
) -> nn.Module:
    """The reference model of checkpoint `path`, fake-quantized (`scheme` w4a8 | w8a8 | w4a4) from the checkpoint's
    stored values (as the converter quantizes them, whatever their dtype), then cast to `dtype` (dequantized MX
    values are exact in bf16 and fp32). hadamard_weight_path (w4a4): the rotation directory."""
    from reference.checkpoint import load_model

    model = load_model(path, torch.float32, router_dtype)
    rotations = None
    if hadamard_weight_path is not None:
        rotations = load_rotations(hadamard_weight_path, model.config.num_hidden_layers)
    return fake_quantize(model, scheme, rotations, _stored_dtype(path) if rotations else None).to(dtype)
