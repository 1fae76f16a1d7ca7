"""W4A8 / W8A8 conversion and the reference MX fake quantization, bit for bit.

- The reference quantizers (`reference/fake_quant.py`, float64) reproduce the spec's worked examples
  (mx_quant.md §10.1 activation bytes, §10.3 converter rows, §10.5 special blocks).
- The converter's quantizer (`optimized/model_loader/quantize.py`, fp32 with exponent-bit powers of two and threshold
  codes) equals the reference's weight quantizer bitwise on drawn bf16 bit patterns (ties, subnormals, zero
  blocks, K not a multiple of 32), and the independent `equivalence/mx_oracle.convert_weight` on its
  adversarial finite blocks in bf16 and fp32.
- Converting the tiny fixtures (single file and sharded): every tensor has the spec's name, dtype and shape
  (§8.1), kept tensors are byte-identical, quantized ones equal the reference quantizer's codes and scale
  bytes, config.json carries the §8.3 quantization_config (restated here), an already-quantized source and a
  non-empty destination are refused.
- `--quant w8a8` (w8a8c16): the experts MXFP8 too, bit for bit `mx_oracle.convert_weight` (e4m3), §8.3's config
  without group_1; an unknown `--quant` names the allowed values.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open

from equivalence.ops import mx_oracle
from equivalence.support.compare import assert_bitwise_equal
from equivalence.ops.mx_oracle import mx_inputs
from fixtures.checkpoints import checkpoint
from fixtures.tiny import tiny_config
from optimized.model_loader.build import load_model
from optimized.model_loader.quantize import (
    MXFP4,
    MXFP8,
    ConversionError,
    convert_checkpoint,
    mx_quantize_weight,
    quant_format,
)
from reference.checkpoint import read_state_dict
from reference.fake_quant import E2M1, E4M3, quantize_activation, quantize_weight

CONFIG = tiny_config("tiny")
FP4_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def bf16(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def fp4_codes(elements: torch.Tensor) -> torch.Tensor:
    """Grid values (float64) -> E2M1 codes (sign bit 8, -0.0 -> 0x8)."""
    magnitude = (elements.abs()[..., None] == FP4_VALUES[:8]).to(torch.uint8).argmax(-1).to(torch.uint8)
    return magnitude | (torch.signbit(elements).to(torch.uint8) << 3)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2)


def reference_bytes(w: torch.Tensor, fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """(element bytes, scale bytes) of the reference quantizer, in the converter's storage form."""
    r = quantize_weight(w, E4M3 if fmt is MXFP8 else E2M1)
    if fmt is MXFP8:
        return r.elements.to(torch.float8_e4m3fn), r.scale
    codes = fp4_codes(r.elements)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), r.scale


# ------------------------------------------------------------------------------------- worked examples

