"""MX weights are prepared once after loading (`process_weights_after_loading`), never re-laid-out per call.

- MXFP8 linear, W4A8 (MXFP4) experts and W8A8 (MXFP8) experts give bitwise the outputs of the former per-call
  layouts (`weight.t()` / `transpose(1, 2)` and `pair_scales(scale).transpose(...)` on every call, written out
  inline here), odd block counts (the pair's zero pad byte) and empty / padded expert groups included.
- After processing, a forward re-lays out no weight: `pair_scales` is never called, and no aten operator outside
  the NPU kernels touches a weight or scale (a TorchDispatchMode sees every call the layer makes); the kernels
  receive exactly the layer's parameters.
- The processed parameters: weights the transposed views of the loaded bytes (same storage: no second copy),
  scales contiguous pairs of the runtime shape, on the layer's device (a meta-device layer stays on meta).
- Applying before processing, processing twice and loading after processing are errors naming the layer; the
  model build processes every layer with a quant method exactly once.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import optimized  # noqa: F401  (registers torch.ops.npu.*)
from equivalence.support.compare import assert_bitwise_equal
from fixtures.checkpoints import w4a8_checkpoint, w8a8_checkpoint
from optimized.layers import quantization as q
from optimized.layers.quantization import mx_layout, mxfp8, w4a4, w4a8, w8a8
from optimized.layers.linear import ReplicatedLinear
from optimized.layers.moe import FusedMoEGMM
from optimized.model_loader.build import load_model
from optimized.model_loader.loader import StateDictSource
from optimized.ops import mx_format as mxf

BF16 = torch.bfloat16
# K = 96: three 32-blocks, an odd count (the scale pairs' zero pad byte); I = 32: one block.
K, N, H, INTER, EXPERTS = 96, 40, 96, 32, 3
COUNTS = torch.tensor([5, 0, 4])  # an empty expert; 11 rows: 2 padding rows past the counts
ROWS = 11
ONE = SimpleNamespace(size=1, rank=0, group=None)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def linear_layer(seed: int = 0) -> ReplicatedLinear:
    w, s = mxf.mx_quantize_weight(torch.randn(N, K, generator=_gen(seed)).to(BF16), mxf.E4M3)
    layer = ReplicatedLinear(K, N, BF16, q.MxFp8LinearMethod())
    layer.load(StateDictSource({"lin.weight": w, "lin.weight_scale": s}), "lin.weight")
    return layer


def moe_layer(method, fmt, seed: int = 0) -> FusedMoEGMM:
    g, state = _gen(seed), {}
    for e in range(EXPERTS):
        for proj, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER))):
            state[f"m.{e}.{proj}.weight"], state[f"m.{e}.{proj}.weight_scale"] = mxf.mx_quantize_weight(
                torch.randn(shape, generator=g).to(BF16), fmt
            )
    layer = FusedMoEGMM(EXPERTS, H, INTER, ONE, ONE, BF16, method)
    layer.load(StateDictSource(state), "m")
    return layer


LAYERS = {
    "mxfp8_linear": lambda: linear_layer(),
    "w4a8_experts": lambda: moe_layer(q.W4A8MxFp4MoEGMMMethod(), mxf.E2M1),
    "w8a8_experts": lambda: moe_layer(q.MxFp8MoEGMMMethod(), mxf.E4M3),
}


def loaded_tensors(layer) -> dict[str, torch.Tensor]:
    """The layer's parameters as loaded (checkpoint layouts), cloned before processing."""
    return {name: p.detach().clone() for name, p in layer.named_parameters()}


def forward(layer, x):
    return layer(x) if isinstance(layer, ReplicatedLinear) else layer(x, COUNTS)


# The former per-call layouts, as quantization.py wrote them before weights were prepared after loading.


def old_linear(t, x, out_dtype=BF16):
    xq = q.mx_quant(x)
    return torch.ops.npu.npu_quant_matmul(
        xq.data,
        t["weight"].t(),
        mxf.pair_scales(t["weight_scale"]).transpose(0, 1),
        pertoken_scale=xq.scale,
        output_dtype=mxf.dtype_code(out_dtype),
        scale_dtype=q.FLOAT8_E8M0,
        pertoken_scale_dtype=q.FLOAT8_E8M0,
        group_sizes=[1, 1, q.BLOCK],
    )


def old_w4a8(t, x, counts):
    def gmm(xq, xs, w, s):
        return torch.ops.npu.npu_grouped_matmul(
            [xq],
            [w.transpose(1, 2)],
            antiquant_scale=[mxf.pair_scales(s).transpose(1, 2)],
            per_token_scale=[xs],
            group_list=counts,
            group_type=0,
            group_list_type=1,
            split_item=3,
            output_dtype=mxf.dtype_code(BF16),
            weight_dtype=q.FLOAT4_E2M1,
            per_token_scale_dtype=q.FLOAT8_E8M0,
        )[0]

    xq, xs = q.mx_quant(x)
    h = gmm(xq, xs, t["w13_weight"], t["w13_weight_scale"])
    hq, hs = torch.ops.npu.npu_swiglu_mx_quant(h, group_index=counts, activate_left=True, dst_type=q.FLOAT8_E4M3FN)
    return gmm(hq, hs, t["w2_weight"], t["w2_weight_scale"])


