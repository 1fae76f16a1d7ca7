"""The optimized model runs on a device that is not the CPU, proven on a host without an accelerator.

The device is `npu:0` of `equivalence.support.fake_device` (a Python backend: real values on the host underneath,
every operator call checked to take tensors of one device). Single process, each fixture:
- built there (`load_model(..., device="npu")`), every parameter and buffer lands on npu:0; the runner's
  prefill and greedy decode steps run with no operator ever seeing a host tensor, and give bitwise the
  tokens and logits of the same run on the CPU (drawn prompt batches);
- one forward step (prefill or decode) reads nothing back from the device and copies nothing onto it:
  the step's host data (sequence lengths) are the host lists of ForwardMetadata, the position check too;
  so does a step of the W8A8 checkpoint with the per-token FP8 KV cache (bf16);
- the MC2 decode (`dispatch_combine`: npu_moe_distribute_dispatch_v2 / combine_v2, which at world 1 need no
  group) generates bitwise what the same model does on the CPU, and its decode step reads / copies nothing
  (the multi-rank proof, attention DP over MC2: test_device_discipline_parallel.py);
- the detector works: the causal mask built on the host (as `causal_mask_template` once did by default),
  or any host tensor reaching an operator of the forward, fails the step with DeviceMismatch;
- the count tensor of `exchange_split_sizes` and the default device of `load_model` follow the device;
- the W4A8 and W8A8 conversions with the per-token FP8 KV cache run there too, bitwise the CPU run (bf16).
"""

from __future__ import annotations


import pytest
import torch

from equivalence.support.device_discipline import (
    NEW_TOKENS,
    assert_no_reads_nor_transfers,
    extend_step,
    fake_npu,
    generate,
    one_step,
)
from equivalence.support.fake_device import DeviceMismatch, DeviceTensor, on_fake_device, to_host
from equivalence.support.parallel_support import decode_metadata, run_property
from equivalence.support.strategies import BLOCK_SIZE, prompt_batches
from fixtures.checkpoints import checkpoint
from fixtures.tiny import tiny_config
from optimized import platform
from optimized.executor.kv_cache import PagedKVCache, block_table
from optimized.executor.model_runner import ModelRunner
from optimized.model_loader.build import load_model

pytestmark = pytest.mark.equivalence

FIXTURES = ("tiny", "tiny-nonorm", "tiny-dense")


def device_model(name: str):
    with on_fake_device():
        return load_model(checkpoint(name), dtype=torch.float32, device=fake_npu())


@pytest.mark.parametrize("name", FIXTURES)
def test_model_on_a_non_cpu_device_generates_what_the_cpu_model_generates(name):
    model, host_model = device_model(name), load_model(checkpoint(name), dtype=torch.float32, device="cpu")
    placed = {n: t.device for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device != fake_npu()}
    assert not placed, f"{name}: built for {fake_npu()}, these tensors are elsewhere: {placed}"
    vocab = tiny_config(name).vocab_size

    def check(prompts):
        with on_fake_device():
            tokens, logits = generate(model, prompts)
        want_tokens, want_logits = generate(host_model, prompts)
        assert tokens == want_tokens, f"{name} on {fake_npu()}: tokens {tokens} != the CPU run's {want_tokens}"
        assert torch.equal(logits, want_logits), f"{name} on {fake_npu()}: logits differ from the CPU run's"

    run_property(check, 3, prompts=prompt_batches(vocab, max_len=24))


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_a_forward_step_neither_reads_the_device_nor_copies_host_data_onto_it(decode):
    assert_no_reads_nor_transfers(one_step(device_model("tiny"), [[1, 2, 3], list(range(4, 21))], decode), "tiny")


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_an_fp8_kv_cache_step_neither_reads_the_device_nor_copies_host_data_onto_it(decode):
    """W8A8 with the per-token FP8 KV cache (bf16): the cache quantization and its fp32 scale caches, the
    dequantizing attention and the MXFP8 linears / experts read nothing back and copy nothing on."""
    from fixtures.checkpoints import quantized_checkpoint

    path = quantized_checkpoint("tiny", "w8a8", kv_cache="fp8")
    with on_fake_device():
        model = load_model(path, dtype=torch.bfloat16, device=fake_npu())
    assert ModelRunner(model, BLOCK_SIZE).kv_cache_dtype == torch.float8_e4m3fn
    step = one_step(model, [[5, 6, 7, 8, 9], list(range(20, 37))], decode)
    assert_no_reads_nor_transfers(step, "w8a8 with the fp8 KV cache")
    quantizing = [op for op in step.ops if "quant" in op and op.startswith("npu.")]
    assert quantizing, f"the fp8 step called no quantizing npu operator: {sorted(step.ops)}"


# ----------------------------------------------------------------------------------- MC2 at world 1

