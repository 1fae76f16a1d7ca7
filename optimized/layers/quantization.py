"""Quant methods (vLLM-style): each linear / grouped-matmul layer owns one, chosen once at build time.

A method creates the layer's parameters, loads this rank's slices of the checkpoint into them, and applies
the layer. `quant_scheme(hf_config)` reads the checkpoint's `quantization_config` (spec mx_quant.md §8.3):
absent -> unquantized; the compressed-tensors W4A8 config (group_0 Linear 8-bit, group_1 MoEGMM 4-bit) -> "w4a8",
where attention (and dense-MLP) linears use `MxFp8LinearMethod` and the routed experts `W4A8MxFp4MoEGMMMethod`;
the W8A8 config (group_0 Linear 8-bit alone: the recipe's `w8a8c16`, whose experts fall to the Linear group) ->
"w8a8", every linear `MxFp8LinearMethod` and the experts `MxFp8MoEGMMMethod` (the recipe's names); the W4A4 config
(both groups 4-bit weights and 4-bit activations: the recipe's `w4a4c16`, spec a4w4_hadamard.md §3) -> "w4a4",
attention linears `MxFp4LinearMethod` and experts `W4A4MxFp4MoEGMMMethod`, MXFP4 activations, a 16-bit KV cache.

MX parameters are created and loaded in the checkpoint layouts (§7): MXFP8 `weight [N, K]` float8_e4m3fn, MXFP4
expert weights uint8 `[N, K/2]` (two E2M1 codes per byte, packed along K), `weight_scale [N, nb]` one E8M0 byte
per 32-block of K, with nb padded to even by a zero byte so the pair layout `[N, nb/2, 2]` (§2.2) is a view.
A rank's K-slice (row-parallel o_proj, down_proj under MoE TP) must start and end on a 32-block boundary:
packed bytes and scale bytes are then sliced whole, straight from the checkpoint with `get_slice`.

After every load, `process_weights_after_loading(model)` (the build calls it once) has each quant method put its
layer's parameters in the runtime layouts the NPU kernels take, as the recipe's MX modules do, so no forward call
re-lays them out: weights become their transposed views (`[K, N]`, experts `[L, K(/2), N]`; no copy), scales the
paired, transposed pairs `[nb/2, N, 2]` / `[L, nb/2, N, 2]`, contiguous (one copy at build, the checkpoint layout
freed). Applying an MX layer before that, processing it twice or loading into it after it, is an error naming the
layer. `checkpoint_layout_parameters(model)` gives the parameters back in the checkpoint layouts (tests, inspection).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from optimized.config import KV_CACHE_DTYPES
from optimized.errors import CheckpointError
from optimized.layers.hadamard import rotate
from optimized.ops import cpu_gemm, mx_format as mxf

W4A8 = "w4a8"
W8A8 = "w8a8"
W4A4 = "w4a4"
MX_SCHEMES = (W4A8, W8A8, W4A4)
# (weight bits, activation bits) per compressed-tensors target -> scheme (the recipe's converter writes exactly these)
_BITS = {W4A8: {"Linear": (8, 8), "MoEGMM": (4, 8)}, W8A8: {"Linear": (8, 8)},
         W4A4: {"Linear": (4, 4), "MoEGMM": (4, 4)}}
BLOCK = mxf.BLOCK_SIZE
FLOAT8_E4M3FN = 24        # torch ScalarType code (== torch_npu 292)
FLOAT4_E2M1 = mxf.float4_e2m1fn_x2   # uint8 holding two codes
FLOAT8_E8M0 = mxf.float8_e8m0fnu     # scale bytes


class QuantConfigError(ValueError):
    """A quantization_config this model cannot run (the message names the key)."""


def quant_scheme(hf_config) -> str | None:
    """None (unquantized), "w4a8", "w8a8" or "w4a4", from config.json's `quantization_config`; anything else is an error."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    return scheme_of(qc if isinstance(qc, dict) else qc.to_dict())


def scheme_of(qc: dict) -> str:
    """W4A8, W8A8 or W4A4 for a compressed-tensors MX `quantization_config` dict; anything else is an error."""

    def need(ok: bool, key: str, value) -> None:
        if not ok:
            raise QuantConfigError(f"config.json quantization_config.{key}={value!r} is not supported; this model "
                                   "runs BF16 checkpoints and the W4A8 / W8A8 / W4A4 MX checkpoints of `python -m "
                                   "optimized convert --quant w4a8|w8a8|w4a4`")

    need(qc.get("quant_method") == "compressed-tensors", "quant_method", qc.get("quant_method"))
    need(list(qc.get("weight_block_size") or []) == [1, BLOCK], "weight_block_size", qc.get("weight_block_size"))
    bits = {}
    for name, group in (qc.get("config_groups") or {}).items():
        w, a = group.get("weights") or {}, group.get("input_activations") or {}
        need(w.get("type") == "float", f"config_groups.{name}.weights.type", w.get("type"))
        need(a.get("type") == "float" and a.get("num_bits") in (4, 8) and a.get("dynamic") is True,
             f"config_groups.{name}.input_activations", a)
        for target in group.get("targets") or []:
            bits[target] = (w.get("num_bits"), a.get("num_bits"))
    scheme = next((name for name, want in _BITS.items() if bits == want), None)
    need(scheme is not None, "config_groups ((weight, activation) bits per target; w4a8: {'Linear': (8, 8), "
                             "'MoEGMM': (4, 8)}, w8a8: {'Linear': (8, 8)}, w4a4: {'Linear': (4, 4), 'MoEGMM': (4, 4)})",
         bits)
    kv_cache_scheme(qc)
    return scheme


