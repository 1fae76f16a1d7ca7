"""The `quantization_config` the converter writes into config.json, and the check that a checkpoint holds exactly it.

One writer for both sides: `python -m optimized convert` writes `recipe_quantization_config(...)` (the recipe's
converter's w4a8c16 / w8a8c16 / w4a4c16 output, spec mx_quant.md §8.3, key order as written), and loading a
checkpoint compares its config against the same dict (`check_recipe_quantization_config`), so the two cannot drift.
"""

from __future__ import annotations

from optimized.layers.quantization.errors import QuantConfigError
from optimized.layers.quantization.kv_cache import KV_CACHE_SCHEME_FP8, kv_cache_scheme
from optimized.layers.quantization.schemes import MX_SCHEMES, W4A8, scheme_of, scheme_row


def recipe_quantization_config(num_hidden_layers: int, kv_cache: str = "fp8", scheme: str = W4A8) -> dict:
    """The compressed-tensors `quantization_config` the recipe's converter writes for w4a8c16 (§8.3, key order as
    written), w8a8c16 (the same without group_1: the experts fall to group_0's 8-bit Linear scheme) or w4a4c16
    (both groups 4-bit weights and activations, `global_compression_ratio` a JSON null, no KV scheme: spec
    a4w4_hadamard.md §3.4); kv_cache "bf16": kv_cache_scheme null."""
    if scheme not in MX_SCHEMES:
        raise ValueError(f"quantization scheme {scheme!r} is not one of {', '.join(MX_SCHEMES)}")
    row = scheme_row(scheme)
    if not row.fp8_kv_cache and kv_cache != "bf16":
        raise QuantConfigError(
            f"quantization_config.kv_cache_scheme: the recipe's {scheme}c16 writes none (a 16-bit KV "
            f"cache); a {row.label} checkpoint with an FP8 KV scheme is not one it writes"
        )

    def args(bits: int, dynamic: bool) -> dict:
        return {
            "actorder": None,
            "block_structure": None,
            "dynamic": dynamic,
            "group_size": 32,
            "num_bits": bits,
            "observer": "minmax",
            "observer_kwargs": {},
            "strategy": "group",
            "symmetric": True,
            "type": "float",
        }

    def group(target: str) -> dict:
        weight_bits, act_bits = row.targets[target]
        return {
            "input_activations": args(act_bits, True),
            "activation_use_clip": False,
            "output_activations": None,
            "targets": [target],
            "weights": args(weight_bits, False),
        }

    ignore = [
        f"model.layers.{i}.{m}"
        for i in range(num_hidden_layers)
        for m in ("input_layernorm", "post_attention_layernorm", "mlp.gate", "self_attn.k_norm", "self_attn.q_norm")
    ]
    groups = {f"group_{i}": group(target) for i, target in enumerate(("Linear", "MoEGMM")) if target in row.targets}
    return {
        "config_groups": groups,
        "format": "float-quantized",
        "global_compression_ratio": None if row.json_null_compression_ratio else "null",
        "ignore": ignore + ["lm_head", "model.embed_tokens", "model.norm"],
        "kv_cache_scheme": dict(KV_CACHE_SCHEME_FP8) if kv_cache == "fp8" else None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "weight_block_size": [1, 32],
    }


def check_recipe_quantization_config(qc: dict, num_hidden_layers: int) -> None:
    """`qc` is exactly what the recipe's converter writes for a model of `num_hidden_layers` layers (§8.3), with
    or without kv_cache_scheme: a missing key, another key or another value is an error naming it."""
    kv = kv_cache_scheme(qc)  # the KV scheme's own errors name its key
    want = recipe_quantization_config(num_hidden_layers, "fp8" if kv else "bf16", scheme_of(qc))
    if "kv_cache_scheme" not in qc:
        del want["kv_cache_scheme"]
    _expect_same(qc, want, "quantization_config")


def _expect_same(got, want, path: str) -> None:
    def fail(what: str):
        raise QuantConfigError(
            f"config.json {path}{what}; this model runs the quantization_config the recipe's "
            f"converter (and `python -m optimized convert --quant w4a8|w8a8|w4a4`) writes"
        )

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