def old_w8a8(t, x, counts):
    def gmm(xq, w, s):
        return torch.ops.npu.npu_grouped_matmul(
            [xq.data],
            [w.transpose(1, 2)],
            scale=[mxf.pair_scales(s).transpose(1, 2)],
            per_token_scale=[xq.scale],
            group_list=counts,
            group_type=0,
            group_list_type=1,
            split_item=3,
            output_dtype=mxf.dtype_code(BF16),
            scale_dtype=q.FLOAT8_E8M0,
            per_token_scale_dtype=q.FLOAT8_E8M0,
        )[0]

    h = gmm(q.mx_quant(x), t["w13_weight"], t["w13_weight_scale"])
    return gmm(q.mx_quant(torch.ops.npu.npu_swiglu(h)), t["w2_weight"], t["w2_weight_scale"])


OLD = {
    "mxfp8_linear": lambda t, x: old_linear(t, x),
    "w4a8_experts": lambda t, x: old_w4a8(t, x, COUNTS),
    "w8a8_experts": lambda t, x: old_w8a8(t, x, COUNTS),
}


@pytest.mark.parametrize("kind", LAYERS)
def test_prepared_layouts_give_bitwise_the_per_call_layouts_outputs(kind):
    layer = LAYERS[kind]()
    loaded = loaded_tensors(layer)
    q.process_weights_after_loading(layer)
    g = _gen(7)
    for rows in (ROWS, 1):  # a batch and a decode row
        if kind != "mxfp8_linear" and rows != ROWS:
            continue
        x = (torch.randn(rows, K if kind == "mxfp8_linear" else H, generator=g) * 3).to(BF16)
        with torch.no_grad():
            assert_bitwise_equal(forward(layer, x), OLD[kind](loaded, x), f"{kind}, {rows} rows")
    if kind == "mxfp8_linear":  # already-quantized rows (MxRows) and a 3-D activation
        x = torch.randn(2, 3, K, generator=g).to(BF16)
        with torch.no_grad():
            assert_bitwise_equal(layer(q.mx_quant(x.view(6, K))), old_linear(loaded, x.view(6, K)), "MxRows input")
            assert_bitwise_equal(layer(x), old_linear(loaded, x.view(6, K)).view(2, 3, N), "3-D input")


class _WeightTouches(TorchDispatchMode):
    """Every operator call but a view outside the NPU kernels (a kernel's own aten calls run below this mode) that
    reads a tensor sharing storage with one of `params`; and every tensor argument the NPU calls pass from `params`."""

    def __init__(self, params):
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr(): name for name, p in params.items()}
        self.params = params
        self.relayouts, self.passed = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        for t in flat:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages:
                name = self.storages[t.untyped_storage().data_ptr()]
                if func.namespace == "npu":
                    self.passed.append((name, t))
                elif not func.is_view:  # a view (W4A8's transpose, as the recipe passes it) moves no byte
                    self.relayouts.append(f"{func} on {name}")
        return func(*args, **kwargs)


class _NoPairing:
    """mx_format as the quant methods see it, with pair_scales refused."""

    def __getattr__(self, name):
        return getattr(mxf, name)

    @staticmethod
    def pair_scales(*_):
        raise AssertionError("pair_scales called in a forward: the weight scales are re-paired per call")


@pytest.mark.parametrize("kind", LAYERS)
def test_a_forward_re_lays_out_no_weight(kind, monkeypatch):
    layer = LAYERS[kind]()
    q.process_weights_after_loading(layer)
    x = torch.randn(ROWS, K if kind == "mxfp8_linear" else H, generator=_gen(3)).to(BF16)

    for module in (mx_layout, mxfp8, w4a4, w4a8, w8a8):  # the quant methods' view of mx_format only (not the kernels')
        monkeypatch.setattr(module, "mxf", _NoPairing())
    params = dict(layer.named_parameters())
    with torch.no_grad(), _WeightTouches(params) as touches:
        forward(layer, x)
        forward(layer, x)
    assert not touches.relayouts, f"{kind}: per-call re-layouts of the weights: {touches.relayouts}"
    assert {name for name, _ in touches.passed} == set(params), f"{kind}: the kernels got {touches.passed}"
    for name, t in touches.passed:  # the parameter itself: same view, not a re-made one
        p = params[name]
        if kind == "w4a8_experts" and not name.endswith("scale"):
            p = p.transpose(1, 2)  # the recipe hands the grouped matmul the [L, K/2, N] transpose of the FP4 storage
        assert (t.shape, t.stride(), t.storage_offset(), t.data_ptr()) == (
            p.shape,
            p.stride(),
            p.storage_offset(),
            p.data_ptr(),
        ), f"{kind}: {name} passed as another view"