# ------------------------------------------------------------------------------------------- KV cache

FLOAT8 = "float8"   # the recipe's kv_cache_quant_mode: per-token FP8 E4M3 K/V, one fp32 scale per token
# What the recipe's converter writes (spec mx_quant.md §8.3): FP8, one dynamic symmetric scale per token.
KV_CACHE_SCHEME_FP8 = {"num_bits": 8, "type": "float", "strategy": "token", "group_size": -1, "dynamic": "true",
              "symmetric": "true"}


def _json_true(value) -> bool:
    return value is True or value == "true"      # the converter writes the strings "true"


def kv_cache_scheme(qc: dict | None) -> str | None:
    """FLOAT8 or None from `quantization_config.kv_cache_scheme` (absent / null: a 16-bit cache)."""
    kv = (qc or {}).get("kv_cache_scheme")
    if kv is None:
        return None
    if not isinstance(kv, dict):
        raise QuantConfigError(f"config.json quantization_config.kv_cache_scheme={kv!r} must be an object or null")
    for key, want in KV_CACHE_SCHEME_FP8.items():
        got = kv.get(key)
        ok = _json_true(got) if want == "true" else (got == want and type(got) is type(want))
        if not ok:
            raise QuantConfigError(f"config.json quantization_config.kv_cache_scheme.{key}={got!r} is not supported; "
                                   f"the KV cache runs the recipe's per-token FP8 scheme {KV_CACHE_SCHEME_FP8} or 16-bit")
    extra = sorted(set(kv) - set(KV_CACHE_SCHEME_FP8))
    if extra:
        raise QuantConfigError(f"config.json quantization_config.kv_cache_scheme.{extra[0]} is not a key of the "
                               f"per-token FP8 scheme {KV_CACHE_SCHEME_FP8}")
    return FLOAT8


def recipe_quantization_config(num_hidden_layers: int, kv_cache: str = "fp8", scheme: str = W4A8) -> dict:
    """The compressed-tensors `quantization_config` the recipe's converter writes for w4a8c16 (§8.3, key order as
    written), w8a8c16 (the same without group_1: the experts fall to group_0's 8-bit Linear scheme) or w4a4c16
    (both groups 4-bit weights and activations, `global_compression_ratio` a JSON null, no KV scheme: spec
    a4w4_hadamard.md §3.4); kv_cache "bf16": kv_cache_scheme null."""
    if scheme not in MX_SCHEMES:
        raise ValueError(f"quantization scheme {scheme!r} is not one of {', '.join(MX_SCHEMES)}")
    if scheme == W4A4 and kv_cache != "bf16":
        raise QuantConfigError("quantization_config.kv_cache_scheme: the recipe's w4a4c16 writes none (a 16-bit KV "
                               "cache); a W4A4 checkpoint with an FP8 KV scheme is not one it writes")
    act_bits = 4 if scheme == W4A4 else 8
    def args(bits: int, dynamic: bool) -> dict:
        return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": 32, "num_bits": bits,
                "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True, "type": "float"}

    def group(weight_bits: int, target: str) -> dict:
        return {"input_activations": args(act_bits, True), "activation_use_clip": False, "output_activations": None,
                "targets": [target], "weights": args(weight_bits, False)}

    ignore = [f"model.layers.{i}.{m}" for i in range(num_hidden_layers)
              for m in ("input_layernorm", "post_attention_layernorm", "mlp.gate", "self_attn.k_norm",
                        "self_attn.q_norm")]
    groups = {"group_0": group(4 if scheme == W4A4 else 8, "Linear")}
    if scheme in (W4A8, W4A4):
        groups["group_1"] = group(4, "MoEGMM")
    return {"config_groups": groups,
            "format": "float-quantized", "global_compression_ratio": None if scheme == W4A4 else "null",
            "ignore": ignore + ["lm_head", "model.embed_tokens", "model.norm"],
            "kv_cache_scheme": dict(KV_CACHE_SCHEME_FP8) if kv_cache == "fp8" else None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "weight_block_size": [1, 32]}


def check_recipe_quantization_config(qc: dict, num_hidden_layers: int) -> None:
    """`qc` is exactly what the recipe's converter writes for a model of `num_hidden_layers` layers (§8.3), with
    or without kv_cache_scheme: a missing key, another key or another value is an error naming it."""
    kv = kv_cache_scheme(qc)                                  # the KV scheme's own errors name its key
    want = recipe_quantization_config(num_hidden_layers, "fp8" if kv else "bf16", scheme_of(qc))
    if "kv_cache_scheme" not in qc:
        del want["kv_cache_scheme"]
    _expect_same(qc, want, "quantization_config")


def _expect_same(got, want, path: str) -> None:
    def fail(what: str):
        raise QuantConfigError(f"config.json {path}{what}; this model runs the quantization_config the recipe's "
                               f"converter (and `python -m optimized convert --quant w4a8|w8a8|w4a4`) writes")
    if isinstance(want, dict):
        if not isinstance(got, dict):
            fail(f"={got!r} must be an object")
        missing = [k for k in want if k not in got]
        if missing:
            fail(f".{missing[0]} is missing (the converter writes {want[missing[0]]!r})")
        extra = [k for k in got if k not in want]
        if extra:
            fail(f".{extra[0]} is not a key the converter writes")
        for key in want:
            _expect_same(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list) and isinstance(got, list) and len(got) == len(want):
        for i, (g, w) in enumerate(zip(got, want)):
            _expect_same(g, w, f"{path}[{i}]")
    elif isinstance(want, list) and isinstance(got, list):
        fail(f" has {len(got)} entries; the converter writes {len(want)}")
    elif got != want or type(got) is not type(want):
        fail(f"={got!r} is not supported (the converter writes {want!r})")