SPEC_10_1 = [
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
SPEC_10_1_Y = bytes.fromhex("7DF4006CE478 55CD72FB6B40A8626EEE70F068E8607AFC5876EA505DBA6679F1".replace(" ", ""))


def test_reference_activation_quant_reproduces_spec_example_10_1():
    q = quantize_activation(bf16(SPEC_10_1)[None])
    assert q.scale.tolist() == [[120]]
    assert bytes(q.elements.to(torch.float8_e4m3fn).view(torch.uint8)[0].tolist()) == SPEC_10_1_Y


def test_reference_activation_quant_special_blocks_spec_10_5():
    x = torch.zeros(4, 32)
    x[1, 3] = float("inf")
    x[2, 0] = float("nan")
    x[3, :2] = torch.tensor([2.0**-129, -(2.0**-130)])  # tiny block: byte 0, flushed to signed zeros
    q = quantize_activation(x.to(torch.bfloat16))
    assert q.scale[:, 0].tolist() == [0, 255, 255, 0]
    assert (q.elements == 0).all() and torch.signbit(q.elements[3, 1]) and not torch.signbit(q.elements[3, 0])
    assert q.dequantize()[1:3].isnan().all() and (q.dequantize()[[0, 3]] == 0).all()


@pytest.mark.parametrize("quantizer", ["reference", "converter"])
def test_weight_quantizers_reproduce_spec_rows_10_3(quantizer):
    w = torch.tensor([[3.75, 1.0, -0.5] + [0.0] * 29, [2.5 / 4, 0.25 / 4, 1.0] + [0.0] * 29]).to(torch.bfloat16)
    # row 0: §10.3 (E4M3 byte 121, 240/64/-32; E2M1 byte 127, 4.0/1.0/-0.5 = codes 6 2 9); row 1: amax 1.0 ->
    # E4M3 byte 119, E2M1 byte 125, 2.5 -> 3 (code 5) and 0.25 -> 0.5 (code 1): ties go away from zero.
    fp8 = reference_bytes(w, MXFP8) if quantizer == "reference" else mx_quantize_weight(w, MXFP8)
    fp4 = reference_bytes(w, MXFP4) if quantizer == "reference" else mx_quantize_weight(w, MXFP4)
    assert fp8[1].tolist() == [[121], [119]] and fp4[1].tolist() == [[127], [125]]
    assert fp8[0][0, :3].float().tolist() == [240.0, 64.0, -32.0]
    assert unpack_fp4(fp4[0])[0, :3].tolist() == [6, 2, 9] and unpack_fp4(fp4[0])[1, :3].tolist() == [5, 1, 6]


# ----------------------------------------------------------------------------- converter vs reference


@st.composite
def bf16_weights(draw):
    """[N, K] bf16 from raw finite bit patterns: mixes magnitudes, ties, subnormals, zeros and all-zero rows."""
    n, k = draw(st.integers(1, 3)), 2 * draw(st.integers(1, 50))
    scale_exp = draw(st.integers(-20, 20))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["raw", "grid", "zeros_and_raw"]))
    if kind == "grid":  # exact grid points and midpoints of both formats, scaled by one power of two
        w = (torch.randint(-64, 65, (n, k), generator=g).float() / 8) * 2.0**scale_exp
    else:
        bits = torch.randint(0, 1 << 16, (n, k), generator=g, dtype=torch.int32)
        exponent = (bits >> 7) & 0xFF
        bits = torch.where(exponent == 0xFF, bits & ~0x4000, bits)  # no Inf/NaN in weights
        w = bits.to(torch.int16).view(torch.bfloat16).float()
        if kind == "zeros_and_raw":
            w[:, : k // 2] = 0.0
    return w.to(torch.bfloat16)


@given(w=bf16_weights(), fp4=st.booleans())
def test_converter_quantizer_equals_reference_bitwise(w, fp4):
    fmt = MXFP4 if fp4 else MXFP8
    q, s = mx_quantize_weight(w, fmt)
    want_q, want_s = reference_bytes(w, fmt)
    assert_bitwise_equal(s, want_s, "scale bytes")
    assert_bitwise_equal(q, want_q, "elements")


@given(
    seed=st.integers(0, 2**31 - 1),
    k=st.integers(1, 70).map(lambda n: 2 * n),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    fp4=st.booleans(),
)
def test_converter_quantizer_equals_mx_oracle_bitwise(seed, k, dtype, fp4):
    """vs `equivalence/mx_oracle.convert_weight` (float64 numpy, ml_dtypes casts): finite adversarial blocks
    (ties, mantissa 1.5 / 1.75 boundaries, tiny, zero, huge), bf16 and fp32 sources."""
    w = mx_inputs(seed, (3, k), dtype, kinds=("gauss", "ties", "boundary", "tiny", "zero", "huge"))
    q, s = mx_quantize_weight(w, MXFP4 if fp4 else MXFP8)
    want_q, want_s = mx_oracle.convert_weight(w, "e2m1" if fp4 else "e4m3")
    assert_bitwise_equal(s, torch.from_numpy(want_s), "scale bytes")
    assert_bitwise_equal(q.view(torch.uint8), torch.from_numpy(want_q), "elements")


# ----------------------------------------------------------------------------------- whole checkpoints


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def spec_quantization_config(layers: int, kv_cache: str = "fp8", quant: str = "w4a8") -> dict:
    """§8.3 for w4a8c16, restated: the recipe writes the per-token FP8 kv_cache_scheme (strings "true");
    `--kv-cache bf16` writes null instead. w8a8c16: no group_1 (§8.3 note)."""
    kv_scheme = {
        "num_bits": 8,
        "type": "float",
        "strategy": "token",
        "group_size": -1,
        "dynamic": "true",
        "symmetric": "true",
    }
    act = {
        "actorder": None,
        "block_structure": None,
        "dynamic": True,
        "group_size": 32,
        "num_bits": 8,
        "observer": "minmax",
        "observer_kwargs": {},
        "strategy": "group",
        "symmetric": True,
        "type": "float",
    }
    group_0 = {
        "input_activations": act,
        "activation_use_clip": False,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": dict(act, dynamic=False),
    }
    group_1 = dict(group_0, targets=["MoEGMM"], weights=dict(act, dynamic=False, num_bits=4))
    ignore = []
    for i in range(layers):
        ignore += [
            f"model.layers.{i}.input_layernorm",
            f"model.layers.{i}.post_attention_layernorm",
            f"model.layers.{i}.mlp.gate",
            f"model.layers.{i}.self_attn.k_norm",
            f"model.layers.{i}.self_attn.q_norm",
        ]
    groups = {"group_0": group_0, "group_1": group_1} if quant == "w4a8" else {"group_0": group_0}
    return {
        "config_groups": groups,
        "format": "float-quantized",
        "global_compression_ratio": "null",
        "ignore": ignore + ["lm_head", "model.embed_tokens", "model.norm"],
        "kv_cache_scheme": kv_scheme if kv_cache == "fp8" else None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "weight_block_size": [1, 32],
    }


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_converted_tiny_checkpoint_round_trip(tmp_path, sharded):
    src = checkpoint("tiny", sharded=sharded)
    report = convert_checkpoint(src, tmp_path / "w4a8", progress=False)
    dst = tmp_path / "w4a8"
    source, out = read_state_dict(src), _tensors(dst)
    expected_names = set(source)
    for name, w in source.items():
        if ".mlp.experts." in name or ".self_attn." in name and name.endswith("_proj.weight"):
            expected_names.add(name.replace(".weight", ".weight_scale"))
    assert set(out) == expected_names
    for name, w in source.items():
        if ".mlp.experts." in name:
            q, s = out[name], out[name + "_scale"]
            n, k = w.shape
            assert (q.dtype, tuple(q.shape), s.dtype, tuple(s.shape)) == (
                torch.uint8,
                (n, k // 2),
                torch.uint8,
                (n, -(-k // 32)),
            ), name
            want = reference_bytes(w, MXFP4)
        elif name.endswith("_proj.weight"):
            q, s = out[name], out[name + "_scale"]
            assert (q.dtype, tuple(q.shape), tuple(s.shape)) == (
                torch.float8_e4m3fn,
                tuple(w.shape),
                (w.shape[0], -(-w.shape[1] // 32)),
            ), name
            want = reference_bytes(w, MXFP8)
        else:
            assert_bitwise_equal(out[name], w, f"kept tensor {name}")
            continue
        assert_bitwise_equal(q, want[0], f"{name} elements")
        assert_bitwise_equal(s, want[1], f"{name} scale")
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == spec_quantization_config(2)
    assert list(config["quantization_config"]) == list(spec_quantization_config(2))
    assert list(config["quantization_config"]["kv_cache_scheme"]) == list(
        spec_quantization_config(2)["kv_cache_scheme"]
    )
    if sharded:
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        src_files = {p.name for p in src.glob("*.safetensors")}
        assert set(index["weight_map"]) == expected_names and set(index["weight_map"].values()) == src_files
    assert report.tensors == len(source) and report.bytes_out < report.bytes_in / 2
    with safe_open(next(dst.glob("*.safetensors")), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_converter_refuses_quantized_source_and_nonempty_destination(tmp_path):
    dst = tmp_path / "w4a8"
    convert_checkpoint(checkpoint("tiny"), dst, progress=False)
    with pytest.raises(ConversionError, match="already has a quantization_config .*already quantized"):
        convert_checkpoint(dst, tmp_path / "again", progress=False)
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="tensor '.*' has dtype (F8_E4M3|U8): the source looks already quantized"):
        convert_checkpoint(dst, tmp_path / "again", progress=False)
    with pytest.raises(ConversionError, match="exists and is not empty"):
        convert_checkpoint(checkpoint("tiny"), dst, progress=False)


def test_row_chunked_conversion_writes_the_same_bytes(tmp_path, monkeypatch):
    """Chunks of 3 rows (quantized) / 1 KB (kept) give byte-identical files to whole-tensor conversion."""
    import optimized.model_loader.quantize as quantize

    convert_checkpoint(checkpoint("tiny"), tmp_path / "whole", progress=False)
    monkeypatch.setattr(quantize, "QUANT_CHUNK_VALUES", 3 * 64)
    monkeypatch.setattr(quantize, "KEPT_CHUNK_BYTES", 1024)
    convert_checkpoint(checkpoint("tiny"), tmp_path / "chunked", progress=False)
    whole, chunked = (tmp_path / d / "model.safetensors" for d in ("whole", "chunked"))
    assert whole.read_bytes() == chunked.read_bytes()


@pytest.mark.parametrize("kv_cache", ["fp8", "bf16"])
def test_converter_kv_cache_choice_writes_the_recipes_scheme_or_none(tmp_path, kv_cache):
    """`convert --kv-cache fp8` (the default) writes §8.3's kv_cache_scheme verbatim (values, the strings
    "true", key order) and the model then runs the FP8 cache; `--kv-cache bf16` writes none (null) and a 16-bit
    cache runs. The tensors are the same bytes either way."""
    from optimized.cli.main import main as cli_main
    from optimized.layers.quantization.kv_cache import kv_cache_dtype
    from optimized.model_loader.hf_config import load_hf_config

    dst = tmp_path / kv_cache
    assert (
        cli_main(
            ["convert", "--quant", "w4a8", "--no-progress", "--kv-cache", kv_cache, str(checkpoint("tiny")), str(dst)]
        )
        == 0
    )
    written = json.loads((dst / "config.json").read_text())["quantization_config"]
    want = spec_quantization_config(2, kv_cache)
    assert json.dumps(written) == json.dumps(want)  # verbatim: values, types and key order
    assert (written["kv_cache_scheme"] is None) == (kv_cache == "bf16")
    runs = kv_cache_dtype(load_hf_config(dst), "auto", torch.bfloat16)
    assert runs == (torch.float8_e4m3fn if kv_cache == "fp8" else torch.bfloat16)
    default = tmp_path / "default"
    convert_checkpoint(checkpoint("tiny"), default, progress=False)
    assert (dst / "model.safetensors").read_bytes() == (default / "model.safetensors").read_bytes()


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_converted_w8a8_checkpoint_quantizes_every_linear_to_mxfp8(tmp_path, sharded):
    """`--quant w8a8` (the recipe's w8a8c16, §8.1 "no 4-bit set"): the experts' gate/up/down are MXFP8 like
    attention, float8_e4m3fn [N, K] + uint8 [N, ceil(K/32)], bit for bit the spec's quantizer (the independent
    `mx_oracle.convert_weight`, e4m3); kept tensors byte-identical, attention bytes as in the W4A8 conversion;
    config.json's quantization_config is §8.3's without group_1, verbatim."""
    src = checkpoint("tiny", sharded=sharded)
    convert_checkpoint(src, tmp_path / "w4a8", progress=False)
    report = convert_checkpoint(src, tmp_path / "w8a8", "w8a8", progress=False)
    source, out, w4a8 = read_state_dict(src), _tensors(tmp_path / "w8a8"), _tensors(tmp_path / "w4a8")
    assert set(out) == set(w4a8)
    experts = 0
    for name, w in source.items():
        if not name.endswith("_proj.weight"):
            assert_bitwise_equal(out[name], w, f"kept tensor {name}")
            continue
        q, sc = out[name], out[name + "_scale"]
        assert (q.dtype, tuple(q.shape), sc.dtype, tuple(sc.shape)) == (
            torch.float8_e4m3fn,
            tuple(w.shape),
            torch.uint8,
            (w.shape[0], -(-w.shape[1] // 32)),
        ), name
        want_q, want_s = mx_oracle.convert_weight(w, "e4m3")
        assert_bitwise_equal(q.view(torch.uint8), torch.from_numpy(want_q), f"{name} elements")
        assert_bitwise_equal(sc, torch.from_numpy(want_s), f"{name} scale")
        if ".mlp.experts." in name:
            experts += 1
        else:
            assert_bitwise_equal(q, w4a8[name], f"{name}: attention as in W4A8")
    assert experts == CONFIG.num_hidden_layers * CONFIG.num_experts * 3
    config = json.loads((tmp_path / "w8a8" / "config.json").read_text())["quantization_config"]
    assert json.dumps(config) == json.dumps(spec_quantization_config(2, quant="w8a8"))
    assert report.tensors == len(source) and report.bytes_out < report.bytes_in * 0.6


def test_converter_rejects_an_unknown_quant_naming_the_allowed_values(tmp_path):
    with pytest.raises(ConversionError, match=r"--quant 'w2a2' is not supported; supported: w4a8, w8a8, w4a4"):
        convert_checkpoint(checkpoint("tiny"), tmp_path / "x", "w2a2", progress=False)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("keep", [False, True])
def test_dense_gate_proj_mxfp8_by_default_16_bit_as_the_recipe_with_the_option(tmp_path, keep):
    """Default: a dense layer's gate_proj is MXFP8 like its up/down_proj. keep_dense_gate_proj (the CLI's
    --keep-dense-gate-proj): copied unchanged, as the recipe's converter leaves it; up/down, experts and attention
    are converted the same either way, and the optimized model loads the result with a 16-bit gate_proj."""
    from optimized.cli.main import main as cli_main
    from optimized.model import is_sparse_layer

    src = checkpoint("tiny-dense")
    args = [
        "convert",
        "--quant",
        "w4a8",
        "--no-progress",
        *(["--keep-dense-gate-proj"] if keep else []),
        str(src),
        str(tmp_path / "out"),
    ]
    assert cli_main(args) == 0
    out, source = _tensors(tmp_path / "out"), read_state_dict(src)
    config = tiny_config("tiny-dense")
    dense = [i for i in range(config.num_hidden_layers) if not is_sparse_layer(config, i)]
    assert dense
    for i in dense:
        gate = f"model.layers.{i}.mlp.gate_proj.weight"
        if keep:
            assert gate + "_scale" not in out
            assert_bitwise_equal(out[gate], source[gate], gate)
        else:
            assert out[gate].dtype == torch.float8_e4m3fn and gate + "_scale" in out
        for proj in ("up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.{proj}.weight"
            assert out[name].dtype == torch.float8_e4m3fn and name + "_scale" in out, name
    assert quant_format("model.layers.3.mlp.experts.0.gate_proj.weight", "w4a8", keep) is MXFP4
    model = load_model(tmp_path / "out", dtype=torch.bfloat16)
    for i in dense:
        mlp = model.layers[i].mlp
        assert (mlp.gate_up_proj is None) == keep
        if keep:
            assert mlp.gate_proj.weight.dtype == torch.bfloat16 and mlp.up_proj.weight.dtype == torch.float8_e4m3fn
