"""`ge_graph` is compiled as the recipe compiles it (executor/utils/graph_utils.py): after `patch_for_hcom()`,
torchair's GE backend with the recipe's CompilerConfig, static (`dynamic=False`), one graph per batch bucket, and
the decode attention through torchair's operator with the KV lengths as device tensors (the decode FIA branch of
models/qwen3_moe/models/modeling_qwen3_moe.py). Off the NPU the torchair stand-in records each compile while
inductor compiles the same graph:

- each bucket's record is a static GE graph with the recipe's options whose inputs are tensors only (no host int),
  calling torchair's attention and not torch_npu's; the tokens are eager's;
- a GE graph compiled dynamically with host-list lengths (how every graph mode compiled before) is refused;
- torchair's attention refuses to run eagerly (as torchair's own kernel does);
- npugraph_ex compiles with its own backend and the recipe's options, host lists, dynamic;
- after `Engine.warm_up`, real decode steps (growing KV lengths, crossing a block) compile nothing (dynamo's
  counters unchanged).
The tiny fixture cut to one decoder layer, fp32.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from equivalence.support.parallel_support import decode_metadata, paged_cache
from equivalence.support.strategies import BLOCK_SIZE
from fixtures.checkpoints import checkpoint
from optimized import platform
from optimized import torchair_standin
from optimized.executor.graph import DecodeStep, GraphDecoder, compile_settings
from optimized.executor.model_runner import ModelRunner
from optimized.model_loader.build import load_model

pytestmark = [pytest.mark.equivalence, pytest.mark.slow]

PROMPTS = [[5, 6, 7], list(range(1, 18)), list(range(40, 71))]  # bucket 4
AIR_FIA = "air.npu_fused_infer_attention_score_v2"
NPU_FIA = "npu.npu_fused_infer_attention_score_v2"


@pytest.fixture(scope="module")
def model():
    return load_model(checkpoint("tiny"), dtype=torch.float32, num_hidden_layers=1, device="cpu")


def _records(since: int) -> list:
    return torchair_standin.RECORDS[since:]


def test_ge_graph_is_one_static_graph_per_bucket_with_torchair_attention(model):
    eager = ModelRunner(model, BLOCK_SIZE)
    graph = ModelRunner(model, BLOCK_SIZE, exe_mode="ge_graph", kv_pool_blocks=16)
    since = len(torchair_standin.RECORDS)
    for prompts in (PROMPTS, PROMPTS[:1]):  # buckets 4 and 1
        assert graph.generate(prompts, 3).tokens == eager.generate(prompts, 3).tokens
    records = _records(since)
    assert torchair_standin.hcom_patched()
    assert [r.inputs[0] for r in records] == [(4,), (1,)], [r.inputs for r in records]
    for r in records:
        assert r.backend == "torchair" and r.mode == torchair_standin.GE_GRAPH_MODE, r
        assert r.options == platform.GE_COMPILE_OPTIONS, r.options
        assert r.static and all(isinstance(x, tuple) for x in r.inputs), r.inputs  # tensors only: no host int
        assert AIR_FIA in r.ops and NPU_FIA not in r.ops, r.ops
    assert sorted(graph.decode_forward.steps) == [(BLOCK_SIZE, torch.float32, 1), (BLOCK_SIZE, torch.float32, 4)]


def test_a_dynamic_ge_graph_compile_is_refused(model):
    """The decode step as every graph mode compiled it before: dynamic, the KV lengths host ints."""
    cache, table = paged_cache(model, [len(p) + 2 for p in PROMPTS])
    meta = decode_metadata([len(p) for p in PROMPTS], table)
    inputs = GraphDecoder(model, "acl_graph", buckets=(4,)).pad_inputs(
        torch.tensor([1, 2, 3]), meta, list(meta.actual_seq_lengths_kv), 4
    )
    tng = platform.torchair()
    backend = tng.get_npu_backend(compiler_config=tng.CompilerConfig())  # mode max-autotune: a GE graph
    step = torch.compile(DecodeStep(model, BLOCK_SIZE).forward, backend=backend, dynamic=True, fullgraph=True)
    with compile_settings(), torch.no_grad(), pytest.raises(Exception, match="ge_graph compiles one static graph"):
        step(*inputs, cache.layers)


def test_torchair_attention_refuses_to_run_eagerly(model):
    cache, table = paged_cache(model, [8])
    meta = decode_metadata([5], table)
    meta.seq_lens_cu_q = torch.tensor([1])
    meta.seq_lens_kv = torch.tensor([6])
    with pytest.raises(ValueError, match="runs inside a GE graph only"):
        model(torch.tensor([1]), meta, cache.layers)


def test_npugraph_ex_compiles_with_its_backend_and_options(model):
    since = len(torchair_standin.RECORDS)
    graph = ModelRunner(model, BLOCK_SIZE, exe_mode="npugraph_ex", kv_pool_blocks=16)
    assert graph.generate(PROMPTS[:2], 2).tokens == ModelRunner(model, BLOCK_SIZE).generate(PROMPTS[:2], 2).tokens
    (record,) = _records(since)
    assert record.backend == "npugraph_ex" and record.options == platform.NPUGRAPH_EX_OPTIONS, record
    assert NPU_FIA in record.ops and AIR_FIA not in record.ops, record.ops
    assert not record.static  # dynamic, as the recipe's enable_dynamic_graph default: the host lengths are inputs


def test_decode_steps_after_warm_up_never_recompile(model):
    from optimized.executor.engine import Engine
    from optimized.executor.plan import graph_buckets
    from optimized.executor.sampling import GREEDY
    from optimized.executor.scheduler import Request

    runner = ModelRunner(model, BLOCK_SIZE, exe_mode="ge_graph")
    engine = Engine(runner, batch_size=1, num_blocks=8)
    engine.warm_up(graph_buckets(1, 1))
    before = dict(counters["stats"]), sum(counters["recompiles"].values())
    for i, prompt in enumerate(([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7])):  # the first crosses a block
        engine.add(Request(f"r{i}", prompt, 5, GREEDY, stream=i))
    while not engine.idle:
        engine.step()
    assert runner.decode_forward.startup.keys() == {1}
    assert (dict(counters["stats"]), sum(counters["recompiles"].values())) == before, "a decode step compiled"