def kv_cache_dtype(hf_config, choice: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache dtype that runs: 'auto' follows the checkpoint's kv_cache_scheme (as the recipe's loader
    does), 'bfloat16' keeps the cache in the activation dtype `dtype`, 'float8' quantizes it per token."""
    if choice not in KV_CACHE_DTYPES:
        raise QuantConfigError(f"kv_cache_dtype={choice!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    qc = getattr(hf_config, "quantization_config", None)
    qc = qc if isinstance(qc, dict) or qc is None else qc.to_dict()
    wanted = kv_cache_scheme(qc) if choice == "auto" else choice
    if wanted != FLOAT8:
        return dtype
    if dtype not in (torch.bfloat16, torch.float16):
        raise QuantConfigError(f"kv_cache_dtype float8 quantizes bfloat16 or float16 K/V (npu_dynamic_quant takes no "
                               f"{dtype}); run dtype bfloat16 or set model_config.kv_cache_dtype: bfloat16")
    return torch.float8_e4m3fn


def _expect_dtype(source, name: str, tensor: torch.Tensor, dtype: torch.dtype, scheme: str) -> None:
    if tensor.dtype != dtype:
        raise CheckpointError(f"{source.label}: tensor {name!r} has dtype {tensor.dtype} but the model is built for "
                              f"{scheme} (from config.json's quantization_config), which stores it as {dtype}")


def _expect_float(source, name: str, tensor: torch.Tensor) -> None:
    if not tensor.dtype.is_floating_point or tensor.dtype.itemsize == 1:
        raise CheckpointError(f"{source.label}: tensor {name!r} has dtype {tensor.dtype}: a quantized checkpoint "
                              "tensor, but config.json has no quantization_config (the model is built unquantized)")


def _check_activation_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.bfloat16, torch.float16):
        raise QuantConfigError(f"W4A8 / W8A8 checkpoints run with bfloat16 or float16 activations, W4A4 ones too (the "
                               f"MX matmuls write no float32, the fused SwiGLU + MX quantization takes none); got dtype "
                               f"{dtype}")


def even_blocks(k: int) -> int:
    nb = -(-k // BLOCK)
    return nb + nb % 2


def block_slice(cols: slice, k: int, name: str, per: int = BLOCK) -> slice:
    """The checkpoint columns `cols` of K as whole units of `per` (32: scale bytes, 2: packed FP4 bytes)."""
    start, stop, _ = cols.indices(k)
    if start % BLOCK or (stop % BLOCK and stop != k):
        raise CheckpointError(f"tensor {name!r}: this rank's K-slice [{start}, {stop}) of K={k} does not fall on "
                              f"{BLOCK}-element MX block boundaries; choose a parallel layout whose K per rank is a "
                              f"multiple of {BLOCK}")
    return slice(start // per, -(-stop // per))


class MxRows(NamedTuple):
    """MXFP8 activation rows: data [M, K] float8_e4m3fn and their MX scale pairs [M, ceil(K/64), 2] (uint8).

    An activation payload is a tensor or MxRows; a linear or the experts take either (MxRows: already quantized,
    the recipe's `dynamic_scale` / `pertoken_scale`). Rows move together: see `map_rows`."""
    data: torch.Tensor
    scale: torch.Tensor


def map_rows(x, fn):
    """`fn` (a row-wise move: gather, all_to_all, slice) applied to a payload: to both parts of MxRows."""
    return MxRows(fn(x.data), fn(x.scale)) if isinstance(x, MxRows) else fn(x)


def num_rows(x) -> int:
    return (x.data if isinstance(x, MxRows) else x).shape[0]


def mx_quant(x: torch.Tensor) -> MxRows:
    """MXFP8 E4M3 activations as the recipe quantizes them (scale_alg 0, rint): fp8 [M, K], scale [M, K/64, 2]."""
    return MxRows(*torch.ops.npu.npu_dynamic_mx_quant(x, dst_type=FLOAT8_E4M3FN))


def _no_mx(x, what: str) -> None:
    if isinstance(x, MxRows):
        raise TypeError(f"{what} holds 16-bit weights and cannot take MXFP8 rows (a payload is quantized only for "
                        f"MX layers: W4A8 checkpoints)")


def _no_mxfp8_rows(x, what: str) -> None:
    if isinstance(x, MxRows):
        raise TypeError(f"{what} cannot take MXFP8 rows (the MXFP8 wire of the W4A8 sequence-parallel prefill)")


# ------------------------------------------------------------------------ weights prepared after loading

def _layer_label(layer: nn.Module) -> str:
    names = getattr(layer, "loaded_from", None)
    return f"{type(layer).__name__} ({', '.join(names) if names else 'nothing loaded'})"


def _note_load(layer: nn.Module, name: str) -> None:
    """Remembers what the layer loads (its name in errors); a load into runtime layouts would scramble them."""
    if getattr(layer, "runtime_layout", False):
        raise RuntimeError(f"{_layer_label(layer)}: cannot load {name!r} after process_weights_after_loading (its "
                           f"parameters are in the runtime layout now); load into a freshly built model")
    names = layer.__dict__.setdefault("loaded_from", [])
    if name not in names:
        names.append(name)


def _start_processing(layer: nn.Module) -> None:
    # Refused, not idempotent: a second pass would transpose the runtime layouts again.
    if getattr(layer, "runtime_layout", False):
        raise RuntimeError(f"{_layer_label(layer)}: process_weights_after_loading was already called; it runs "
                           f"once per layer, after all its weights are loaded")


def _check_processed(layer: nn.Module) -> None:
    if not layer.runtime_layout:
        raise RuntimeError(f"{_layer_label(layer)}: applied before process_weights_after_loading(layer): its MX "
                           f"weights are still in the checkpoint layout (the model build calls it after loading; "
                           f"a layer built by hand must call it too)")


def _runtime_scale(scale: torch.Tensor) -> torch.Tensor:
    """Checkpoint scale bytes [..., N, nbp] -> the kernels' pairs [..., nbp/2, N, 2] (§2.2), contiguous."""
    return mxf.pair_scales(scale).transpose(-3, -2).contiguous()


def _checkpoint_scale(pairs: torch.Tensor) -> torch.Tensor:
    """The inverse of `_runtime_scale`: [..., nbp/2, N, 2] -> [..., N, nbp] (a copy)."""
    return pairs.transpose(-3, -2).flatten(-2)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


ACL_FORMAT_FRACTAL_NZ = 29   # npu_format_cast's acl_format for the NZ weight layout
GMM_TUNING_CONFIG = [0]      # the grouped matmuls' tuning_config (a tiling hint: the expected rows per expert)


def _nz(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """`weight` as the kernels read it: with `layer.weight_nz` (model_config.enable_weight_nz, set by
    `process_weights_after_loading(model, weight_nz=...)`) made contiguous, then cast once to FRACTAL_NZ (on the CPU
    the cast is the identity); without it, as it is."""
    if not getattr(layer, "weight_nz", False):
        return weight
    return torch.ops.npu.npu_format_cast(weight.contiguous(), ACL_FORMAT_FRACTAL_NZ)


def process_weights_after_loading(model: nn.Module, weight_nz: bool = False) -> None:
    """Each layer with a quant method in `model` (itself included) prepares its runtime layouts: once, after every
    weight is loaded. `modules()` yields a module held twice once. weight_nz: every linear, expert and MX weight is
    cast to the NZ layout (contiguous first) except the router gate (`router`: made contiguous, kept ND)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            module.weight_nz = weight_nz and not getattr(module, "router", False)
            method.process_weights_after_loading(module)


def checkpoint_layout_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.named_parameters()` with every processed MX layer's tensors in the checkpoint layouts (weights as
    views, scales as copies [..., N, nbp]): what loading wrote, for tests and inspection."""
    params = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        if getattr(module, "runtime_layout", False):
            for attr, tensor in module.quant_method.checkpoint_layout(module).items():
                params[f"{prefix}.{attr}" if prefix else attr] = tensor
    return params


# ---------------------------------------------------------------------------------------------- linears

class UnquantizedLinearMethod:
    """weight [N, K] in the activation dtype; y = x W^T."""

    def create_weights(self, layer: nn.Module, out_rows: int, in_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_rows, in_features, dtype=dtype), requires_grad=False)

    def load(self, layer, source, name: str, full_shape: tuple, index: tuple = (), rows: slice = slice(None)) -> None:
        """Copy `name[index]` (checked to have `full_shape`) into the layer's weight rows `rows`."""
        t = source.read(name, full_shape, index)
        _expect_float(source, name, t)
        layer.weight[rows].copy_(t)

    def process_weights_after_loading(self, layer) -> None:
        """The [N, K] weight contiguous, cast to NZ with `layer.weight_nz` (the CPU's oneDNN packing is the portable
        kernel's own, cpu_gemm.py)."""
        weight = layer.weight.contiguous()
        if weight is not layer.weight or getattr(layer, "weight_nz", False):
            layer.weight = _param(_nz(layer, weight))

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        _no_mx(x, "an unquantized linear")
        return cpu_gemm.linear(x, layer.weight)   # F.linear, on CPU bf16 with oneDNN's prepacked weight


class MxFp8LinearMethod:
    """MXFP8 W8A8: weight [N, K] float8_e4m3fn + weight_scale [N, nb] as loaded, then (process_weights_after_loading)
    the runtime layouts weight [K, N] (a view) and weight_scale [nb/2, N, 2]; x quantized per call
    (npu_dynamic_mx_quant), then npu_quant_matmul (fp32 accumulation, output in the activation dtype)."""

    def create_weights(self, layer: nn.Module, out_rows: int, in_features: int, dtype: torch.dtype) -> None:
        _check_activation_dtype(dtype)
        layer.weight = nn.Parameter(torch.empty(out_rows, in_features, dtype=torch.float8_e4m3fn), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.zeros(out_rows, even_blocks(in_features), dtype=torch.uint8),
                                          requires_grad=False)
        layer.output_dtype = dtype
        layer.runtime_layout = False

    def load(self, layer, source, name: str, full_shape: tuple, index: tuple = (), rows: slice = slice(None)) -> None:
        n, k = full_shape
        _note_load(layer, name)
        w = source.read(name, full_shape, index)
        _expect_dtype(source, name, w, torch.float8_e4m3fn, "MXFP8")
        layer.weight[rows].copy_(w)
        s_index = index
        if len(index) == 2:                     # a K-slice (row-parallel): whole scale bytes of its blocks
            s_index = (index[0], block_slice(index[1], k, name))
        s = source.read(mxf.scale_name(name), (n, -(-k // BLOCK)), s_index)
        _expect_dtype(source, mxf.scale_name(name), s, torch.uint8, "MXFP8")
        layer.weight_scale[rows, :s.shape[1]].copy_(s)

    def process_weights_after_loading(self, layer) -> None:
        """npu_quant_matmul's layouts, in place of the checkpoint's: weight [K, N] (the transposed view: no copy),
        weight_scale pairs [nb/2, N, 2] (contiguous; the [N, nb] bytes freed)."""
        _start_processing(layer)
        layer.weight = _param(_nz(layer, layer.weight.t()))
        layer.weight_scale = _param(_runtime_scale(layer.weight_scale))
        layer.runtime_layout = True

    def checkpoint_layout(self, layer) -> dict[str, torch.Tensor]:
        return {"weight": layer.weight.t(), "weight_scale": _checkpoint_scale(layer.weight_scale)}

    def apply(self, layer, x) -> torch.Tensor:
        """x: [..., K] in the activation dtype (quantized here), or MxRows [M, K] already quantized -> [..., N]."""
        _check_processed(layer)
        if isinstance(x, MxRows):
            return self._matmul(layer, x)
        x2 = x.reshape(-1, x.shape[-1])                                           # [M, K]
        return self._matmul(layer, mx_quant(x2)).view(*x.shape[:-1], layer.weight.shape[1])

    def _matmul(self, layer, x: MxRows) -> torch.Tensor:
        return torch.ops.npu.npu_quant_matmul(
            x.data, layer.weight, layer.weight_scale, pertoken_scale=x.scale,
            output_dtype=mxf.dtype_code(layer.output_dtype), scale_dtype=FLOAT8_E8M0,
            pertoken_scale_dtype=FLOAT8_E8M0, group_sizes=[1, 1, BLOCK])


def transpose_packed_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., N, K/2] packed along K -> [..., K, N/2] packed along N, contiguous (the recipe's transpose_packed_fp4)."""
    if packed.shape[-2] % 2:
        raise ValueError(f"MXFP4 A4W4 weights are packed along N after loading: N={packed.shape[-2]} must be even")
    return mxf.pack_fp4(mxf.unpack_fp4(packed).transpose(-1, -2)).contiguous()


def untranspose_packed_fp4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `transpose_packed_fp4`: [..., K, N/2] -> [..., N, K/2] (a copy)."""
    return mxf.pack_fp4(mxf.unpack_fp4(packed).transpose(-1, -2))


def fp4_quant(x: torch.Tensor):
    """MXFP4 E2M1 activations as the recipe's W4A4 path quantizes them (scale_alg 0, rint, block 32): uint8 [M, K/2]
    (two codes per byte), scale pairs [M, K/64, 2]."""
    return torch.ops.npu.npu_dynamic_mx_quant(x, dst_type=FLOAT4_E2M1)


class MxFp4LinearMethod:
    """MXFP4 W4A4 (the recipe's `MxFp4LinearMethod`, spec a4w4_hadamard.md §3.1): weight uint8 [N, K/2] (packed along
    K) + weight_scale [N, nb] as loaded, then (process_weights_after_loading) weight [K, N/2] packed along N
    (unpacked, transposed, repacked: contiguous) and weight_scale [nb/2, N, 2]. Per call: the layer's
    `input_rotation` (the Hadamard T of optimized/layers/hadamard.py, when loaded) on x, npu_dynamic_mx_quant to
    FP4, then the FP4 x FP4 npu_quant_matmul (fp32 accumulation, output in the activation dtype). The recipe's
    single-row duplication (an NPU kernel limit, spec §5 A11) is not needed by the portable kernel and not done."""

    def create_weights(self, layer: nn.Module, out_rows: int, in_features: int, dtype: torch.dtype) -> None:
        _check_activation_dtype(dtype)
        if in_features % 2:
            raise ValueError(f"MXFP4 packs two values per byte along K: this rank's in_features={in_features} "
                             f"must be even")
        layer.weight = nn.Parameter(torch.empty(out_rows, in_features // 2, dtype=torch.uint8), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.zeros(out_rows, even_blocks(in_features), dtype=torch.uint8),
                                          requires_grad=False)
        layer.in_features_per_rank = in_features
        layer.output_dtype = dtype
        layer.runtime_layout = False
        layer.register_buffer("input_rotation", None, persistent=False)   # the Hadamard T, when loaded (hadamard.py)

    def load(self, layer, source, name: str, full_shape: tuple, index: tuple = (), rows: slice = slice(None)) -> None:
        n, k = full_shape
        _note_load(layer, name)
        packed = index if len(index) < 2 else (index[0], block_slice(index[1], k, name, per=2))
        w = source.read(name, (n, k // 2), packed)
        _expect_dtype(source, name, w, torch.uint8, "W4A4 (MXFP4)")
        layer.weight[rows].copy_(w)
        scales = index if len(index) < 2 else (index[0], block_slice(index[1], k, name))
        s = source.read(mxf.scale_name(name), (n, -(-k // BLOCK)), scales)
        _expect_dtype(source, mxf.scale_name(name), s, torch.uint8, "W4A4 (MXFP4)")
        layer.weight_scale[rows, :s.shape[1]].copy_(s)

    def process_weights_after_loading(self, layer) -> None:
        """npu_quant_matmul's A4W4 layouts: weight [K, N/2] packed along N (contiguous), scale pairs [nb/2, N, 2]."""
        _start_processing(layer)
        layer.weight = _param(transpose_packed_fp4(layer.weight))
        layer.weight_scale = _param(_runtime_scale(layer.weight_scale))
        layer.runtime_layout = True

    def checkpoint_layout(self, layer) -> dict[str, torch.Tensor]:
        return {"weight": untranspose_packed_fp4(layer.weight), "weight_scale": _checkpoint_scale(layer.weight_scale)}

    def apply(self, layer, x) -> torch.Tensor:
        """x: [..., K] in the activation dtype -> [..., N]; rotated (when the layer has a rotation), then quantized."""
        _check_processed(layer)
        _no_mxfp8_rows(x, "a W4A4 linear (it rotates and quantizes its own input to MXFP4)")
        if layer.input_rotation is not None:
            x = rotate(x, layer.input_rotation)                                   # bf16(fp32(x) @ B(T))
        x2 = x.reshape(-1, x.shape[-1])                                           # [M, K]
        xq, xs = fp4_quant(x2)                                                    # [M, K/2] uint8, [M, K/64, 2]
        out = torch.ops.npu.npu_quant_matmul(
            xq, layer.weight, layer.weight_scale, pertoken_scale=xs,
            output_dtype=mxf.dtype_code(layer.output_dtype), x1_dtype=FLOAT4_E2M1, x2_dtype=FLOAT4_E2M1,
            scale_dtype=FLOAT8_E8M0, pertoken_scale_dtype=FLOAT8_E8M0, group_sizes=[1, 1, BLOCK])
        return out.view(*x.shape[:-1], out.shape[-1])


def linear_method(scheme: str | None):
    if scheme == W4A4:
        return MxFp4LinearMethod()
    return MxFp8LinearMethod() if scheme in MX_SCHEMES else UnquantizedLinearMethod()


# ------------------------------------------------------------------------------------ grouped matmul (MoE)

def _transposed_empty(groups: int, k: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized [groups, k, n] tensor whose storage is [groups, n, k]."""
    return torch.empty(groups, n, k, dtype=dtype).transpose(1, 2)


class UnquantizedFusedMoEMethod:
    """w13 [L, H, 2*I_r] (gate | up), w2 [L, I_r, H] in the activation dtype, stored as transposed views of the
    checkpoint's [N, K] rows (as the recipe does: each expert's GEMM then streams weight rows)."""

    tensors = ("weight",)

    def create_weights(self, layer, experts: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        layer.w13 = nn.Parameter(_transposed_empty(experts, hidden, 2 * inter, dtype), requires_grad=False)
        layer.w2 = nn.Parameter(_transposed_empty(experts, inter, hidden, dtype), requires_grad=False)

    def load_expert(self, layer, source, name: str, local: int, cols: slice) -> None:
        inter, hidden, i_r = layer.intermediate_size, layer.hidden_size, layer.inter_per_rank
        gate = source.read(f"{name}.gate_proj.weight", (inter, hidden), (cols,))   # [I_r, H]
        up = source.read(f"{name}.up_proj.weight", (inter, hidden), (cols,))       # [I_r, H]
        down = source.read(f"{name}.down_proj.weight", (hidden, inter), (slice(None), cols))  # [H, I_r]
        for proj, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            _expect_float(source, f"{name}.{proj}.weight", t)
        layer.w13[local, :, :i_r].copy_(gate.t())
        layer.w13[local, :, i_r:].copy_(up.t())
        layer.w2[local].copy_(down.t())

    def process_weights_after_loading(self, layer) -> None:
        """w13 / w2 are created as the grouped matmul's transposed views; with `layer.weight_nz` cast to NZ
        (contiguous first)."""
        if getattr(layer, "weight_nz", False):
            layer.w13, layer.w2 = _param(_nz(layer, layer.w13)), _param(_nz(layer, layer.w2))

    def apply(self, layer, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        _no_mx(x, "the unquantized experts")
        h = torch.ops.npu.npu_grouped_matmul([x], [layer.w13], group_list=tokens_per_expert, group_type=0,
                                             group_list_type=1, split_item=3,
                                             tuning_config=GMM_TUNING_CONFIG)[0]      # [M, 2*I_r]
        h = torch.ops.npu.npu_swiglu(h)                                                # [M, I_r]
        return torch.ops.npu.npu_grouped_matmul([h], [layer.w2], group_list=tokens_per_expert, group_type=0,
                                                group_list_type=1, split_item=3,
                                                tuning_config=GMM_TUNING_CONFIG)[0]   # [M, H]


class _MxExpertLoading:
    """Copies one expert's MX weight and scale rows (this rank's columns) into the stacked parameters; `_read`
    (per format) reads and checks a weight with its scale partner."""

    def load_expert(self, layer, source, name: str, local: int, cols: slice) -> None:
        inter, hidden, i_r = layer.intermediate_size, layer.hidden_size, layer.inter_per_rank
        _note_load(layer, name.rpartition(".")[0])                    # the experts' prefix, not each expert
        for offset, proj in ((0, "gate_proj"), (i_r, "up_proj")):
            w, s = self._read(source, f"{name}.{proj}.weight", (inter, hidden), (cols,))     # [I_r, H(/2)], [I_r, nb]
            layer.w13_weight[local, offset:offset + i_r].copy_(w)
            layer.w13_weight_scale[local, offset:offset + i_r, :s.shape[1]].copy_(s)
        w, s = self._read(source, f"{name}.down_proj.weight", (hidden, inter), (slice(None), cols))  # [H, I_r(/2)]
        layer.w2_weight[local].copy_(w)
        layer.w2_weight_scale[local, :, :s.shape[1]].copy_(s)

    def process_weights_after_loading(self, layer) -> None:
        """npu_grouped_matmul's layouts, in place of the checkpoint's: w13_weight / w2_weight [L, K(/2), N] (the
        transposed views: no copy), their scales pairs [L, nb/2, N, 2] (contiguous; the [L, N, nb] bytes freed)."""
        _start_processing(layer)
        for w in ("w13_weight", "w2_weight"):
            setattr(layer, w, _param(_nz(layer, getattr(layer, w).transpose(1, 2))))
            setattr(layer, f"{w}_scale", _param(_runtime_scale(getattr(layer, f"{w}_scale"))))
        layer.runtime_layout = True

    def checkpoint_layout(self, layer) -> dict[str, torch.Tensor]:
        out = {}
        for w in ("w13_weight", "w2_weight"):
            out[w] = getattr(layer, w).transpose(1, 2)
            out[f"{w}_scale"] = _checkpoint_scale(getattr(layer, f"{w}_scale"))
        return out


class W4A8MxFp4MoEGMMMethod(_MxExpertLoading):
    """MXFP4 expert weights x MXFP8 activations (§6.6 W4A8 row): w13_weight [L, 2*I_r, H/2] (gate rows, then up
    rows), w2_weight [L, H, I_r/2], uint8 packed along K, with per-block scales [L, N, nb], as loaded. The grouped
    matmul takes them as process_weights_after_loading leaves them: the transposed views [L, K/2, N] and the scale
    pairs [L, K/64, N, 2] (contiguous); the SwiGLU output is quantized by npu_swiglu_mx_quant."""

    tensors = ("weight", "weight_scale")

    def create_weights(self, layer, experts: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        def param(*shape, zeros=False):
            make = torch.zeros if zeros else torch.empty
            return nn.Parameter(make(*shape, dtype=torch.uint8), requires_grad=False)
        _check_activation_dtype(dtype)
        if hidden % 2 or inter % 2:
            raise ValueError(f"MXFP4 packs two values per byte along K: hidden_size={hidden} and the per-rank "
                             f"moe_intermediate_size={inter} must be even")
        layer.w13_weight = param(experts, 2 * inter, hidden // 2)
        layer.w13_weight_scale = param(experts, 2 * inter, even_blocks(hidden), zeros=True)
        layer.w2_weight = param(experts, hidden, inter // 2)
        layer.w2_weight_scale = param(experts, hidden, even_blocks(inter), zeros=True)
        layer.output_dtype = dtype
        layer.runtime_layout = False

    def _read(self, source, name: str, shape: tuple, index: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = shape
        packed = index if len(index) < 2 else (index[0], block_slice(index[1], k, name, per=2))
        scales = index if len(index) < 2 else (index[0], block_slice(index[1], k, name))
        w = source.read(name, (n, k // 2), packed)
        _expect_dtype(source, name, w, torch.uint8, "W4A8 (MXFP4 experts)")
        s = source.read(mxf.scale_name(name), (n, -(-k // BLOCK)), scales)
        _expect_dtype(source, mxf.scale_name(name), s, torch.uint8, "W4A8 (MXFP4 experts)")
        return w, s

    def _gmm(self, layer, x, x_scale, weight, weight_scale, tokens_per_expert):
        return torch.ops.npu.npu_grouped_matmul(
            [x], [weight], antiquant_scale=[weight_scale],
            per_token_scale=[x_scale], group_list=tokens_per_expert, group_type=0, group_list_type=1,
            split_item=3, tuning_config=GMM_TUNING_CONFIG, output_dtype=mxf.dtype_code(layer.output_dtype),
            weight_dtype=FLOAT4_E2M1,
            per_token_scale_dtype=FLOAT8_E8M0)[0]

    def apply(self, layer, x, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: rows [M, H] in the activation dtype (quantized here) or MxRows already quantized -> [M, H]."""
        _check_processed(layer)
        xq, xs = x if isinstance(x, MxRows) else mx_quant(x)                                # [M, H] fp8
        h = self._gmm(layer, xq, xs, layer.w13_weight, layer.w13_weight_scale, tokens_per_expert)  # [M, 2*I_r]
        hq, hs = torch.ops.npu.npu_swiglu_mx_quant(h, group_index=tokens_per_expert, activate_left=True,
                                                   dst_type=FLOAT8_E4M3FN)                  # [M, I_r] fp8
        return self._gmm(layer, hq, hs, layer.w2_weight, layer.w2_weight_scale, tokens_per_expert)  # [M, H]


class MxFp8MoEGMMMethod(_MxExpertLoading):
    """MXFP8 W8A8 experts (§6.6 MXFP8 row, the recipe's `w8a8c16`): w13_weight [L, 2*I_r, H] (gate rows, then up
    rows), w2_weight [L, H, I_r] float8_e4m3fn with per-block scales [L, N, nb], as loaded. The grouped matmul takes
    them as process_weights_after_loading leaves them: the transposed views [L, K, N] and the weight scale in
    `scale` as pairs [L, K/64, N, 2] (contiguous, scale_dtype E8M0); between
    the two, npu_swiglu then npu_dynamic_mx_quant, as the recipe's MxFp8MoEGMMMethod does (no fused SwiGLU + MX
    quantization for this mode)."""

    tensors = ("weight", "weight_scale")

    def create_weights(self, layer, experts: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        def param(*shape, dtype, zeros=False):
            make = torch.zeros if zeros else torch.empty
            return nn.Parameter(make(*shape, dtype=dtype), requires_grad=False)
        _check_activation_dtype(dtype)
        fp8, u8 = torch.float8_e4m3fn, torch.uint8
        layer.w13_weight = param(experts, 2 * inter, hidden, dtype=fp8)
        layer.w13_weight_scale = param(experts, 2 * inter, even_blocks(hidden), dtype=u8, zeros=True)
        layer.w2_weight = param(experts, hidden, inter, dtype=fp8)
        layer.w2_weight_scale = param(experts, hidden, even_blocks(inter), dtype=u8, zeros=True)
        layer.output_dtype = dtype
        layer.runtime_layout = False

    def _read(self, source, name: str, shape: tuple, index: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = shape
        scales = index if len(index) < 2 else (index[0], block_slice(index[1], k, name))
        w = source.read(name, shape, index)
        _expect_dtype(source, name, w, torch.float8_e4m3fn, "W8A8 (MXFP8 experts)")
        s = source.read(mxf.scale_name(name), (n, -(-k // BLOCK)), scales)
        _expect_dtype(source, mxf.scale_name(name), s, torch.uint8, "W8A8 (MXFP8 experts)")
        return w, s

    def _gmm(self, layer, x: MxRows, weight, weight_scale, tokens_per_expert):
        return torch.ops.npu.npu_grouped_matmul(
            [x.data], [weight], scale=[weight_scale],
            per_token_scale=[x.scale], group_list=tokens_per_expert, group_type=0, group_list_type=1,
            split_item=3, tuning_config=GMM_TUNING_CONFIG, output_dtype=mxf.dtype_code(layer.output_dtype),
            scale_dtype=FLOAT8_E8M0,
            per_token_scale_dtype=FLOAT8_E8M0)[0]

    def apply(self, layer, x, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: rows [M, H] in the activation dtype (quantized here) or MxRows already quantized -> [M, H]."""
        _check_processed(layer)
        xq = x if isinstance(x, MxRows) else mx_quant(x)                                     # [M, H] fp8
        h = self._gmm(layer, xq, layer.w13_weight, layer.w13_weight_scale, tokens_per_expert)  # [M, 2*I_r]
        h = torch.ops.npu.npu_swiglu(h)                                                      # [M, I_r]
        return self._gmm(layer, mx_quant(h), layer.w2_weight, layer.w2_weight_scale, tokens_per_expert)  # [M, H]


class W4A4MxFp4MoEGMMMethod(W4A8MxFp4MoEGMMMethod):
    """MXFP4 expert weights x MXFP4 activations (the recipe's W4A4MxFp4MoEGMMMethod, spec a4w4_hadamard.md §3.2, §6.6
    A4W4 row): loaded as the W4A8 experts are ([L, N, K/2] packed along K, scales [L, N, nb]); after loading
    w13_weight [L, H, 2*I_r/2] and w2_weight [L, I_r, H/2] packed along N (contiguous), scales [L, K/64, N, 2].
    x -> npu_dynamic_mx_quant FP4 -> A4W4 grouped matmul -> npu_swiglu -> FP4 -> A4W4 grouped matmul. Not rotated."""

    def _read(self, source, name: str, shape: tuple, index: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return super()._read(source, name, shape, index)
        except CheckpointError as e:
            raise CheckpointError(str(e).replace("W4A8 (MXFP4 experts)", "W4A4 (MXFP4 experts)")) from None

    def process_weights_after_loading(self, layer) -> None:
        """npu_grouped_matmul's A4W4 layouts: weights [L, K, N/2] packed along N (contiguous), scales [L, K/64, N, 2]."""
        _start_processing(layer)
        for w in ("w13_weight", "w2_weight"):
            setattr(layer, w, _param(transpose_packed_fp4(getattr(layer, w))))
            setattr(layer, f"{w}_scale", _param(_runtime_scale(getattr(layer, f"{w}_scale"))))
        layer.runtime_layout = True

    def checkpoint_layout(self, layer) -> dict[str, torch.Tensor]:
        out = {}
        for w in ("w13_weight", "w2_weight"):
            out[w] = untranspose_packed_fp4(getattr(layer, w))
            out[f"{w}_scale"] = _checkpoint_scale(getattr(layer, f"{w}_scale"))
        return out

    def _gmm(self, layer, x, x_scale, weight, weight_scale, tokens_per_expert):
        return torch.ops.npu.npu_grouped_matmul(
            [x], [weight], scale=[weight_scale], per_token_scale=[x_scale], group_list=tokens_per_expert,
            group_type=0, group_list_type=1, split_item=3, output_dtype=mxf.dtype_code(layer.output_dtype),
            x_dtype=FLOAT4_E2M1, weight_dtype=FLOAT4_E2M1, scale_dtype=FLOAT8_E8M0,
            per_token_scale_dtype=FLOAT8_E8M0)[0]

    def apply(self, layer, x, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: rows [M, H] in the activation dtype (quantized here) -> [M, H]."""
        _check_processed(layer)
        _no_mxfp8_rows(x, "the W4A4 experts (they quantize their own input to MXFP4)")
        xq, xs = fp4_quant(x)                                                               # [M, H/2] fp4
        h = self._gmm(layer, xq, xs, layer.w13_weight, layer.w13_weight_scale, tokens_per_expert)  # [M, 2*I_r]
        h = torch.ops.npu.npu_swiglu(h)                                                     # [M, I_r]
        hq, hs = fp4_quant(h)
        return self._gmm(layer, hq, hs, layer.w2_weight, layer.w2_weight_scale, tokens_per_expert)  # [M, H]


def moe_method(scheme: str | None):
    if scheme == W4A4:
        return W4A4MxFp4MoEGMMMethod()
    if scheme == W4A8:
        return W4A8MxFp4MoEGMMMethod()
    return MxFp8MoEGMMMethod() if scheme == W8A8 else UnquantizedFusedMoEMethod()
