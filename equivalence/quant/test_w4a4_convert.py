"""`convert --quant w4a4 --hadamard-weight-path DIR` writes the recipe's w4a4c16 checkpoint (spec a4w4_hadamard.md
§2.3, §3.3, §3.4), byte for byte against an independent restatement.

The restatement (here, from reference.fake_quant's quantizer): q/k/v weights rotated by inverse(T_in)^T and o_proj
by inverse(T_out)^T per 128 in-features in fp32, rounded to the source's bf16, then MXFP4 by the converter's rule
(scale bump above mantissa 1.75, ties away from zero, E2M1 codes packed low nibble first); experts MXFP4 unrotated;
norms, router, embeddings and lm_head copied. Also: config.json's quantization_config equals §3.4's literally, and
converting in small row chunks writes the same bytes as whole tensors.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from fixtures.checkpoints import bf16_checkpoint, rotation_dir, w4a4_checkpoint
from reference.fake_quant import E2M1, load_rotations, quantize_weight, rotate

NAME = "tiny-h128"
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def fp4_bytes(q: torch.Tensor) -> torch.Tensor:
    """float64 elements on the E2M1 grid [..., K] -> packed codes [..., K/2] (sign bit 3, element 2t low nibble)."""
    mag = torch.tensor(FP4, dtype=torch.float64)
    code = (q.abs()[..., None] == mag).to(torch.uint8).argmax(-1).to(torch.uint8) | (
        torch.signbit(q).to(torch.uint8) << 3
    )
    return code[..., 0::2] | (code[..., 1::2] << 4)


@pytest.mark.parametrize("rotation", ["invertible", "orthogonal", None])
def test_w4a4_conversion_equals_the_restatement_byte_for_byte(rotation):
    src, out = tensors(bf16_checkpoint(NAME)), tensors(w4a4_checkpoint(NAME, rotation))
    rot = load_rotations(rotation_dir(rotation), 2) if rotation else None
    names = set()
    for name, w in src.items():
        parts = name.split(".")
        if name.endswith("_proj.weight") and ("experts" in parts or parts[3] == "self_attn"):
            if rot is not None and parts[3] == "self_attn":
                t = rot[int(parts[2])][1 if parts[4] == "o_proj" else 0]
                w = rotate(w.float(), torch.linalg.inv(t).T).to(w.dtype)  # the bf16 round trip
            q = quantize_weight(w, E2M1)
            assert torch.equal(out[name], fp4_bytes(q.elements)), name
            assert torch.equal(out[name.removesuffix("weight") + "weight_scale"], q.scale), name
            names |= {name, name.removesuffix("weight") + "weight_scale"}
        else:
            assert out[name].dtype == w.dtype and torch.equal(out[name], w), name
            names.add(name)
    assert names == set(out)


def test_w4a4_quantization_config_is_the_recipes():
    config = json.loads((w4a4_checkpoint(NAME, "orthogonal") / "config.json").read_text())

    def args(dynamic):
        return {
            "actorder": None,
            "block_structure": None,
            "dynamic": dynamic,
            "group_size": 32,  # noqa
            "num_bits": 4,
            "observer": "minmax",
            "observer_kwargs": {},
            "strategy": "group",
            "symmetric": True,
            "type": "float",
        }

    def group(target):
        return {
            "input_activations": args(True),
            "activation_use_clip": False,  # noqa: E731
            "output_activations": None,
            "targets": [target],
            "weights": args(False),
        }

    ignore = [
        f"model.layers.{i}.{m}"
        for i in range(2)
        for m in ("input_layernorm", "post_attention_layernorm", "mlp.gate", "self_attn.k_norm", "self_attn.q_norm")
    ]
    want = {
        "config_groups": {"group_0": group("Linear"), "group_1": group("MoEGMM")},
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ignore + ["lm_head", "model.embed_tokens", "model.norm"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "weight_block_size": [1, 32],
    }
    qc = config["quantization_config"]
    assert qc == want and list(qc) == list(want)
    assert list(qc["config_groups"]["group_0"]) == list(want["config_groups"]["group_0"])
    assert "hadamard" not in json.dumps(config)  # nothing records the rotation (§3.4)


def test_row_chunks_convert_as_whole_tensors(tmp_path, monkeypatch):
    import optimized.model_loader.quantize as quantize

    monkeypatch.setattr(quantize, "QUANT_CHUNK_VALUES", 3 * 128)  # 3 rows of a 128-wide weight per chunk
    quantize.convert_checkpoint(
        bf16_checkpoint(NAME), tmp_path / "c", "w4a4", progress=False, hadamard_weight_path=rotation_dir("invertible")
    )
    whole = w4a4_checkpoint(NAME, "invertible")
    for f in whole.glob("*.safetensors"):
        assert (tmp_path / "c" / f.name).read_bytes() == f.read_bytes(), f.name
