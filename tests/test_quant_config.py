"""The quantization package's seams: one QuantMethod interface, one QuantConfig parsed once per model build that
picks each layer's method by checkpoint prefix (the dense-MLP gate_proj a checkpoint keeps 16-bit included), and
the decoder layer's MLP picking the step's method that fits it (`step.moe` / `step.dense_mlp`)."""

from __future__ import annotations

import pytest
import torch

from fixtures.tiny import tiny_config
from optimized.config import dense_layers, is_sparse_layer
from optimized.distributed import ParallelState
from optimized.errors import UsageError
from optimized.layers.linear import RowParallelLinear
from optimized.layers.moe import Qwen3MoeMLP, Qwen3MoeSparseMoeBlock
from optimized.layers.quantization import schemes
from optimized.layers.quantization.base import FusedMoEMethod, LinearMethod, QuantMethod
from optimized.layers.quantization.config import QuantConfig, linear_method, moe_method
from optimized.layers.quantization.converter_config import recipe_quantization_config
from optimized.layers.quantization.errors import QuantConfigError
from optimized.layers.quantization.mxfp8 import MxFp8LinearMethod
from optimized.layers.quantization.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod
from optimized.layers.quantization.w4a4 import MxFp4LinearMethod, W4A4MxFp4MoEGMMMethod
from optimized.layers.quantization.w4a8 import W4A8MxFp4MoEGMMMethod
from optimized.layers.quantization.w8a8 import MxFp8MoEGMMMethod
from optimized.model import Qwen3MoeForCausalLM
from optimized.ops.mx_format import scale_name
from optimized.phases import DataParallelPhase, SequenceParallelPrefill, TensorParallelPhase

SCHEMES = [None, schemes.W4A8, schemes.W8A8, schemes.W4A4]


def _config(scheme: str | None, name: str = "tiny-dense"):
    config = tiny_config(name)
    if scheme is not None:
        config.quantization_config = recipe_quantization_config(config.num_hidden_layers, "bf16", scheme)
    return config


def test_quant_config_error_is_a_usage_error_and_still_a_value_error():
    assert issubclass(QuantConfigError, UsageError) and issubclass(QuantConfigError, ValueError)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_method_is_a_quant_method_of_its_kind(scheme):
    assert isinstance(linear_method(scheme), LinearMethod) and isinstance(moe_method(scheme), FusedMoEMethod)
    assert isinstance(linear_method(scheme), QuantMethod) and isinstance(moe_method(scheme), QuantMethod)
    with pytest.raises(TypeError):
        QuantMethod()  # the interface itself holds no format


@pytest.mark.parametrize(
    "scheme, linear, experts",
    [
        (None, UnquantizedLinearMethod, UnquantizedFusedMoEMethod),
        (schemes.W4A8, MxFp8LinearMethod, W4A8MxFp4MoEGMMMethod),
        (schemes.W8A8, MxFp8LinearMethod, MxFp8MoEGMMMethod),
        (schemes.W4A4, MxFp4LinearMethod, W4A4MxFp4MoEGMMMethod),
    ],
)
def test_the_method_per_prefix_follows_the_scheme(scheme, linear, experts):
    quant = QuantConfig.from_hf_config(_config(scheme), stored=lambda name: True)
    assert quant.scheme == scheme and not quant.sixteen_bit
    for prefix in (
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.down_proj",
    ):
        assert type(quant.linear_method(prefix)) is linear, prefix
    assert type(quant.moe_method("model.layers.3.mlp.experts")) is experts


@pytest.mark.parametrize("scheme", [schemes.W4A8, schemes.W8A8])
def test_a_dense_gate_proj_stored_without_scale_is_16_bit_decided_by_the_config(scheme):
    """The recipe's converter keeps a dense gate_proj 16-bit (config.json says nothing of it): the config asks the
    checkpoint which dense projections lack a scale partner, and only those get the unquantized method."""
    config = _config(scheme)
    dense = dense_layers(config)
    kept = {scale_name(f"model.layers.{i}.mlp.gate_proj.weight") for i in dense}
    quant = QuantConfig.from_hf_config(config, stored=lambda name: name not in kept)
    assert quant.sixteen_bit == {f"model.layers.{i}.mlp.gate_proj" for i in dense}
    for i in dense:
        assert type(quant.linear_method(f"model.layers.{i}.mlp.gate_proj")) is UnquantizedLinearMethod
        for proj in ("up_proj", "down_proj"):
            assert type(quant.linear_method(f"model.layers.{i}.mlp.{proj}")) is MxFp8LinearMethod
    # Without the checkpoint to ask (a model built from its config alone), every projection is in its scheme's format.
    assert not QuantConfig.from_hf_config(config).sixteen_bit


