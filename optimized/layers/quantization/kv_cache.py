"""The KV cache's dtype: 16-bit, or the recipe's per-token FP8 (`quantization_config.kv_cache_scheme`).

Separate from the weight schemes: a checkpoint's KV scheme and the user's `model_config.kv_cache_dtype` choose the
cache dtype, whatever the weights are.
"""

from __future__ import annotations

import torch

from optimized.config import KV_CACHE_DTYPES
from optimized.layers.quantization.errors import QuantConfigError

FLOAT8 = "float8"  # the recipe's kv_cache_quant_mode: per-token FP8 E4M3 K/V, one fp32 scale per token
# What the recipe's converter writes (spec mx_quant.md §8.3): FP8, one dynamic symmetric scale per token.
KV_CACHE_SCHEME_FP8 = {
    "num_bits": 8,
    "type": "float",
    "strategy": "token",
    "group_size": -1,
    "dynamic": "true",
    "symmetric": "true",
}


def _json_true(value) -> bool:
    return value is True or value == "true"  # the converter writes the strings "true"


def quantization_config_dict(hf_config) -> dict | None:
    """config.json's `quantization_config` as a dict (transformers may hold it as an object), None when absent."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


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
            raise QuantConfigError(
                f"config.json quantization_config.kv_cache_scheme.{key}={got!r} is not supported; "
                f"the KV cache runs the recipe's per-token FP8 scheme {KV_CACHE_SCHEME_FP8} or 16-bit"
            )
    extra = sorted(set(kv) - set(KV_CACHE_SCHEME_FP8))
    if extra:
        raise QuantConfigError(
            f"config.json quantization_config.kv_cache_scheme.{extra[0]} is not a key of the "
            f"per-token FP8 scheme {KV_CACHE_SCHEME_FP8}"
        )
    return FLOAT8


def kv_cache_dtype(hf_config, choice: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache dtype that runs: 'auto' follows the checkpoint's kv_cache_scheme (as the recipe's loader
    does), 'bfloat16' keeps the cache in the activation dtype `dtype`, 'float8' quantizes it per token."""
    if choice not in KV_CACHE_DTYPES:
        raise QuantConfigError(f"kv_cache_dtype={choice!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    wanted = kv_cache_scheme(quantization_config_dict(hf_config)) if choice == "auto" else choice
    if wanted != FLOAT8:
        return dtype
    if dtype not in (torch.bfloat16, torch.float16):
        raise QuantConfigError(
            f"kv_cache_dtype float8 quantizes bfloat16 or float16 K/V (npu_dynamic_quant takes no "
            f"{dtype}); run dtype bfloat16 or set model_config.kv_cache_dtype: bfloat16"
        )
    return torch.float8_e4m3fn