DISPATCH, COMBINE = "npu.npu_moe_distribute_dispatch_v2.default", "npu.npu_moe_distribute_combine_v2.default"


def with_mc2_decode(model):
    """The model with its decode MoE through MC2 (`dispatch_combine`): at world 1 the portable dispatch / combine
    run without any group (ep_world_size 1), so one process proves the MC2 decode's device discipline."""
    from optimized.layers.exchange import MoeInferDispatchCombine, build_exchange
    from optimized.phases import TensorParallelPhase, TensorParallelStep

    exchange = build_exchange("dispatch_combine", model.config, model.groups)
    assert isinstance(exchange, MoeInferDispatchCombine) and exchange.moe_ep.size == 1
    model.decode = TensorParallelPhase(TensorParallelStep(exchange))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mc2_decode_on_a_non_cpu_device_generates_what_the_cpu_model_generates(dtype):
    with on_fake_device():
        model = with_mc2_decode(load_model(checkpoint("tiny"), dtype=dtype, device=fake_npu()))
    host_model = with_mc2_decode(load_model(checkpoint("tiny"), dtype=dtype, device="cpu"))
    prompts = [[5, 6, 7, 8, 9], list(range(20, 37)), [3]]
    with on_fake_device() as mode:
        result = ModelRunner(model, BLOCK_SIZE).generate(prompts, NEW_TOKENS, return_logits=True)
        tokens, logits = result.tokens, torch.cat(to_host(result.logits))
    want_tokens, want_logits = generate(host_model, prompts)
    steps = (NEW_TOKENS - 1) * tiny_config("tiny").num_hidden_layers
    assert mode.ops[DISPATCH] == mode.ops[COMBINE] == steps, (
        f"{steps} MC2 exchanges expected (each decode step, each MoE layer): {mode.ops[DISPATCH]}, {mode.ops[COMBINE]}"
    )
    assert tokens == want_tokens, f"MC2 decode on {fake_npu()}: tokens {tokens} != the CPU run's {want_tokens}"
    assert torch.equal(logits, want_logits), f"MC2 decode on {fake_npu()}: logits differ from the CPU run's"


def test_an_mc2_decode_step_neither_reads_the_device_nor_copies_host_data_onto_it():
    with on_fake_device():
        model = with_mc2_decode(load_model(checkpoint("tiny"), dtype=torch.bfloat16, device=fake_npu()))
    step = one_step(model, [[1, 2, 3], list(range(4, 21)), [7]], decode=True)
    layers = tiny_config("tiny").num_hidden_layers
    assert step.ops[DISPATCH] == step.ops[COMBINE] == layers, f"the step's MC2 calls: {step.ops}"
    assert_no_reads_nor_transfers(step, "MC2 decode")


