"""model_config.enable_weight_nz: every linear, expert and MX weight is cast once to the NPU's NZ layout after loading
(`npu_format_cast(weight.contiguous(), 29)` in `process_weights_after_loading`; W4A8's FP4 experts in checkpoint
order [L, N, K/2] as packed FP4, as the recipe casts them), the router gate kept ND and contiguous, and never cast in
a step; every grouped matmul passes `tuning_config`. On the CPU the cast keeps the values and records the FRACTAL_NZ
layout the kernels then read by (docs/nz_format.md), so the outputs are bitwise those of ND weights.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import optimized  # noqa: F401  (registers torch.ops.npu.*)
from equivalence.support.compare import assert_bitwise_equal, assert_close
from equivalence.support.parallel_support import runner_of
from fixtures.checkpoints import checkpoint, w4a8_checkpoint, w8a8_checkpoint
from optimized.layers import quantization as q
from optimized.model_loader.build import load_model
from optimized.layers.quantization.mx_wire import FLOAT8_E4M3FN
from optimized.ops import mx_format as mxf
from optimized.ops.formats import nz_layout, nz_operand
from optimized.ops.registry import portable_kernel

pytestmark = pytest.mark.equivalence

PROMPTS = [[3, 1, 4, 1, 5], [2, 7]]
KINDS = {
    "float32": (lambda: checkpoint("tiny"), torch.float32),
    "bfloat16": (lambda: checkpoint("tiny"), torch.bfloat16),
    "w4a8": (lambda: w4a8_checkpoint("tiny"), torch.bfloat16),
    "w8a8": (lambda: w8a8_checkpoint("tiny"), torch.bfloat16),
}


class NpuCalls(TorchDispatchMode):
    """Every `npu::` call, counted by operator, with the tensors `npu_format_cast` was given and returned."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.casts: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        self.cast_dtypes: list[tuple[tuple, dict]] = []  # (input shape, customize_dtype / input_dtype given)
        self.gmm_weights: list[torch.Tensor] = []
        self.gmm_tuning: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "npu":
            name = func._overloadpacket.__name__
            self.ops[name] += 1
            if name == "npu_format_cast":
                self.casts.append((args[0], args[1] if len(args) > 1 else kwargs["acl_format"], out))
                self.cast_dtypes.append((tuple(args[0].shape), {k: v for k, v in kwargs.items() if k != "acl_format"}))
            if name == "npu_grouped_matmul":
                self.gmm_tuning.append(kwargs.get("tuning_config"))
                self.gmm_weights.append(args[1][0])
        return out


def _nz_weights(model) -> dict[str, torch.Tensor]:
    """The weights the recipe casts to NZ: each quant-method layer's weights, the router gate excepted."""
    out = {}
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or getattr(module, "router", False):
            continue
        if isinstance(method, q.UnquantizedFusedMoEMethod):
            attrs = ("w13", "w2")
        elif isinstance(method, (q.W4A8MxFp4MoEGMMMethod, q.MxFp8MoEGMMMethod)):
            attrs = ("w13_weight", "w2_weight")
        else:
            attrs = ("weight",)
        out.update({f"{prefix}.{a}": getattr(module, a) for a in attrs})
    return out


def _build(kind: str, weight_nz: bool):
    path, dtype = KINDS[kind]
    with NpuCalls() as calls:
        model = load_model(path(), dtype=dtype, device="cpu", weight_nz=weight_nz)
    return model, calls


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_weight_is_cast_to_nz_once_at_load_and_never_in_a_step(kind):
    model, load = _build(kind, weight_nz=True)
    weights = _nz_weights(model)
    assert load.ops == Counter({"npu_format_cast": len(weights)}), (
        f"{kind}: the load should call npu_format_cast once per weight ({len(weights)}) and nothing else: {load.ops}"
    )
    assert all(fmt == q.ACL_FORMAT_FRACTAL_NZ for _, fmt, _ in load.casts), [fmt for _, fmt, _ in load.casts]
    assert all(src.is_contiguous() for src, _, _ in load.casts), "the recipe casts contiguous weights"
    cast_outputs = {out.data_ptr() for _, _, out in load.casts}
    not_cast = [name for name, w in weights.items() if w.data_ptr() not in cast_outputs]
    assert not not_cast, f"{kind}: weights the kernels read that are not the cast's outputs: {not_cast}"
    gates = [m for m in model.modules() if getattr(m, "router", False)]
    assert gates and all(g.weight.is_contiguous() and g.weight.data_ptr() not in cast_outputs for g in gates), (
        "the router gate is made contiguous and kept ND"
    )
    assert all(nz_layout(w) is not None for w in weights.values()), f"{kind}: a weight without its NZ layout"
    with NpuCalls() as step:
        runner_of(model).generate(PROMPTS, 2)
    assert step.ops and step.ops["npu_format_cast"] == 0, f"{kind}: a step cast a weight: {step.ops}"


