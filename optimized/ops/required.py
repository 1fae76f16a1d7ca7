"""Which `torch.ops.npu` operators a model configuration calls, and the check at build that all of them exist.

With torch_npu present the registry registers nothing, so an older torch_npu that lacks an operator (FIA v2, the
MX norms, `npu_swiglu_mx_quant`) or has it under another schema would otherwise fail mid-forward. The check
compares each required operator's schema with `SCHEMAS`: every argument the model may pass must be there with
the same name, type and keyword-only-ness, in the same order; extra arguments need defaults; returns must match.
(equivalence/npu/test_recorded_npu_calls.py pins the sets below to the calls the model is recorded making.)
"""

from __future__ import annotations

import importlib.metadata
import sys

import torch

from ..platform import torch_npu_available
from optimized.errors import UsageError
from .registry import NAMESPACE
from .schemas import SCHEMAS

COMMON = frozenset(
    {
        "npu_rms_norm",
        "npu_add_rms_norm",
        "npu_apply_rotary_pos_emb",
        "npu_fused_infer_attention_score_v2",
        "npu_scatter_nd_update_",
        "npu_moe_gating_top_k_softmax",
        "npu_moe_init_routing_v2",
        "npu_moe_finalize_routing",
        "npu_grouped_matmul",
    }
)
MXFP8 = frozenset({"npu_dynamic_mx_quant", "npu_quant_matmul"})  # MXFP8 linears (W4A8 and W8A8)
W4A8_EXPERTS = frozenset({"npu_swiglu_mx_quant"})  # fused SwiGLU + MX quantization
MX_SP_PREFILL = frozenset(
    {"npu_rms_norm_dynamic_mx_quant", "npu_add_rms_norm_dynamic_mx_quant", "npu_add_rms_norm_cast"}
)  # MXFP8 on the SP wire
DOUBLE_ROUTING = frozenset({"npu_moe_re_routing"})
MC2_DECODE = frozenset({"npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2"})  # EP decode
FP8_KV_CACHE = frozenset({"npu_dynamic_quant"})  # per-token K/V quantization (checked by the runner)
WEIGHT_NZ = frozenset({"npu_format_cast"})  # model_config.enable_weight_nz: each weight cast once at load


class MissingNpuOperatorError(UsageError, RuntimeError):
    """torch_npu lacks operators this model calls, or has them under other schemas (the message lists them)."""


def required_operators(
    *,
    dense_mlp: bool,
    scheme_operators: frozenset[str] = frozenset(),
    fused_swiglu_experts: bool = False,
    mx_wire: bool = False,
    double_routing: bool = False,
    mc2_decode: bool = False,
    weight_nz: bool = True,
) -> frozenset[str]:
    """The operators a model calls, from what its plan and quantization scheme say (model_loader.build
    `operators_for` reads them): the scheme's own operators and whether its experts fuse SwiGLU with the MX
    quantization, a dense (non-MoE) MLP layer or not, MXFP8 on the SP prefill's wire, a prefill MoE by double routing
    (the SP prefill's alltoall, the attention-DP prefill), an MC2 decode, and whether the weights are cast to NZ at
    load (enable_weight_nz)."""
    ops = set(COMMON) | set(scheme_operators)
    if weight_nz:
        ops |= WEIGHT_NZ
    if mc2_decode:
        ops |= MC2_DECODE
    if mx_wire:
        ops |= MX_SP_PREFILL
    if not fused_swiglu_experts or dense_mlp:  # unfused experts and every dense MLP run npu_swiglu
        ops.add("npu_swiglu")
    if double_routing:
        ops |= DOUBLE_ROUTING
    return frozenset(ops)


def find_schema(qualname: str) -> torch._C.FunctionSchema | None:
    """The schema registered for `npu::<qualname>` (torch_npu's or the portable one), None if there is none."""
    name, _, overload = qualname.partition(".")
    try:
        return torch._C._get_schema(f"{NAMESPACE}::{name}", overload)
    except RuntimeError:
        return None


def schema_mismatch(expected: torch._C.FunctionSchema, found: torch._C.FunctionSchema) -> str | None:
    """Why `found` cannot take the calls written for `expected`, or None."""
    have = {a.name: (i, a) for i, a in enumerate(found.arguments)}
    last = -1
    for arg in expected.arguments:
        if arg.name not in have:
            return f"no argument {arg.name!r}"
        i, other = have[arg.name]
        if str(other.type) != str(arg.type) or other.kwarg_only != arg.kwarg_only:
            return f"argument {arg.name!r} is {other.type}{' (keyword-only)' * other.kwarg_only}; expected {arg.type}"
        if i < last:
            return f"argument {arg.name!r} is out of order"
        last = i
    names = {a.name for a in expected.arguments}
    extra = [a.name for a in found.arguments if a.name not in names and not a.has_default_value()]
    if extra:
        return f"extra arguments without defaults: {extra}"
    if [str(r.type) for r in found.returns] != [str(r.type) for r in expected.returns]:
        return f"returns {[str(r.type) for r in found.returns]}; expected {[str(r.type) for r in expected.returns]}"
    return None


def torch_npu_version() -> str:
    module = sys.modules.get("torch_npu")
    if module is not None and getattr(module, "__version__", None):
        return module.__version__
    try:
        return importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_operators(required) -> None:
    """Raise MissingNpuOperatorError naming every required operator that is missing or has another schema."""
    problems = []
    for qualname in sorted(required):
        found = find_schema(qualname)
        if found is None:
            problems.append(f"{qualname}: missing")
            continue
        why = schema_mismatch(torch._C.parse_schema(f"{NAMESPACE}::{SCHEMAS[qualname]}"), found)
        if why:
            problems.append(f"{qualname}: {why}")
    if problems:
        provider = f"torch_npu {torch_npu_version()}" if torch_npu_available() else "the portable kernels"
        raise MissingNpuOperatorError(
            f"this model calls torch.ops.npu operators that {provider} does not provide as expected:\n  "
            + "\n  ".join(problems)
            + "\nupgrade torch_npu (and CANN) to a release that has them"
        )
