"""The model's quantization, parsed once per build: which quant method each layer gets, by checkpoint prefix.

`QuantConfig.from_hf_config(hf_config, stored)` reads config.json's `quantization_config` once (schemes.py; a
QuantConfigError names a key it cannot run) and the model asks it for each layer's method by checkpoint prefix
(`model.layers.3.self_attn.o_proj`): `linear_method(prefix)`, `moe_method(prefix)`, each a fresh method.

- unquantized: every linear and the experts 16-bit;
- W4A8: attention and dense-MLP linears MXFP8, the routed experts MXFP4 x MXFP8;
- W8A8: every linear and the experts MXFP8;
- W4A4: attention and dense-MLP linears and the experts MXFP4 x MXFP4.
`stored` (the weight source's `has`) tells a dense-MLP projection stored without its `weight_scale` partner in an
MXFP8 checkpoint, which is then 16-bit (`sixteen_bit`): config.json cannot tell the recipe's converter's dense
gate_proj apart from a quantized one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from optimized.config import dense_layers
from optimized.layers.quantization.base import FusedMoEMethod, LinearMethod
from optimized.layers.quantization.mxfp8 import MxFp8LinearMethod
from optimized.layers.quantization.schemes import MX_SCHEMES, W4A4, W4A8, W8A8, quant_scheme
from optimized.layers.quantization.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod
from optimized.layers.quantization.w4a4 import MxFp4LinearMethod, W4A4MxFp4MoEGMMMethod
from optimized.layers.quantization.w4a8 import W4A8MxFp4MoEGMMMethod
from optimized.layers.quantization.w8a8 import MxFp8MoEGMMMethod
from optimized.ops.mx_format import scale_name

DENSE_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def linear_method(scheme: str | None) -> LinearMethod:
    """A fresh linear method of `scheme` (None: unquantized)."""
    if scheme == W4A4:
        return MxFp4LinearMethod()
    return MxFp8LinearMethod() if scheme in MX_SCHEMES else UnquantizedLinearMethod()


def moe_method(scheme: str | None) -> FusedMoEMethod:
    """A fresh routed-experts method of `scheme` (None: unquantized)."""
    if scheme == W4A4:
        return W4A4MxFp4MoEGMMMethod()
    if scheme == W4A8:
        return W4A8MxFp4MoEGMMMethod()
    return MxFp8MoEGMMMethod() if scheme == W8A8 else UnquantizedFusedMoEMethod()


@dataclass(frozen=True)
class QuantConfig:
    """scheme: None, W4A8, W8A8 or W4A4. sixteen_bit: prefixes of linears the checkpoint stores 16-bit although the
    scheme quantizes their kind (dense-MLP projections without a scale partner)."""

    scheme: str | None = None
    sixteen_bit: frozenset[str] = frozenset()

    @classmethod
    def from_hf_config(cls, hf_config, stored: Callable[[str], bool] | None = None) -> "QuantConfig":
        """Parses `hf_config.quantization_config` (a QuantConfigError names a key it cannot run). stored: whether the
        checkpoint holds a tensor (the weight source's `has`; None: every tensor in its scheme's format)."""
        scheme = quant_scheme(hf_config)
        sixteen_bit = frozenset()
        if stored is not None and isinstance(linear_method(scheme), MxFp8LinearMethod):
            sixteen_bit = frozenset(
                prefix
                for i in dense_layers(hf_config)
                for prefix in (f"model.layers.{i}.mlp.{p}" for p in DENSE_PROJECTIONS)
                if not stored(scale_name(f"{prefix}.weight"))
            )
        return cls(scheme, sixteen_bit)

    def linear_method(self, prefix: str) -> LinearMethod:
        """The method of the linear whose checkpoint weight is `{prefix}.weight`."""
        return UnquantizedLinearMethod() if prefix in self.sixteen_bit else linear_method(self.scheme)

    def moe_method(self, prefix: str) -> FusedMoEMethod:
        """The method of the routed experts under `prefix` (`model.layers.N.mlp.experts`)."""
        return moe_method(self.scheme)