def test_w4a8_fp4_experts_are_cast_in_checkpoint_order_as_packed_fp4_and_read_transposed():
    """The recipe casts the [L, N, K/2] storage (packed along K) with customize_dtype=float8_e4m3fn and
    input_dtype=float4_e2m1fn_x2, and hands the grouped matmul its transpose [L, K/2, N]: fractal rows and FP4 pairs
    both along K. The build's other casts (MXFP8 attention linears) take no dtype arguments."""
    model, load = _build("w4a8", weight_nz=True)
    experts = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), q.W4A8MxFp4MoEGMMMethod)]
    hidden, inter = experts[0].hidden_size, experts[0].inter_per_rank
    fp4 = [(shape, kw) for shape, kw in load.cast_dtypes if kw]
    local = experts[0].w13_weight.shape[0]
    want = {(local, 2 * inter, hidden // 2), (local, hidden, inter // 2)}
    assert {shape for shape, _ in fp4} == want, f"FP4 casts of {sorted({s for s, _ in fp4})}; the recipe's: {want}"
    assert len(fp4) == 2 * len(experts)
    assert all(kw == {"customize_dtype": FLOAT8_E4M3FN, "input_dtype": mxf.float4_e2m1fn_x2} for _, kw in fp4), fp4
    for m in experts:
        for w in (m.w13_weight, m.w2_weight):
            layout = nz_layout(w)
            assert layout.fp4 and layout.c0 == 32 and layout.shape == tuple(w.shape), layout
    with NpuCalls() as step:
        runner_of(model).generate(PROMPTS, 2)
    assert step.gmm_weights and all(nz_operand("test", "weight", w).transposed for w in step.gmm_weights)


@pytest.mark.parametrize("kind", list(KINDS))
def test_nz_weights_give_bitwise_the_nd_weights_outputs(kind):
    """The cast changes the layout, not a value: the weights equal the ND build's bit for bit, and so do the logits
    of the 16-bit and MX runs (the CPU's bf16 kernels pack either layout to the same order); fp32's BLAS sums a
    contiguous and a transposed weight in another order: within the fp32 entry of the table."""
    nz, _ = _build(kind, weight_nz=True)
    nd, load = _build(kind, weight_nz=False)
    assert load.ops["npu_format_cast"] == 0, "enable_weight_nz: false casts nothing"
    for name, w in _nz_weights(nd).items():
        assert_bitwise_equal(_nz_weights(nz)[name], w, name)
    got = runner_of(nz).generate(PROMPTS, 3, return_logits=True)
    want = runner_of(nd).generate(PROMPTS, 3, return_logits=True)
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits):
        if kind == "float32":
            assert_close(a, b, "model.float32", f"{kind} logits")
        else:
            assert_bitwise_equal(a, b, f"{kind} logits")


@pytest.mark.parametrize("kind", ["bfloat16", "w4a8", "w8a8"])
def test_every_grouped_matmul_passes_the_tuning_config(kind):
    model, _ = _build(kind, weight_nz=True)
    with NpuCalls() as step:
        runner_of(model).generate(PROMPTS, 2)
    assert step.gmm_tuning and all(t == q.GMM_TUNING_CONFIG for t in step.gmm_tuning), step.gmm_tuning


def test_the_build_checks_npu_format_cast_only_with_weight_nz():
    from optimized.ops.required import required_operators

    args = dict(dense_mlp=False)
    assert "npu_format_cast" in required_operators(**args, weight_nz=True)
    assert "npu_format_cast" not in required_operators(**args, weight_nz=False)


@given(
    shape=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    transpose=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8]),
    fmt=st.sampled_from([2, 29]),
)
def test_npu_format_cast_keeps_every_value(shape, transpose, dtype, fmt):
    x = torch.randn(shape).mul(4).to(dtype)
    if transpose:
        x = x.transpose(-1, -2)
    for kernel in (torch.ops.npu.npu_format_cast, portable_kernel("npu_format_cast")):
        y = kernel(x, fmt)
        assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
        assert torch.equal(
            y.view(torch.uint8) if dtype.itemsize == 1 else y,
            x.contiguous().view(torch.uint8) if dtype.itemsize == 1 else x,
        )
        assert y.data_ptr() != x.data_ptr(), "an operator may not alias its input"


def test_npu_format_cast_refuses_other_formats_and_nz_below_two_dims():
    """(The FRACTAL_NZ layout itself, its block shapes and its readers: equivalence/ops/test_ops_formats.py.)"""
    with pytest.raises(ValueError, match=r"npu_format_cast: acl_format=3 is not supported; allowed: 2 \(ND\), 29"):
        torch.ops.npu.npu_format_cast(torch.ones(2, 2), 3)
    with pytest.raises(ValueError, match=r"FRACTAL_NZ \(29\).*>= 2 dims; got shape \(4,\)"):
        torch.ops.npu.npu_format_cast(torch.ones(4), 29)