def test_the_mlp_is_built_for_its_projections_formats_before_any_load():
    config = _config(schemes.W4A8)
    dense = dense_layers(config)
    gate = {f"model.layers.{i}.mlp.gate_proj" for i in dense}
    model = Qwen3MoeForCausalLM(
        config, ParallelState.single(), torch.bfloat16, quant_config=QuantConfig(schemes.W4A8, frozenset(gate))
    )
    for i in dense:
        mlp = model.layers[i].mlp
        assert mlp.gate_up_proj is None
        assert type(mlp.gate_proj.quant_method) is UnquantizedLinearMethod
        assert mlp.gate_proj.weight.dtype == torch.bfloat16
        assert type(mlp.up_proj.quant_method) is MxFp8LinearMethod
        assert type(mlp.down_proj.quant_method) is MxFp8LinearMethod
    merged = Qwen3MoeForCausalLM(config, ParallelState.single(), torch.bfloat16)
    for i in dense:
        mlp = merged.layers[i].mlp
        assert mlp.gate_proj is None and type(mlp.gate_up_proj.quant_method) is MxFp8LinearMethod


def test_the_build_parses_the_quantization_config_once(monkeypatch):
    """Once per model, not once per layer: every layer gets its method from the model's QuantConfig."""
    config = _config(schemes.W4A8)
    calls = []
    parse = schemes.scheme_of
    monkeypatch.setattr(schemes, "scheme_of", lambda qc: calls.append(1) or parse(qc))
    model = Qwen3MoeForCausalLM(config, ParallelState.single(), torch.bfloat16)
    assert len(calls) == 1 and model.quant_config.scheme == schemes.W4A8
    assert all(type(layer.self_attn.o_proj.quant_method) is MxFp8LinearMethod for layer in model.layers)


class _RecordingStep:
    def __init__(self):
        self.calls = []

    def moe(self, block, router_in, expert_in):
        self.calls.append(("moe", block))
        return expert_in

    def dense_mlp(self, mlp, hidden):
        self.calls.append(("dense_mlp", mlp))
        return hidden


def test_each_mlp_calls_the_step_method_that_fits_it():
    config = _config(None)
    model = Qwen3MoeForCausalLM(config, ParallelState.single(), torch.float32)
    for i, layer in enumerate(model.layers):
        step, x = _RecordingStep(), torch.zeros(2, config.hidden_size)
        layer.mlp.forward_step(step, x, x)
        kind, cls = ("moe", Qwen3MoeSparseMoeBlock) if is_sparse_layer(config, i) else ("dense_mlp", Qwen3MoeMLP)
        assert step.calls == [(kind, layer.mlp)] and isinstance(layer.mlp, cls)


def test_only_attention_dp_builds_o_proj_without_its_reduction():
    assert TensorParallelPhase.reduces_o_proj and SequenceParallelPrefill.reduces_o_proj
    assert not DataParallelPhase.reduces_o_proj
    model = Qwen3MoeForCausalLM(_config(None, "tiny"), ParallelState.single(), torch.float32)
    assert all(layer.self_attn.o_proj.reduce_results for layer in model.layers)


def test_a_row_parallel_linear_without_reduction_returns_its_partial_product(monkeypatch):
    from optimized.distributed import collectives as comm

    one = ParallelState.single().attn_tp
    reduced = []
    monkeypatch.setattr(comm, "all_reduce", lambda y, group, **kw: reduced.append(y) or y)
    x = torch.randn(3, 8)
    for flag in (True, False):
        layer = RowParallelLinear(8, 4, one, torch.float32, reduce_results=flag)
        torch.nn.init.normal_(layer.weight)
        y = layer(x)
        torch.testing.assert_close(y, x @ layer.weight.t())
    assert len(reduced) == 1  # only the reducing one called all_reduce


def test_the_converter_and_the_cli_offer_the_schemes_of_the_table():
    from optimized.cli import convert as cli
    from optimized.model_loader import quantize

    assert tuple(cli.QUANT_TYPES) == quantize.QUANT_TYPES == schemes.MX_SCHEMES


@pytest.mark.parametrize("scheme", schemes.MX_SCHEMES)
def test_the_parser_reads_back_every_scheme_the_converter_writes(scheme):
    row = schemes.SCHEMES[scheme]
    kv = "fp8" if row.fp8_kv_cache else "bf16"
    assert schemes.scheme_of(recipe_quantization_config(4, kv, scheme)) == scheme
    assert row.activation_bits == {a for _, a in row.targets.values()}.pop()