def test_a_position_past_the_model_is_refused_from_the_host_lists():
    model = device_model("tiny")
    limit = model.config.max_position_embeddings
    with on_fake_device() as mode:
        cache = PagedKVCache(1, 2, BLOCK_SIZE, 1, model.layers[0].self_attn.head_dim, model.dtype, fake_npu())
        meta = decode_metadata([limit], block_table([[1] * (limit // BLOCK_SIZE + 1)], fake_npu()))
        with pytest.raises(ValueError, match=f"position {limit} exceeds max_position_embeddings={limit}"):
            model(torch.tensor([0], device=fake_npu()), meta, cache.layers)
    assert not mode.host_reads, f"the position check read the device: {mode.host_reads}"


def host_causal_mask(device="cpu"):
    """The causal mask as `causal_mask_template` built it before it followed the default device."""
    from optimized.layers.attention import CAUSAL_MASK_TEMPLATE_SIZE as size

    return ~torch.tril(torch.ones(size, size, dtype=torch.bool, device=device))


def test_a_causal_mask_built_on_the_host_fails_the_first_attention_call(monkeypatch):
    monkeypatch.setattr("optimized.model.causal_mask_template", host_causal_mask)
    model = device_model("tiny")
    assert model.atten_mask.device.type == "cpu"
    with pytest.raises(DeviceMismatch, match=r"npu_fused_infer_attention_score_v2.*\['cpu', 'npu:0'\]"):
        with on_fake_device():
            ModelRunner(model, BLOCK_SIZE).generate([[1, 2, 3]], 1)


def test_a_host_tensor_planted_in_the_forward_is_caught(monkeypatch):
    """A host tensor entering the MoE block's input (any layer code would do) is caught at its first operator."""
    from optimized.layers.moe import Qwen3MoeSparseMoeBlock

    forward = Qwen3MoeSparseMoeBlock.forward
    monkeypatch.setattr(
        Qwen3MoeSparseMoeBlock,
        "forward",
        lambda self, x, *a, **k: forward(self, x + torch.zeros(x.shape[-1], dtype=x.dtype), *a, **k),
    )
    model = device_model("tiny")
    with pytest.raises(DeviceMismatch, match=r"aten\.add\.Tensor.*\['cpu', 'npu:0'\]"):
        with on_fake_device():
            ModelRunner(model, BLOCK_SIZE).generate([[1, 2, 3]], 1)


def test_exchange_split_sizes_sends_its_counts_from_the_rows_device(monkeypatch):
    import torch.distributed as dist

    from optimized.distributed import collectives

    class TwoRanks:
        def size(self):
            return 2

    sent = []

    def all_to_all_single(recv, send, group=None):
        sent.append(send.device)
        recv.copy_(send.flip(0))

    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    with on_fake_device():
        got = collectives.exchange_split_sizes([3, 5], TwoRanks(), fake_npu())
    assert got == [5, 3] and sent == [fake_npu()], f"counts sent from {sent}, received {got}"


def test_load_model_defaults_to_the_platform_device(monkeypatch):
    monkeypatch.setattr(platform, "device", lambda local_rank=None: fake_npu())
    with on_fake_device():
        model = load_model(checkpoint("tiny"), dtype=torch.float32, num_hidden_layers=1)
    assert model.lm_head.weight.device == fake_npu() and model.atten_mask.device == fake_npu(), (
        f"load_model without device= built on {model.lm_head.weight.device}, platform.device() is {fake_npu()}"
    )


@pytest.mark.parametrize("quant", ["w4a8", "w8a8"])
def test_mx_checkpoint_with_the_fp8_kv_cache_on_a_non_cpu_device_generates_what_the_cpu_model_generates(quant):
    """The MX quant methods (MXFP8 linears, W4A8 or W8A8 experts) and the per-token FP8 KV cache keep every
    tensor on the model's device too: bf16 tokens and logits bitwise the CPU run's."""
    from fixtures.checkpoints import quantized_checkpoint

    path = quantized_checkpoint("tiny", quant, kv_cache="fp8")
    with on_fake_device():
        model = load_model(path, dtype=torch.bfloat16, device=fake_npu())
    host_model = load_model(path, dtype=torch.bfloat16, device="cpu")
    placed = {n: t.device for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device != fake_npu()}
    assert not placed, f"{quant}: built for {fake_npu()}, these tensors are elsewhere: {placed}"
    prompts = [[5, 6, 7, 8, 9], list(range(20, 37))]
    with on_fake_device():
        runner = ModelRunner(model, BLOCK_SIZE)
        assert runner.kv_cache_dtype == torch.float8_e4m3fn
        result = runner.generate(prompts, NEW_TOKENS, return_logits=True)
        tokens, logits = result.tokens, torch.cat(to_host(result.logits))
    want_tokens, want_logits = generate(host_model, prompts)
    assert tokens == want_tokens, f"{quant} on {fake_npu()}: tokens {tokens} != the CPU run's {want_tokens}"
    assert torch.equal(logits, want_logits), f"{quant} on {fake_npu()}: logits differ from the CPU run's"


def test_the_detector_counts_every_copy_between_host_and_device():
    """What the step proofs count: `torch.tensor(data, device=npu)` (below any dispatch mode) and `.to(npu)` of a
    host tensor are host -> device copies; `.cpu()`, `.tolist()` and `.item()` read the device."""
    with on_fake_device() as mode:
        t = torch.tensor([1, 2, 3], device=fake_npu())
        u = torch.ones(2).to(fake_npu())
        z = torch.zeros(2, device=fake_npu())  # a factory: no host data moves
        assert not mode.host_reads
        t.cpu(), t.tolist(), u.sum().item()
    assert isinstance(t, DeviceTensor) and isinstance(u, DeviceTensor) and isinstance(z, DeviceTensor)
    assert len(mode.transfers) == 2 and all("host -> device" in m for m in mode.transfers), mode.transfers
    assert len(mode.host_reads) == 3, mode.host_reads


# ----------------------------------------------------------------------------------- prefill over cached KV


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_an_extend_step_neither_reads_the_device_nor_copies_host_data_onto_it(kv):
    """The extend's metadata (positions from the cached lengths, the context slots) is built with the step's other
    metadata; its attention (paged, or gathering and de-quantizing the FP8 context) reads nothing back."""
    from fixtures.checkpoints import quantized_checkpoint

    path = quantized_checkpoint("tiny", "w8a8", kv_cache="fp8") if kv == "fp8" else checkpoint("tiny")
    with on_fake_device():
        model = load_model(path, dtype=torch.bfloat16, device=fake_npu())
    step = extend_step(model, [[5, 6, 7, 8, 9], list(range(20, 37))], [2, 16])
    assert_no_reads_nor_transfers(step, f"extend over a {kv} KV cache")
