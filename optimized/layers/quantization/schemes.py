"""The quantization schemes in one table, and the one parser of config.json's `quantization_config`.

A scheme row says everything the rest of the project asks about a checkpoint's quantization: the linear and routed
experts' methods, the bits per compressed-tensors target (what the converter writes and the parser recognizes), the
activation bits, whether the recipe's sequence-parallel prefill runs it and what its activations travel as there,
whether `enable_hadamard` rotates its attention linears, and the operators its methods call beyond the 16-bit ones.
Code asks the row (`scheme_row(name).sp_wire`) instead of naming W4A4 / W4A8 / W8A8 in an if-chain; adding a scheme
is adding a row (docs/quantization.md, "Add a quantization scheme").

Spec mx_quant.md §8.3: absent -> unquantized (the 16-bit row, name None); group_0 Linear 8-bit with group_1 MoEGMM
4-bit weights -> W4A8; group_0 Linear 8-bit alone (the recipe's `w8a8c16`: its experts fall to the Linear group) ->
W8A8; both groups 4-bit weights and 4-bit activations (the recipe's `w4a4c16`, spec a4w4_hadamard.md §3) -> W4A4.
Anything else is a QuantConfigError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optimized.layers.quantization.base import FusedMoEMethod, LinearMethod
from optimized.layers.quantization.errors import QuantConfigError
from optimized.layers.quantization.kv_cache import kv_cache_scheme, quantization_config_dict
from optimized.layers.quantization.mxfp8 import MxFp8LinearMethod
from optimized.layers.quantization.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod
from optimized.layers.quantization.w4a4 import MxFp4LinearMethod, W4A4MxFp4MoEGMMMethod
from optimized.layers.quantization.w4a8 import W4A8MxFp4MoEGMMMethod
from optimized.layers.quantization.w8a8 import MxFp8MoEGMMMethod
from optimized.ops import mx_format as mxf
from optimized.ops import required

W4A8 = "w4a8"
W8A8 = "w8a8"
W4A4 = "w4a4"
MXFP8_WIRE = "mxfp8"  # the SP prefill moves MXFP8 rows (quantized once, before the exchange)


@dataclass(frozen=True)
class QuantScheme:
    """One row of the table. name: the `convert --quant` name (None: a 16-bit checkpoint)."""

    name: str | None
    label: str  # how messages and start-up lines name it
    linear: type[LinearMethod]
    moe: type[FusedMoEMethod]
    # (weight bits, activation bits) per compressed-tensors target, as the recipe's converter writes them
    targets: dict[str, tuple[int, int]] = field(default_factory=dict)
    sp_prefill: bool = True  # the recipe's prefill_opt runs it (False: the TP prefill; prefill_opt: true refused)
    sp_wire: str | None = None  # what the SP prefill's activations travel as (None: the model dtype)
    hadamard: bool = False  # enable_hadamard rotates its attention linears (ignored for the others, as the recipe)
    operators: frozenset[str] = frozenset()  # torch.ops.npu operators its methods call beyond the 16-bit ones
    fused_swiglu_experts: bool = False  # its experts run npu_swiglu_mx_quant instead of npu_swiglu
    # The recipe's converter's own choices for it (spec mx_quant.md §8.3, a4w4_hadamard.md §3.4): whether it may write
    # the FP8 KV scheme, and whether global_compression_ratio is a JSON null (else the string "null").
    fp8_kv_cache: bool = True
    json_null_compression_ratio: bool = False

    @property
    def activation_bits(self) -> int | None:
        bits = {a for _, a in self.targets.values()}
        return bits.pop() if len(bits) == 1 else None

    def linear_method(self) -> LinearMethod:
        return self.linear()

    def moe_method(self) -> FusedMoEMethod:
        return self.moe()


UNQUANTIZED = QuantScheme(None, "BF16", UnquantizedLinearMethod, UnquantizedFusedMoEMethod)
SCHEMES: dict[str | None, QuantScheme] = {
    None: UNQUANTIZED,
    W4A8: QuantScheme(
        W4A8,
        "W4A8",
        MxFp8LinearMethod,
        W4A8MxFp4MoEGMMMethod,
        {"Linear": (8, 8), "MoEGMM": (4, 8)},
        sp_wire=MXFP8_WIRE,  # the recipe's prefill_opt takes gmm_quant_mode w4a8mxfloat4 (spec mx_quant.md §9.2)
        operators=required.MXFP8 | required.W4A8_EXPERTS,
        fused_swiglu_experts=True,
    ),
    # W8A8's SP prefill moves 16-bit activations: each MXFP8 linear / expert quantizes its own input
    W8A8: QuantScheme(W8A8, "W8A8", MxFp8LinearMethod, MxFp8MoEGMMMethod, {"Linear": (8, 8)}, operators=required.MXFP8),
    W4A4: QuantScheme(
        W4A4,
        "W4A4",
        MxFp4LinearMethod,
        W4A4MxFp4MoEGMMMethod,
        {"Linear": (4, 4), "MoEGMM": (4, 4)},
        sp_prefill=False,  # prefill_opt requires mm_quant_mode != w4a4mxfloat4 (spec a4w4_hadamard.md §1.4)
        hadamard=True,
        fp8_kv_cache=False,
        json_null_compression_ratio=True,
        operators=required.MXFP8,  # the same two operators with FP4 operands
    ),
}
MX_SCHEMES = tuple(name for name in SCHEMES if name is not None)


def scheme_row(scheme: str | QuantScheme | None) -> QuantScheme:
    """The table's row of a scheme name (None: 16-bit); a row is returned as it is."""
    if isinstance(scheme, QuantScheme):
        return scheme
    if scheme not in SCHEMES:
        raise ValueError(f"quantization scheme {scheme!r} is not one of {', '.join(MX_SCHEMES)}")
    return SCHEMES[scheme]


def quant_scheme(hf_config) -> str | None:
    """None (unquantized), "w4a8", "w8a8" or "w4a4", from config.json's `quantization_config`; anything else is an
    error (QuantConfigError naming the key). The one parser: everything else asks this or the row it names."""
    qc = quantization_config_dict(hf_config)
    return None if qc is None else scheme_of(qc)


def scheme_of(qc: dict) -> str:
    """The scheme name of a compressed-tensors MX `quantization_config` dict; anything else is an error."""

    def need(ok: bool, key: str, value) -> None:
        if not ok:
            raise QuantConfigError(
                f"config.json quantization_config.{key}={value!r} is not supported; this model "
                f"runs BF16 checkpoints and the {' / '.join(SCHEMES[n].label for n in MX_SCHEMES)} MX checkpoints "
                f"of `python -m optimized convert --quant {'|'.join(MX_SCHEMES)}`"
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
    scheme = next((name for name in MX_SCHEMES if SCHEMES[name].targets == bits), None)
    need(
        scheme is not None,
        "config_groups ((weight, activation) bits per target; "
        + ", ".join(f"{n}: {SCHEMES[n].targets}" for n in MX_SCHEMES)
        + ")",
        bits,
    )
    kv_cache_scheme(qc)
    return scheme