def _runtime_shapes(layer) -> dict[str, tuple]:
    nbp = lambda k: q.even_blocks(k) // 2  # noqa: E731  scale pairs per row
    if isinstance(layer, ReplicatedLinear):
        return {"weight": (K, N), "weight_scale": (nbp(K), N, 2)}
    scales = {"w13_weight_scale": (EXPERTS, nbp(H), 2 * INTER, 2), "w2_weight_scale": (EXPERTS, nbp(INTER), H, 2)}
    if isinstance(layer.quant_method, q.W4A8MxFp4MoEGMMMethod):  # FP4 kept in checkpoint order (two codes a byte)
        return {"w13_weight": (EXPERTS, 2 * INTER, H // 2), "w2_weight": (EXPERTS, H, INTER // 2), **scales}
    return {"w13_weight": (EXPERTS, H, 2 * INTER), "w2_weight": (EXPERTS, INTER, H), **scales}


@pytest.mark.parametrize("kind", LAYERS)
def test_processed_parameters_are_the_runtime_layouts(kind):
    layer = LAYERS[kind]()
    loaded = {name: (p.detach().clone(), p.data_ptr()) for name, p in layer.named_parameters()}
    q.process_weights_after_loading(layer)
    params = dict(layer.named_parameters())
    assert set(params) == set(loaded), "processing replaces the parameters, it adds none (no second copy)"
    for name, shape in _runtime_shapes(layer).items():
        p = params[name]
        assert tuple(p.shape) == shape and isinstance(p, torch.nn.Parameter) and not p.requires_grad, name
        if name.endswith("scale"):
            assert p.is_contiguous(), f"{name}: runtime scale pairs must be contiguous"
            want = mxf.pair_scales(loaded[name][0]).transpose(-3, -2)
            assert_bitwise_equal(p, want, f"{name}: the loaded bytes paired (§2.2) and transposed")
        else:
            assert p.data_ptr() == loaded[name][1], f"{name}: a copy of the weight, not its transposed view"
            want = loaded[name][0] if kind == "w4a8_experts" else loaded[name][0].transpose(-2, -1)
            assert_bitwise_equal(p, want, f"{name}: the loaded weight, transposed but for W4A8's FP4 storage")
    back = q.checkpoint_layout_parameters(layer)
    for name, (t, _) in loaded.items():
        assert_bitwise_equal(back[name], t, f"{name}: checkpoint_layout_parameters gives the loaded bytes back")


@pytest.mark.parametrize("kind", ["mxfp8_linear", "w4a8_experts"])
def test_processed_tensors_stay_on_the_layers_device(kind):
    """A layer built on `meta` (no values) is processed there: nothing is made on a default device."""
    with torch.device("meta"):
        layer = (
            ReplicatedLinear(K, N, BF16, q.MxFp8LinearMethod())
            if kind == "mxfp8_linear"
            else FusedMoEGMM(EXPERTS, H, INTER, ONE, ONE, BF16, q.W4A8MxFp4MoEGMMMethod())
        )
    q.process_weights_after_loading(layer)
    assert {p.device.type for p in layer.parameters()} == {"meta"}


@pytest.mark.parametrize("kind", LAYERS)
def test_apply_before_processing_twice_or_load_after_is_an_error_naming_the_layer(kind):
    layer = LAYERS[kind]()
    label = "lin" if kind == "mxfp8_linear" else r"\(m\)"
    x = torch.randn(ROWS, K if kind == "mxfp8_linear" else H).to(BF16)
    with pytest.raises(RuntimeError, match=f"{label}.*applied before process_weights_after_loading"):
        forward(layer, x)
    q.process_weights_after_loading(layer)
    # refused, not idempotent: a second pass would transpose the runtime layouts again
    with pytest.raises(RuntimeError, match=f"{label}.*already called"):
        q.process_weights_after_loading(layer)
    with pytest.raises(RuntimeError, match=f"{label}.*cannot load .* after process_weights_after_loading"):
        if kind == "mxfp8_linear":
            layer.load(StateDictSource({}), "lin.weight")
        else:
            layer.load(StateDictSource({}), "m")
    with torch.no_grad():
        forward(layer, x)  # still usable


@pytest.mark.parametrize(
    "path", [lambda: w4a8_checkpoint("tiny-dense"), lambda: w8a8_checkpoint("tiny")], ids=["w4a8-dense", "w8a8"]
)
def test_the_build_processes_every_quant_layer_exactly_once(path, monkeypatch):
    calls = {}
    for cls in (
        q.UnquantizedLinearMethod,
        q.MxFp8LinearMethod,
        q.UnquantizedFusedMoEMethod,
        q.W4A8MxFp4MoEGMMMethod,
        q.MxFp8MoEGMMMethod,
    ):
        original = cls.process_weights_after_loading

        def counted(self, layer, original=original):
            calls[id(layer)] = calls.get(id(layer), 0) + 1
            return original(self, layer)

        monkeypatch.setattr(cls, "process_weights_after_loading", counted)
    model = load_model(path(), dtype=BF16)
    layers = {id(m): name for name, m in model.named_modules() if hasattr(m, "quant_method")}
    assert {layers.get(i, i): n for i, n in calls.items()} == {name: 1 for name in layers.values()}
    mx = [name for name, m in model.named_modules() if hasattr(m, "runtime_layout")]
    assert mx and all(model.get_submodule(name).runtime_layout for name in mx)
