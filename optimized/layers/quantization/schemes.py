"""Which MX scheme a checkpoint is: config.json's compressed-tensors `quantization_config` -> "w4a8", "w8a8", "w4a4".

Spec mx_quant.md §8.3: absent -> unquantized (None); group_0 Linear 8-bit with group_1 MoEGMM 4-bit weights -> W4A8;
group_0 Linear 8-bit alone (the recipe's `w8a8c16`: its experts fall to the Linear group) -> W8A8; both groups
4-bit weights and 4-bit activations (the recipe's `w4a4c16`, spec a4w4_hadamard.md §3) -> W4A4. Anything else is
a QuantConfigError naming the key. The model build parses it once (config.py); this module only names the scheme.
"""

from __future__ import annotations

from optimized.layers.quantization.errors import QuantConfigError
from optimized.layers.quantization.kv_cache import kv_cache_scheme
from optimized.ops import mx_format as mxf

W4A8 = "w4a8"
W8A8 = "w8a8"
W4A4 = "w4a4"
MX_SCHEMES = (W4A8, W8A8, W4A4)
# (weight bits, activation bits) per compressed-tensors target -> scheme (the recipe's converter writes exactly these)
_BITS = {
    W4A8: {"Linear": (8, 8), "MoEGMM": (4, 8)},
    W8A8: {"Linear": (8, 8)},
    W4A4: {"Linear": (4, 4), "MoEGMM": (4, 4)},
}


def quantization_config_dict(hf_config) -> dict | None:
    """config.json's `quantization_config` as a dict (transformers may hold it as an object), None when absent."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


def quant_scheme(hf_config) -> str | None:
    """None (unquantized), "w4a8", "w8a8" or "w4a4", from config.json's `quantization_config`; anything else is an
    error."""
    qc = quantization_config_dict(hf_config)
    return None if qc is None else scheme_of(qc)


def scheme_of(qc: dict) -> str:
    """W4A8, W8A8 or W4A4 for a compressed-tensors MX `quantization_config` dict; anything else is an error."""

    def need(ok: bool, key: str, value) -> None:
        if not ok:
            raise QuantConfigError(
                f"config.json quantization_config.{key}={value!r} is not supported; this model "
                "runs BF16 checkpoints and the W4A8 / W8A8 / W4A4 MX checkpoints of `python -m "
                "optimized convert --quant w4a8|w8a8|w4a4`"
            )

    need(qc.get("quant_method") == "compressed-tensors", "quant_method", qc.get("quant_method"))
    need(
        list(qc.get("weight_block_size") or []) == [1, mxf.BLOCK_SIZE], "weight_block_size", qc.get("weight_block_size")
    )
    bits = {}
    for name, group in (qc.get("config_groups") or {}).items():
        w, a = group.get("weights") or {}, group.get("input_activations") or {}
        need(w.get("type") == "float", f"config_groups.{name}.weights.type", w.get("type"))
        need(
            a.get("type") == "float" and a.get("num_bits") in (4, 8) and a.get("dynamic") is True,
            f"config_groups.{name}.input_activations",
            a,
        )
        for target in group.get("targets") or []:
            bits[target] = (w.get("num_bits"), a.get("num_bits"))
    scheme = next((name for name, want in _BITS.items() if bits == want), None)
    need(
        scheme is not None,
        "config_groups ((weight, activation) bits per target; w4a8: {'Linear': (8, 8), "
        "'MoEGMM': (4, 8)}, w8a8: {'Linear': (8, 8)}, w4a4: {'Linear': (4, 4), 'MoEGMM': (4, 4)})",
        bits,
    )
    kv_cache_scheme(qc)
    return scheme
