"""Quant methods (vLLM-style): each linear / grouped-matmul layer owns one, chosen once when the model is built.

    base.py             the QuantMethod interface every method subclasses (create, load, process once, apply)
    config.py           QuantConfig: the checkpoint's quantization_config parsed once; the method per layer prefix
    schemes.py          which scheme a quantization_config is (None / w4a8 / w8a8 / w4a4)
    unquantized.py      16-bit linears and experts
    mxfp8.py, w8a8.py   MXFP8 linears; MXFP8 experts
    w4a8.py, w4a4.py    MXFP4 experts with MXFP8 activations; MXFP4 linears (rotated input) and experts
    mx_layout.py        MX weights' checkpoint and runtime layouts
    lifecycle.py        load -> process_weights_after_loading once -> apply, and its errors
    mx_wire.py          MxRows: MXFP8 activation rows as they move between ranks
    kv_cache.py         the KV cache's dtype (kv_cache_scheme, model_config.kv_cache_dtype)
    converter_config.py the quantization_config the converter writes, and the loader's exact check of it

Import from the module that holds a name; this package re-exports the public ones for interactive use.
"""

from optimized.layers.quantization.base import GMM_TUNING_CONFIG, FusedMoEMethod, LinearMethod, QuantMethod
from optimized.layers.quantization.config import QuantConfig, linear_method, moe_method
from optimized.layers.quantization.converter_config import check_recipe_quantization_config, recipe_quantization_config
from optimized.layers.quantization.errors import QuantConfigError
from optimized.layers.quantization.kv_cache import FLOAT8, KV_CACHE_SCHEME_FP8, kv_cache_dtype, kv_cache_scheme
from optimized.layers.quantization.lifecycle import (
    ACL_FORMAT_FRACTAL_NZ,
    checkpoint_layout_parameters,
    process_weights_after_loading,
)
from optimized.layers.quantization.mx_layout import (
    BLOCK,
    FLOAT4_E2M1,
    FLOAT8_E8M0,
    block_slice,
    even_blocks,
    transpose_packed_fp4,
    untranspose_packed_fp4,
)
from optimized.layers.quantization.mx_wire import FLOAT8_E4M3FN, MxRows, map_rows, mx_quant, num_rows
from optimized.layers.quantization.mxfp8 import MxFp8LinearMethod
from optimized.layers.quantization.schemes import (
    MX_SCHEMES,
    MXFP8_WIRE,
    SCHEMES,
    W4A4,
    W4A8,
    W8A8,
    QuantScheme,
    quant_scheme,
    scheme_of,
    scheme_row,
)
from optimized.layers.quantization.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod
from optimized.layers.quantization.w4a4 import MxFp4LinearMethod, W4A4MxFp4MoEGMMMethod, fp4_quant
from optimized.layers.quantization.w4a8 import W4A8MxFp4MoEGMMMethod
from optimized.layers.quantization.w8a8 import MxFp8MoEGMMMethod

__all__ = [
    "ACL_FORMAT_FRACTAL_NZ",
    "BLOCK",
    "FLOAT4_E2M1",
    "FLOAT8",
    "FLOAT8_E4M3FN",
    "FLOAT8_E8M0",
    "GMM_TUNING_CONFIG",
    "KV_CACHE_SCHEME_FP8",
    "MX_SCHEMES",
    "MXFP8_WIRE",
    "SCHEMES",
    "W4A4",
    "W4A8",
    "W8A8",
    "FusedMoEMethod",
    "LinearMethod",
    "MxFp4LinearMethod",
    "MxFp8LinearMethod",
    "MxFp8MoEGMMMethod",
    "MxRows",
    "QuantConfig",
    "QuantConfigError",
    "QuantMethod",
    "QuantScheme",
    "UnquantizedFusedMoEMethod",
    "UnquantizedLinearMethod",
    "W4A4MxFp4MoEGMMMethod",
    "W4A8MxFp4MoEGMMMethod",
    "block_slice",
    "check_recipe_quantization_config",
    "checkpoint_layout_parameters",
    "even_blocks",
    "fp4_quant",
    "kv_cache_dtype",
    "kv_cache_scheme",
    "linear_method",
    "map_rows",
    "moe_method",
    "mx_quant",
    "num_rows",
    "process_weights_after_loading",
    "quant_scheme",
    "recipe_quantization_config",
    "scheme_of",
    "scheme_row",
    "transpose_packed_fp4",
    "untranspose_packed_fp4",
]
