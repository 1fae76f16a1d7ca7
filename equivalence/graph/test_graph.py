"""Graph mode (exe_mode ge_graph / acl_graph) decodes what eager mode decodes; the compile cache is safe.

Single process (world 1), the tiny fixture cut to one decoder layer. Compiles are slow on a small CPU, so
the fp32 graph is compiled once per run: the first xdist worker compiles it into a compile cache shared by
the workers and records that fresh compile; other workers load it (`fp32` fixture).
- fp32, inductor: drawn batches of 1-8 requests (mixed prompt lengths crossing the 16-token blocks) are
  all padded to one captured bucket of 8; greedy tokens identical to eager, token for token; one graph, no
  graph break, no recompile over all draws and steps (dynamo counters);
- fp32 logits of one decode step: graph vs eager within `model.float32`, and the padding slots wrote only
  the null KV block (every request block equals eager's);
- compile cache: the first decoder compiles and saves an entry; another one (a fresh backend object, so
  nothing in memory to reuse) loads a copy of it (inductor FX-graph and AOTAutograd cache hits, no miss)
  and decodes the same tokens: cached == fresh == eager;
- bf16, inductor: greedy tokens and teacher-forced logits vs eager, bitwise on a CPU (within
  `graph.bfloat16.<device>` where the compiler may fuse with fewer roundings: CUDA, NPU); the same
  compile cache directory holds the fp32 entry, and the bf16 decoder compiles (a changed dtype recompiles);
- bf16 with the per-token FP8 KV cache: one compiled decode step's logits bitwise eager's on CPU (else per backend),
  the FP8 and scale caches it writes bitwise eager's, greedy tokens identical;
- every key component (config, layout, rank, dtype, force_eplb, bucket, block size, KV cache dtype, torch / torch_npu
  version) maps to another entry, which does not load, while the original still does;
- a truncated artefact, a garbage inductor file, a garbled key.json, and (in a trusted cache) garbage with
  matching checksums are each discarded with a CompileCacheWarning and the run proceeds with a fresh compile
  (cheap `aot_eager` backend: the cache logic does not depend on the backend) and eager's tokens;
- the cache is code: a pickle payload in the artefact, or a line prepended to an inductor source file, with
  every checksum recomputed, is discarded (its MAC does not verify) before it runs; an entry signed under
  another user's key loads only in a trusted cache; directories are owner-only and a cache directory, entry
  or key open to others (or of another user) is refused (tests/test_compile_cache.py);
- torchair (simulated: a fake compiler records the cache_compile directory, writes a file into it, runs eager):
  one compiled step and one cache_compile directory per batch bucket, that directory the bucket's entry, signed
  after its first call (torchair's files included) and verified before torchair reads it again;
- torch._dynamo.explain: the decode step is one graph with zero graph breaks;
- inlining (profiled compiled step): no inlined kernel runs as an operator; the grouped matmul and the cache write
  do.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import stat
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from torch._dynamo.utils import counters

from equivalence.support.compare import assert_bitwise_equal, assert_close, describe
from equivalence.support.parallel_support import decode_metadata, paged_cache, run_property
from equivalence.support.strategies import BLOCK_SIZE, prompt_batches
from fixtures.checkpoints import checkpoint
from fixtures.tiny import tiny_config
from optimized.model_loader.build import load_model
from optimized.executor.compile_cache import (
    ARTIFACT_FILE,
    KEY_ENV,
    KEY_FILE,
    CompileCache,
    CompileCacheWarning,
    cache_key,
    file_digests,
    key_hash,
)
from optimized.executor.graph import DecodeStep, GraphDecoder, batch_bucket
from optimized.executor.model_runner import ModelRunner
from optimized.torchair_standin import running_ge_graph

VOCAB = tiny_config("tiny").vocab_size
BUCKET = 8  # every drawn batch (1-8 requests) is padded to this one captured size
NEW_TOKENS = 4
PROMPTS = [[5, 6, 7], list(range(1, 18)), list(range(40, 71))]  # 3, 17, 31 tokens: bucket 8 pads 5 slots


def tiny_model(dtype: torch.dtype):
    return load_model(checkpoint("tiny"), dtype=dtype, num_hidden_layers=1)


def eager_tokens(model, prompts, n=NEW_TOKENS):
    return ModelRunner(model, BLOCK_SIZE).generate(prompts, n).tokens


def graph_runner(model, cache=None, compiler=None):
    # a fixed KV pool, as a server has: the pool is one of a static graph's shapes (every drawn batch fits in it)
    runner = ModelRunner(model, BLOCK_SIZE, kv_pool_blocks=32)
    runner.decode_forward = GraphDecoder(model, "ge_graph", cache, buckets=(BUCKET,), compiler=compiler)
    return runner


def inductor_counts() -> dict:
    return {
        "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
        "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
    }


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def fresh_backend(compile_fx_backend: str):
    """A new backend object for `compile_fx_backend`: dynamo keeps compiled graphs per backend object, so a
    decoder with a fresh one really traces and compiles (or loads) instead of reusing a graph in memory. Static, and
    run as a GE graph (torchair's decode attention runs only in one), as ge_graph's compiler does."""
    backend = torch._dynamo.lookup_backend(compile_fx_backend)

    def compiler(step):
        compiled = torch.compile(
            step, backend=lambda gm, example_inputs: backend(gm, example_inputs), dynamic=False, fullgraph=True
        )

        def run(*args):
            with running_ge_graph():
                return compiled(*args)

        return run

    return compiler


def _shared_dir(tmp_path_factory):
    """A directory every xdist worker of this run sees (the parent of the workers' base temps)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def copy_of_entry(fp32, root, trust: bool = False) -> CompileCache:
    """A cache at `root` holding a copy of the pristine fp32 entry."""
    cache = CompileCache(root, trust=trust)
    src = next(fp32["cache"].root.iterdir())
    shutil.copytree(src, cache.root / src.name)
    return cache


@pytest.fixture(scope="module", autouse=True)
def mac_key(tmp_path_factory):
    """The compile cache's per-user MAC key for this module: one file the run's xdist workers share (an entry
    one worker writes verifies in another), never the user's ~/.config."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, str(_shared_dir(tmp_path_factory) / "compile_cache.key"))
        yield


@pytest.fixture(scope="module")
def fp32(tmp_path_factory, mac_key):
    """The fp32 model and a live graph runner. The first worker here compiles fresh into a compile cache
    shared by the run's xdist workers (under a file lock) and records what that fresh compile did; a worker
    coming later loads the entry instead of compiling the same graph again."""
    model = tiny_model(torch.float32)
    shared = _shared_dir(tmp_path_factory) / "graph_fp32"
    shared.mkdir(exist_ok=True)
    cache, record = CompileCache(shared / "case"), shared / "fresh.json"
    with FileLock(str(shared / "lock")):
        before = inductor_counts()
        runner = graph_runner(model, cache)
        tokens = runner.generate(PROMPTS, NEW_TOKENS).tokens
        decoder = runner.decode_forward
        if not record.exists():
            record.write_text(
                json.dumps(
                    {
                        "source": decoder.startup[BUCKET].source,
                        "tokens": tokens,
                        "counts": delta(before, inductor_counts()),
                        "padding": {str(b): p for b, p in decoder.padding.items()},
                    }
                )
            )
    return {"model": model, "cache": cache, "runner": runner, "tokens": tokens, "fresh": json.loads(record.read_text())}


def test_graph_decode_tokens_identical_to_eager_fp32_and_entry_saved(fp32):
    fresh = fp32["fresh"]
    assert fresh["tokens"] == eager_tokens(fp32["model"], PROMPTS) == fp32["tokens"]
    assert fresh["source"] == "compiled" and fresh["padding"] == {"3": BUCKET}
    assert fresh["counts"]["graphs"] == 1 and fresh["counts"]["breaks"] == 0, fresh["counts"]
    assert fresh["counts"]["fx_miss"] == 1, fresh["counts"]
    entries = list(fp32["cache"].root.iterdir())
    assert len(entries) == 1 and (entries[0] / ARTIFACT_FILE).stat().st_size > 0
    manifest = json.loads((entries[0] / KEY_FILE).read_text())
    saved = manifest["key"]
    assert saved["batch_bucket"] == BUCKET and saved["dtype"] == "float32" and saved["rank"] == 0
    # authenticated: every file of the entry (inductor's sources and kernels too) is in the MAC'ed manifest
    assert manifest["files"] == file_digests(entries[0]) and len(manifest["mac"]) == 64
    assert ARTIFACT_FILE in manifest["files"] and any(
        f.startswith("inductor/") and f.endswith(".py") for f in manifest["files"]
    )
    for d in (fp32["cache"].root, entries[0], entries[0] / "inductor"):  # owner-only directories
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


def test_graph_logits_and_cache_writes_equal_eager_fp32(fp32):
    """One decode step (3 requests padded to 8) on two identically prefilled caches: logits within
    model.float32, and every block of a request holds what eager wrote: the 5 padding slots wrote only
    the null block 0."""
    model, decoder = fp32["model"], fp32["runner"].decode_forward
    runner = ModelRunner(model, BLOCK_SIZE)
    outs, caches = [], []
    for forward in (model, decoder):
        cache, table = paged_cache(model, [len(p) + 2 for p in PROMPTS])
        ids, meta, last = runner.prefill_inputs(PROMPTS, table)
        nxt = model(ids, meta, cache.layers, logits_indices=last).argmax(-1)
        outs.append(forward(nxt, decode_metadata([len(p) for p in PROMPTS], table), cache.layers))
        caches.append(cache)
    assert_close(outs[1], outs[0], "model.float32", "graph vs eager decode logits")
    for layer, (eager_kv, graph_kv) in enumerate(zip(caches[0].layers, caches[1].layers)):
        for name, e, g in zip("kv", eager_kv, graph_kv):
            assert_close(g[1:], e[1:], "model.float32", f"layer {layer} {name} cache, request blocks")
    assert decoder.padding[3] == BUCKET


def test_property_drawn_batches_graph_equals_eager_fp32(fp32):
    """1-8 requests of mixed lengths crossing block boundaries, all in the one captured bucket: identical
    greedy tokens; the whole property runs on the one graph (no recompile, no graph break)."""
    model, runner = fp32["model"], fp32["runner"]
    before = inductor_counts()

    def check(prompts):
        got = runner.generate(prompts, NEW_TOKENS).tokens
        assert got == eager_tokens(model, prompts), f"batch of {len(prompts)}, lengths {[len(p) for p in prompts]}"

    run_property(check, 4, prompts=prompt_batches(VOCAB, 1, BUCKET, 40))
    assert delta(before, inductor_counts())["graphs"] == 0, "a drawn batch recompiled the decode graph"
    assert sum(counters["graph_break"].values()) == 0


def test_cached_graph_equals_fresh_and_eager(fp32, tmp_path):
    """A new decoder (a fresh backend object: no graph in memory to reuse) on a copy of the entry loads it
    (inductor's cache directory is the entry's own): cache hits, no miss, the fresh compile's tokens."""
    before = inductor_counts()
    runner = graph_runner(fp32["model"], copy_of_entry(fp32, tmp_path / "case"), compiler=fresh_backend("inductor"))
    tokens = runner.generate(PROMPTS, NEW_TOKENS).tokens
    counts = delta(before, inductor_counts())
    assert runner.decode_forward.startup[BUCKET].source == "loaded"
    assert counts["graphs"] == 1 and counts["fx_hit"] >= 1 and counts["aot_hit"] >= 1 and counts["fx_miss"] == 0, counts
    assert tokens == fp32["fresh"]["tokens"]


def test_graph_bf16_within_tolerance_and_dtype_change_recompiles(fp32, tmp_path):
    model = tiny_model(torch.bfloat16)
    cache = copy_of_entry(fp32, tmp_path / "case")
    runner = graph_runner(model, cache)
    before = inductor_counts()
    got = runner.generate(PROMPTS, NEW_TOKENS).tokens
    assert runner.decode_forward.startup[BUCKET].source == "compiled"  # the fp32 entry is not reused
    assert delta(before, inductor_counts())["fx_miss"] == 1
    assert len(list(cache.root.iterdir())) == 2
    want = eager_tokens(model, PROMPTS)
    # Teacher-forced: both decode the eager greedy tokens; logits at every step bitwise on a CPU.
    eager_runner = ModelRunner(model, BLOCK_SIZE)
    per_step = []
    for forward in (model, runner.decode_forward):
        cache, table = paged_cache(model, [len(p) + NEW_TOKENS for p in PROMPTS])
        ids, meta, last = eager_runner.prefill_inputs(PROMPTS, table)
        model(ids, meta, cache.layers, logits_indices=last)
        lengths, logits = [len(p) for p in PROMPTS], []
        for step in range(NEW_TOKENS - 1):
            nxt = torch.tensor([w[step] for w in want])
            logits.append(forward(nxt, decode_metadata(lengths, table), cache.layers))
            lengths = [n + 1 for n in lengths]
        per_step.append(torch.stack(logits))
    print(
        f"bf16 graph vs eager decode logits: {describe(per_step[1], per_step[0])}; tokens "
        f"{'identical' if got == want else f'{got} vs {want}'}"
    )
    device = per_step[0].device.type
    if device == "cpu":
        assert_bitwise_equal(per_step[1], per_step[0], "bf16 graph vs eager decode logits (CPU)")
    else:
        assert_close(per_step[1], per_step[0], f"graph.bfloat16.{device}", "bf16 graph vs eager decode logits")


def test_graph_decode_fp8_kv_cache_equals_eager():
    """bf16 with the per-token FP8 KV cache (kv_cache_dtype float8): the compiled step quantizes at the cache
    write and reads the scale caches as eager does. One teacher-forced decode step on two identically prefilled
    FP8 caches: logits bitwise on CPU (graph.bfloat16.<device> elsewhere) and every request block of the FP8 and scale
    caches bitwise equal;
    greedy tokens identical, token for token. Its compile cache key names the KV dtype."""
    model = tiny_model(torch.bfloat16)
    eager = ModelRunner(model, BLOCK_SIZE, kv_cache_dtype="float8")
    graph = ModelRunner(model, BLOCK_SIZE, kv_cache_dtype="float8")
    decoder = graph.decode_forward = GraphDecoder(
        model, "ge_graph", buckets=(BUCKET,), compiler=fresh_backend("inductor")
    )
    assert eager.kv_cache_dtype == torch.float8_e4m3fn
    outs, caches = [], []
    for forward in (model, decoder):
        cache, table = paged_cache(model, [len(p) + 2 for p in PROMPTS], dtype=eager.kv_cache_dtype)
        ids, meta, last = eager.prefill_inputs(PROMPTS, table)
        nxt = model(ids, meta, cache.layers, logits_indices=last).argmax(-1)
        outs.append(forward(nxt, decode_metadata([len(p) for p in PROMPTS], table), cache.layers))
        caches.append(cache)
    device = outs[0].device.type
    if device == "cpu":
        assert_bitwise_equal(outs[1], outs[0], "FP8 KV graph vs eager decode logits (CPU)")
    else:
        assert_close(outs[1], outs[0], f"graph.bfloat16.{device}", "FP8 KV graph vs eager decode logits")
    for layer, (eager_kv, graph_kv) in enumerate(zip(caches[0].layers, caches[1].layers)):
        assert len(graph_kv) == 4 and graph_kv[0].dtype == torch.float8_e4m3fn
        for name, e, g in zip(("k", "v", "k_scale", "v_scale"), eager_kv, graph_kv):
            assert torch.equal(
                g[1:].view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g[1:],
                e[1:].view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e[1:],
            ), f"layer {layer} {name} cache, request blocks"
    assert graph.generate(PROMPTS, NEW_TOKENS).tokens == eager.generate(PROMPTS, NEW_TOKENS).tokens
    keys = [
        cache_key(model, batch_bucket=BUCKET, block_size=BLOCK_SIZE, exe_mode="ge_graph", kv_cache_dtype=d)
        for d in (torch.bfloat16, eager.kv_cache_dtype)
    ]
    assert key_hash(keys[0]) != key_hash(keys[1])


@pytest.mark.parametrize("quant", ["w4a8", "w8a8"])
def test_graph_decode_of_mx_checkpoints_equals_eager(quant):
    """W4A8 / W8A8: the MX layers' runtime layouts, prepared once after loading (transposed weight views, paired
    scales), are the model's parameters, which the compiled step reads as eager does. One teacher-forced decode step
    on two identically prefilled caches: logits bitwise on CPU (graph.bfloat16.<device> elsewhere); greedy tokens
    identical; the step compiles once (no recompile on the prepared layouts)."""
    from fixtures.checkpoints import quantized_checkpoint

    model = load_model(quantized_checkpoint("tiny", quant), dtype=torch.bfloat16, num_hidden_layers=1)
    assert all(m.runtime_layout for m in model.modules() if hasattr(m, "runtime_layout"))
    eager = ModelRunner(model, BLOCK_SIZE)
    graph = ModelRunner(model, BLOCK_SIZE)
    decoder = graph.decode_forward = GraphDecoder(
        model, "ge_graph", buckets=(BUCKET,), compiler=fresh_backend("inductor")
    )
    before = inductor_counts()
    outs = []
    for forward in (model, decoder):
        cache, table = paged_cache(model, [len(p) + NEW_TOKENS for p in PROMPTS])
        ids, meta, last = eager.prefill_inputs(PROMPTS, table)
        nxt = model(ids, meta, cache.layers, logits_indices=last).argmax(-1)
        outs.append(forward(nxt, decode_metadata([len(p) for p in PROMPTS], table), cache.layers))
    if outs[0].device.type == "cpu":
        assert_bitwise_equal(outs[1], outs[0], f"{quant} graph vs eager decode logits (CPU)")
    else:
        assert_close(outs[1], outs[0], f"graph.bfloat16.{outs[0].device.type}", f"{quant} graph vs eager logits")
    graph.kv_pool_blocks = cache.layers[0][0].shape[0]  # the same KV pool: one of the static graph's shapes
    assert graph.generate(PROMPTS, NEW_TOKENS).tokens == eager.generate(PROMPTS, NEW_TOKENS).tokens
    assert delta(before, inductor_counts())["graphs"] == 1, f"{quant}: the decode step compiled more than once"


KEY_CHANGES = {
    "model_config": lambda k: k["model_config"].update(num_hidden_layers=2),
    "parallel_layout": lambda k: k["parallel_layout"].update(world_size=2, moe_ep_size=2),
    "rank": lambda k: k.update(rank=1),
    "dtype": lambda k: k.update(dtype="bfloat16"),
    "force_eplb": lambda k: k.update(force_eplb=True),
    "weight_nz": lambda k: k.update(weight_nz=not k["weight_nz"]),
    "enable_hadamard": lambda k: k.update(enable_hadamard=True),
    "hadamard_rotation": lambda k: k.update(hadamard_rotation="0" * 20),
    "batch_bucket": lambda k: k.update(batch_bucket=16),
    "block_size": lambda k: k.update(block_size=32),
    "kv_cache_dtype": lambda k: k.update(kv_cache_dtype="float8_e4m3fn"),
    "exe_mode": lambda k: k.update(exe_mode="acl_graph"),
    "backend": lambda k: k.update(backend="npu"),
    "python": lambda k: k.update(python=k["python"] + ".other"),
    "torch": lambda k: k.update(torch=k["torch"] + ".other"),
    "torch_npu": lambda k: k.update(torch_npu="2.8.0"),
    "inlined_kernels": lambda k: k.update(inlined_kernels=k["inlined_kernels"][:-1]),
    "kernels_source": lambda k: k.update(kernels_source="0" * 16),
    "batch_invariant": lambda k: k.update(batch_invariant=not k["batch_invariant"]),
}


def test_every_cache_key_component_is_checked_and_force_eplb_is_one(fp32):
    """KEY_CHANGES covers the whole key (a component added to cache_key without a stale-entry check fails here), and a
    force_eplb model keys apart: its graph builds the balanced expert ids in the traced step."""
    from optimized.model_loader.build import load_model

    key = cache_key(
        fp32["model"], batch_bucket=BUCKET, block_size=BLOCK_SIZE, exe_mode="ge_graph", kv_cache_dtype=torch.float32
    )
    assert set(key) == set(KEY_CHANGES) and key["force_eplb"] is False
    forced = load_model(checkpoint("tiny"), dtype=torch.float32, num_hidden_layers=1, force_eplb=True)
    assert (
        cache_key(
            forced, batch_bucket=BUCKET, block_size=BLOCK_SIZE, exe_mode="ge_graph", kv_cache_dtype=torch.float32
        )["force_eplb"]
        is True
    )


@pytest.mark.parametrize("component", sorted(KEY_CHANGES))
def test_changed_key_component_never_loads_the_stale_entry(fp32, tmp_path, component):
    cache = _broken_entry(fp32, tmp_path, "intact")
    key = cache_key(
        fp32["model"], batch_bucket=BUCKET, block_size=BLOCK_SIZE, exe_mode="ge_graph", kv_cache_dtype=torch.float32
    )
    changed = copy.deepcopy(key)
    KEY_CHANGES[component](changed)
    assert key_hash(changed) != key_hash(key)
    assert not cache.entry(changed).load()
    with cache.entry(key).inductor_cache():
        assert cache.entry(key).load()


def _inductor_source(entry: Path) -> Path:
    return next(p for p in sorted((entry / "inductor").rglob("*.py")))


def _rewrite_checksums(entry: Path) -> None:
    """What anyone who can write the entry can also do: recompute key.json's checksums (not its MAC)."""
    manifest = json.loads((entry / KEY_FILE).read_text())
    manifest["files"] = file_digests(entry)
    (entry / KEY_FILE).write_text(json.dumps(manifest))


class _Payload:
    """A pickle that makes a directory when unpickled: proof that the artefact's code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _broken_entry(fp32, tmp_path, how: str, trust: bool = False) -> CompileCache:
    """A cache holding a copy of the fp32 entry, intact, broken or tampered with in one way."""
    cache = copy_of_entry(fp32, tmp_path / "case", trust)
    dst = next(cache.root.iterdir())
    art = dst / ARTIFACT_FILE
    if how == "truncated":
        art.write_bytes(art.read_bytes()[: art.stat().st_size // 3])
    elif how == "garbage":  # checksums recomputed: the MAC refuses it, or (trusted) torch itself must
        art.write_bytes(b"\x00not a cache artefact" * 50)
        _rewrite_checksums(dst)
    elif how == "garbled_key":
        (dst / KEY_FILE).write_text("{not json")
    elif how == "garbage_inductor_file":  # not UTF-8: inductor's own reading of it raised UnicodeDecodeError
        _inductor_source(dst).write_bytes(b"\xff\xfe\x00garbage" * 20)
    elif how == "pickle_payload":
        art.write_bytes(pickle.dumps(_Payload(tmp_path / "payload_ran")))
        _rewrite_checksums(dst)
    elif how == "prepended_line":
        source = _inductor_source(dst)
        source.write_text(f"import os; os.mkdir({str(tmp_path / 'payload_ran')!r})\n" + source.read_text())
        _rewrite_checksums(dst)
    return cache


def _recompiles_with_a_warning(fp32, cache, match: str):
    runner = graph_runner(fp32["model"], cache, compiler=fresh_backend("aot_eager"))
    before = inductor_counts()
    with pytest.warns(CompileCacheWarning, match=match):
        tokens = runner.generate(PROMPTS, NEW_TOKENS).tokens
    assert runner.decode_forward.startup[BUCKET].source == "compiled"
    assert delta(before, inductor_counts())["graphs"] == 1  # really traced and compiled again
    assert tokens == fp32["tokens"]
    assert not any(
        (e / ARTIFACT_FILE).exists() and (e / ARTIFACT_FILE).stat().st_size == 0 for e in cache.root.iterdir()
    )


@pytest.mark.parametrize(
    "how, trust", [("truncated", False), ("garbage", True), ("garbled_key", False), ("garbage_inductor_file", False)]
)
def test_broken_cache_entry_is_discarded_and_compiled_fresh(fp32, tmp_path, how, trust):
    _recompiles_with_a_warning(fp32, _broken_entry(fp32, tmp_path, how, trust), "unusable")


@pytest.mark.parametrize("how", ["pickle_payload", "prepended_line", "garbage"])
def test_tampered_entry_is_discarded_before_its_code_runs(fp32, tmp_path, how):
    """Checksums recomputed, as anyone able to write the entry could: the MAC (this user's key) refuses it."""
    _recompiles_with_a_warning(fp32, _broken_entry(fp32, tmp_path, how), "this user did not write it")
    assert not (tmp_path / "payload_ran").exists()


def test_entry_signed_under_another_key_loads_only_when_trusted(fp32, tmp_path, monkeypatch):
    """A cache copied from another node (another user key): recompiled with a warning, unless trusted."""
    key = cache_key(
        fp32["model"], batch_bucket=BUCKET, block_size=BLOCK_SIZE, exe_mode="ge_graph", kv_cache_dtype=torch.float32
    )
    cache = copy_of_entry(fp32, tmp_path / "copied")
    with monkeypatch.context() as other_node:
        other_node.setenv(KEY_ENV, str(tmp_path / "other_node.key"))
        cache.entry(key).sign()
    trusted = tmp_path / "trusted"
    shutil.copytree(cache.root, trusted)
    with pytest.warns(CompileCacheWarning, match="written under another key; loading it because the cache is trusted"):
        assert CompileCache(trusted, trust=True).entry(key).verify()
    with pytest.warns(CompileCacheWarning, match="this user did not write it .*trust_compile_cache: true"):
        assert not cache.entry(key).verify()
    assert not cache.entry(key).path.exists()  # discarded


@pytest.mark.parametrize("exe_mode", ["ge_graph", "acl_graph"])
def test_explain_one_graph_zero_breaks(fp32, exe_mode):
    model = fp32["model"]
    cache, table = paged_cache(model, [len(p) + 2 for p in PROMPTS])
    meta = decode_metadata([len(p) for p in PROMPTS], table)
    decoder = GraphDecoder(model, exe_mode, buckets=(BUCKET,))
    inputs = decoder.pad_inputs(torch.tensor([1, 2, 3]), meta, list(meta.actual_seq_lengths_kv), BUCKET)
    with running_ge_graph():  # explain runs the graph eagerly: as a GE graph would (torchair's attention)
        explained = torch._dynamo.explain(decoder._step(BLOCK_SIZE))(*inputs, cache.layers)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


INLINED = [
    "npu_add_rms_norm",
    "npu_add_rms_norm_cast",
    "npu_apply_rotary_pos_emb",
    "npu_fused_infer_attention_score_v2",
    "npu_moe_finalize_routing",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_init_routing_v2",
    "npu_rms_norm",
    "npu_swiglu",
]


def operators_called(forward, model, runner) -> set[str]:
    """The operators one decode step calls (profiled after a first, compiling call: tracing calls every operator
    on fake tensors), as `namespace::name`."""
    from torch.profiler import ProfilerActivity, profile

    cache, table = paged_cache(model, [len(p) + 2 for p in PROMPTS])
    ids, meta, last = runner.prefill_inputs(PROMPTS, table)
    model(ids, meta, cache.layers, logits_indices=last)
    meta = decode_metadata([len(p) for p in PROMPTS], table)
    forward(torch.tensor([1, 2, 3]), meta, cache.layers)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward(torch.tensor([1, 2, 3]), meta, cache.layers)
    return {e.key for e in prof.key_averages() if e.key.startswith(("npu::", "air::", "qwen3_moe_cpu::"))}


def test_compiled_step_inlines_the_traceable_kernels_and_calls_the_rest(fp32):
    """Inductor inlines the portable kernels that read no tensor data on the host: a compiled decode step calls
    none of them as an operator (their fused code runs instead; the logits tests above prove it bitwise), while
    the grouped matmul and the cache write still run as operators. Eager calls every one of them."""
    model = fp32["model"]
    decoder = GraphDecoder(model, "ge_graph", buckets=(BUCKET,), compiler=fresh_backend("inductor"))
    assert decoder.inlined == INLINED
    runner = ModelRunner(model, BLOCK_SIZE)
    called = {
        name: {k.removeprefix("npu::") for k in operators_called(forward, model, runner)}
        for name, forward in (("eager", model), ("graph", decoder))
    }
    operators = {"npu_grouped_matmul", "npu_scatter_nd_update_"}
    # the decode attention: torch_npu's operator in eager mode, torchair's (device lengths) in the static GE graph
    assert "air::npu_fused_infer_attention_score_v2" in called["graph"], sorted(called["graph"])
    assert not any(k.startswith("air::") for k in called["eager"]), sorted(called["eager"])
    used = {
        "npu_add_rms_norm",
        "npu_apply_rotary_pos_emb",
        "npu_fused_infer_attention_score_v2",
        "npu_moe_finalize_routing",
        "npu_moe_gating_top_k_softmax",
        "npu_moe_init_routing_v2",
        "npu_rms_norm",
        "npu_swiglu",
    }
    assert used | operators <= called["eager"], called["eager"]
    assert operators <= called["graph"] and not called["graph"] & set(INLINED), sorted(called["graph"])


def test_torchair_cache_one_step_and_one_signed_entry_per_bucket(fp32, tmp_path, monkeypatch):
    """torchair's cache_compile keeps one graph per directory and replays it without shape guards: each batch
    bucket gets its own compiled step and directory, the bucket's cache entry (simulated: the compiler records its
    cache_dir, writes a file into it and runs eager). The entry is created owner-only before torchair writes,
    signed after its first call (torchair's files included) and verified before torchair reads it again."""
    from optimized import platform

    model, cache = fp32["model"], CompileCache(tmp_path / "case")
    compiled = []

    def torchair_like(exe_mode, cache_dir=None):
        def compile_step(step):
            compiled.append(Path(cache_dir))
            assert stat.S_IMODE(Path(cache_dir).stat().st_mode) == 0o700, cache_dir
            (Path(cache_dir) / "graph.om").write_bytes(b"a compiled graph")

            def run(*args):  # the step itself, eager, as a GE graph (torchair's attention runs only in one)
                with running_ge_graph():
                    return step(*args)

            return run

        return compile_step

    monkeypatch.setattr(platform, "graph_compiler", torchair_like)

    def torchair_runner():
        runner = ModelRunner(model, BLOCK_SIZE)
        runner.decode_forward = GraphDecoder(model, "ge_graph", cache, buckets=(1, 2, 4))
        runner.decode_forward.torchair_cache = True  # what an NPU host with a compile cache sets
        return runner

    runner = torchair_runner()
    for prompts in (PROMPTS, PROMPTS[:1], PROMPTS[:2], PROMPTS[:2]):  # buckets 4, 1, 2, and 2 again
        assert runner.generate(prompts, 2).tokens == eager_tokens(model, prompts, 2)
    steps = runner.decode_forward.steps
    assert sorted(bucket for _, _, bucket in steps) == [1, 2, 4], steps.keys()
    assert len({id(step) for step in steps.values()}) == 3
    assert len(compiled) == 3 and len(set(compiled)) == 3, compiled  # the repeated bucket 2 reused its step
    manifests = {d: json.loads((d / KEY_FILE).read_text()) for d in compiled}
    assert sorted(m["key"]["batch_bucket"] for m in manifests.values()) == [1, 2, 4]
    assert all("graph.om" in m["files"] for m in manifests.values())  # torchair's files are signed too
    bucket4 = compiled[0]
    (bucket4 / "graph.om").write_bytes(b"replaced behind the cache's back")
    with pytest.warns(CompileCacheWarning, match="differing from key.json's checksums"):
        torchair_runner().generate(PROMPTS, 2)


def test_batch_buckets():
    # 1, 2, 4, 8, then every 16: a batch pads to the smallest that holds it
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 8, 9, 16, 17, 33, 600)] == [1, 2, 4, 8, 8, 16, 16, 32, 48, 608]
    assert batch_bucket(3, (2, 8)) == 8
    with pytest.raises(ValueError, match="exceeds the largest captured batch bucket 8"):
        batch_bucket(9, (8,))


def test_exe_mode_choice_and_errors(tmp_path):
    from optimized import platform
    from optimized.executor.graph import decode_forward

    model = tiny_model(torch.float32)
    assert decode_forward(model, "eager") is model
    assert isinstance(decode_forward(model, "acl_graph"), GraphDecoder)
    with pytest.raises(ValueError, match="needs a graph exe_mode"):
        decode_forward(model, "eager", CompileCache(tmp_path))
    with pytest.raises(ValueError, match="graph modes: ge_graph, acl_graph"):
        GraphDecoder(model, "graph")
    with pytest.raises(ValueError, match="graph modes: ge_graph, acl_graph"):
        platform.graph_compiler("eager")
    assert "inductor" in platform.graph_backend_description("acl_graph")


def _step_allocated_bytes(step, inputs, caches) -> int:
    """Bytes the compiled step allocates in one call (the profiler's allocation events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(*inputs, caches)
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


def test_compiled_decode_writes_the_kv_cache_in_place_whatever_the_pool_size(fp32):
    """The compiled step's paged-cache writes are npu_scatter_nd_update_ on the cache inputs themselves (no
    functional copy of a layer's cache and no copy back), so its cost does not grow with the KV pool: the
    generated code calls only the in-place op, once per K and V of each layer, and one call allocates the same
    bytes with a pool of 4 or of 64 blocks per layer while writing the same slots."""
    from torch._inductor.utils import run_and_get_code

    from optimized.executor.kv_cache import PagedKVCache, block_table

    model = fp32["model"]
    attn = model.layers[0].self_attn
    lengths = [5, 9]
    step = torch.compile(DecodeStep(model, BLOCK_SIZE), backend="inductor", dynamic=True, fullgraph=True)
    decoder = GraphDecoder(model, "acl_graph", buckets=(2,))  # a dynamic mode: the pool size stays symbolic
    allocated, written = {}, {}
    for blocks in (4, 64, 4):
        cache = PagedKVCache(
            len(model.layers),
            blocks,
            BLOCK_SIZE,
            attn.num_kv_heads,
            attn.head_dim,
            model.dtype,
            model.atten_mask.device,
        )
        table = block_table([[1], [2]], model.atten_mask.device)
        meta = decode_metadata(lengths, table)
        inputs = decoder.pad_inputs(torch.tensor([3, 4]), meta, list(meta.actual_seq_lengths_kv), 2)
        for t in cache.layers[0]:
            for dim in range(1, t.dim()):
                torch._dynamo.mark_static(t, dim)
        with torch.no_grad():
            if blocks not in allocated:  # the first call at each pool size compiles (then runs) once
                # compiled here, never loaded: a cached artefact of another registration of the op would hide it
                with (
                    torch._inductor.config.patch(fx_graph_cache=False),
                    torch._functorch.config.patch(enable_autograd_cache=False),
                ):
                    _, codes = run_and_get_code(step, *inputs, cache.layers)
                code = "\n".join(codes)
                layers = len(model.layers)
                assert code.count("torch.ops.npu.npu_scatter_nd_update_.default(") == 2 * layers, code
                assert "npu_scatter_nd_update.default(" not in code, "functional cache write (a copy of the cache)"
            allocated[blocks] = _step_allocated_bytes(step, inputs, cache.layers)
        written[blocks] = [t[1:3].clone() for t in cache.layers[0]]
    assert allocated[4] == allocated[64], f"a decode step allocates {allocated}: its cost grows with the pool"
    for a, b in zip(written[4], written[64]):
        assert_bitwise_equal(a, b, "the K/V slots a decode step writes, pool 4 vs 64 blocks")
