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
from optimized.layers.quantization.schemes import QuantScheme, quant_scheme, scheme_row
from optimized.layers.quantization.unquantized import UnquantizedLinearMethod
from optimized.ops.mx_format import scale_name

DENSE_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def linear_method(scheme: str | None) -> LinearMethod:
    """A fresh linear method of `scheme` (None: unquantized): the table's."""
    return scheme_row(scheme).linear_method()


def moe_method(scheme: str | None) -> FusedMoEMethod:
    """A fresh routed-experts method of `scheme` (None: unquantized): the table's."""
    return scheme_row(scheme).moe_method()


@dataclass(frozen=True)
class QuantConfig:
    """scheme: a name of the table (schemes.SCHEMES; None: 16-bit). sixteen_bit: prefixes of linears the checkpoint
    stores 16-bit although the scheme quantizes their kind (dense-MLP projections without a scale partner)."""

    scheme: str | None = None
    sixteen_bit: frozenset[str] = frozenset()

    @classmethod
    def from_hf_config(cls, hf_config, stored: Callable[[str], bool] | None = None) -> "QuantConfig":
        """Parses `hf_config.quantization_config` (a QuantConfigError names a key it cannot run). stored: whether the
        checkpoint holds a tensor (the weight source's `has`; None: every tensor in its scheme's format)."""
        scheme = quant_scheme(hf_config)
        sixteen_bit = frozenset()
        if stored is not None and issubclass(scheme_row(scheme).linear, MxFp8LinearMethod):
            sixteen_bit = frozenset(
                prefix
                for i in dense_layers(hf_config)
                for prefix in (f"model.layers.{i}.mlp.{p}" for p in DENSE_PROJECTIONS)
                if not stored(scale_name(f"{prefix}.weight"))
            )
        return cls(scheme, sixteen_bit)

    @property
    def row(self) -> QuantScheme:
        """The scheme's row of the table: what the plan and the build ask of it."""
        return scheme_row(self.scheme)

    def linear_method(self, prefix: str) -> LinearMethod:
        """The method of the linear whose checkpoint weight is `{prefix}.weight`."""
        return UnquantizedLinearMethod() if prefix in self.sixteen_bit else linear_method(self.scheme)

    def moe_method(self, prefix: str) -> FusedMoEMethod:
        """The method of the routed experts under `prefix` (`model.layers.N.mlp.experts`)."""
        return moe_method(self.scheme)
