"""Graph mode: the decode step compiled to one static graph per batch bucket (exe_mode ge_graph / acl_graph).

`decode_forward(model, exe_mode, cache)` is what `ModelRunner` calls for each decode step: the model itself in eager
mode, a `GraphDecoder` otherwise, which pads the batch to its bucket (the smallest captured size that holds it: by
default 1, 2, 4, 8, then every 16; model_config.graph_batch_sizes overrides), runs that bucket's
compiled `DecodeStep` and returns the real rows' logits. Prefill stays eager.

The compiled step is one whole decode forward (fullgraph) from tensors of static shape (ids, positions, slot mapping
[Bp], block table [Bp, ceil(max_position_embeddings / block_size)]) and one host list of KV lengths (symbolic ints),
the KV caches keeping a symbolic block count: nothing inside it syncs with the host, longer contexts and other pool
sizes run the same graph, and the cache write is re-inplaced (no copy of a layer's cache). A padding slot decodes
token 0 at position 0 with KV length 2 into the null block and its logits are dropped (`GraphDecoder.padding`);
under attention DP every group pads to the bucket of the largest group's batch. Compiling never falls back to eager
silently (the recompile limit is an error); `GraphDecoder.startup` records per bucket whether it was loaded from
the compile cache or compiled. docs/graph_mode.md.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from optimized import platform
from optimized.executor.compile_cache import CompileCache, cache_key
from optimized.config import GRAPH_MODES
from optimized.forward_metadata import DataParallelBatch, ForwardMetadata, batch_bucket
from optimized.ops import batch_invariant, registry
from optimized.executor.kv_cache import NULL_BLOCK

# Off NPU the compiler is inductor: it inlines the portable kernels that read no tensor data on the host, so they
# fuse instead of running as Python operators at every step (ops/registry.py `inline_in_inductor`). Registered when
# a GraphDecoder is built and again on entering `compile_settings` (idempotent), so before anything in the process
# compiles a decode step: inductor's caches key on the traced graph, not on its decomposition table, so a graph
# compiled before the registration would be reused without the inlining. Not on import: importing inductor's
# decompositions costs about 2 s of CPU, which every eager process (each rank of a torchrun job) would pay.

PAD_KV_LEN = 2  # KV length of a padding slot (see the module docstring): never 1, which the compiler specializes

# Dynamo settings while a graph step runs (and compiles): see the module docstring.
DYNAMO_SETTINGS = dict(specialize_float=True, recompile_limit=64, fail_on_recompile_limit_hit=True)


def _recipe_dynamo_settings() -> dict:
    """The recipe compiles with inbuilt nn modules not inlined (their parameters graph constants, as frozen
    parameters are); a torch that always inlines them (2.6 on: the flag is deprecated and ignored) is left alone."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        getattr(torch._dynamo.config, "inline_inbuilt_nn_modules", None)
    if any(issubclass(w.category, FutureWarning) for w in caught) or not hasattr(
        torch._dynamo.config, "inline_inbuilt_nn_modules"
    ):
        return {}
    return dict(inline_inbuilt_nn_modules=False)


# Inductor's, for the same span: a fused kernel still rounds wherever the traced code rounds (x.to(bf16).float()),
# so the portable kernels it inlines keep their spec rounding points (on CPU bitwise eager's).
INDUCTOR_SETTINGS = dict(emulate_precision_casts=True)


@contextlib.contextmanager
def compile_settings():
    """The dynamo and inductor settings a graph step is compiled and run under (whatever compiler is used); inductor's
    cache keys also carry the kernels' source hash (its caches do not see a decomposition's code)."""
    import torch._inductor.config as inductor_config

    registry.inline_in_inductor()
    ours, tag = f"qwen3_moe_kernels={registry.kernels_source_hash()}", torch.compiler.config.cache_key_tag
    if batch_invariant.enabled():  # the portable kernels stay opaque (registry.py): another graph from the same code
        ours += ",batch_invariant"
    tag = tag if ours in tag.split("|") else "|".join(filter(None, (tag, ours)))
    with (
        torch._dynamo.config.patch(**DYNAMO_SETTINGS, **_recipe_dynamo_settings()),
        inductor_config.patch(**INDUCTOR_SETTINGS),
        torch.compiler.config.patch(cache_key_tag=tag),
    ):
        yield


class DecodeStep(nn.Module):
    """One decode forward from static-shape tensors and the host list of KV lengths: what acl_graph and npugraph_ex
    compile (dynamic: the host ints are graph inputs, every tensor the caller marks static keeps its shape)."""

    def __init__(self, model, block_size: int):
        super().__init__()
        self.model, self.block_size = model, block_size
        parallel = model.groups.parallel
        self.dp_groups, self.attn_tp_size = parallel.attn_dp_size, model.groups.attn_tp.size

    def _dp(self, batch: int) -> DataParallelBatch | None:
        # Attention DP: every DP group runs the same bucket (GraphDecoder pads each to it), so the step's DP sizes
        # follow from the static batch alone.
        return DataParallelBatch((batch,) * self.dp_groups, self.attn_tp_size) if self.dp_groups > 1 else None

    def forward(self, input_ids, positions, slot_mapping, block_table, kv_lens: list[int], kv_caches):
        batch = input_ids.shape[0]
        meta = ForwardMetadata(
            is_prefill=False,
            positions=positions,
            actual_seq_lengths_cu_q=list(range(1, batch + 1)),
            actual_seq_lengths_kv=kv_lens,
            slot_mapping=slot_mapping,
            block_table=block_table,
            block_size=self.block_size,
            dp=self._dp(batch),
        )
        return self.model(input_ids, meta, kv_caches)


class StaticDecodeStep(DecodeStep):
    """One decode forward from static-shape tensors only: what ge_graph compiles, one graph per batch bucket. The
    lengths are device tensors made in the graph, as the recipe's engine makes them (each row's KV length is its
    position + 1, the query lengths' prefix sums 1..B); the attention reads them through torchair's operator."""

    def forward(self, input_ids, positions, slot_mapping, block_table, kv_caches):
        batch = input_ids.shape[0]
        meta = ForwardMetadata(
            is_prefill=False,
            positions=positions,
            actual_seq_lengths_cu_q=list(range(1, batch + 1)),  # constants of the static graph
            actual_seq_lengths_kv=[],  # no host lengths enter a static graph: `seq_lens_kv` carries them
            slot_mapping=slot_mapping,
            block_table=block_table,
            block_size=self.block_size,
            dp=self._dp(batch),
            seq_lens_cu_q=torch.arange(1, batch + 1, dtype=positions.dtype, device=positions.device),
            seq_lens_kv=positions + 1,
        )
        return self.model(input_ids, meta, kv_caches)


@dataclass
class Startup:
    """How a bucket's graph came to be: 'compiled' or 'loaded' (from the compile cache), and the time of
    its first call (compile or cache load, plus one decode step)."""

    source: str
    seconds: float


class GraphDecoder:
    """Drop-in for the model's decode call: (input_ids [B], decode meta, kv_caches) -> logits [B, V]."""

    def __init__(
        self,
        model,
        exe_mode: str = "ge_graph",
        cache: CompileCache | None = None,
        *,
        buckets: tuple[int, ...] | None = None,
        compiler=None,
    ):
        """buckets: the captured batch sizes (default: 1, 2, 4, 8, then every 16, each captured on first use).
        compiler: `compile(step) -> callable`, default `platform.graph_compiler(exe_mode)`."""
        if exe_mode not in GRAPH_MODES:
            raise ValueError(f"exe_mode {exe_mode!r} is not a graph mode; graph modes: {', '.join(GRAPH_MODES)}")
        if buckets is not None and (not buckets or any(not isinstance(b, int) or b < 1 for b in buckets)):
            raise ValueError(f"buckets {buckets!r} must be positive batch sizes")
        self.model, self.exe_mode, self.cache, self.buckets = model, exe_mode, cache, buckets
        self.static = platform.compiles_static(exe_mode)  # ge_graph: one static graph per bucket, device lengths
        self.compiler = compiler or platform.graph_compiler(exe_mode)
        self.inlined = registry.inline_in_inductor()  # before any step of this decoder compiles
        # On NPU torchair's cache_compile owns the cache: one directory and one compiled step per batch bucket (its
        # saver treats a second input shape as a recompile, and a loaded cache replays without shape guards); that
        # directory is the bucket's cache entry, verified before torchair reads it and signed after its first call.
        self.torchair_cache = cache is not None and compiler is None and platform.backend_name() == "npu"
        self.max_positions = model.config.max_position_embeddings
        # (block_size, KV dtype, bucket) -> compiled step: one per bucket where each bucket is its own static graph
        # (ge_graph) or its own torchair cache_compile directory; the dynamic modes' buckets share one (bucket None).
        self.steps: dict[tuple, object] = {}
        self.startup: dict[int, Startup] = {}  # bucket -> how its graph was obtained
        self.padding: dict[int, int] = {}  # batch -> bucket, for every batch that was padded
        self._marked = None  # the KV cache whose shapes were last marked static

    @torch.no_grad()  # always: grad mode is part of what a compiled graph is guarded on
    def __call__(self, input_ids: torch.Tensor, meta: ForwardMetadata, kv_caches) -> torch.Tensor:
        if meta.is_prefill:
            raise ValueError("GraphDecoder runs decode steps only (prefill stays eager)")
        batch = input_ids.shape[0]
        # Under attention DP every DP group steps together: all pad to the bucket of the largest group's batch.
        bucket = batch_bucket(batch if meta.dp is None else max(meta.dp.tokens), self.buckets)
        if bucket != batch:
            self.padding[batch] = bucket
        kv_lens = list(meta.actual_seq_lengths_kv)
        if max(kv_lens) > self.max_positions:  # host-side check: the graph cannot raise
            raise ValueError(f"position {max(kv_lens) - 1} exceeds max_position_embeddings={self.max_positions}")
        inputs = self.pad_inputs(input_ids, meta, kv_lens, bucket)
        caches = list(kv_caches)
        if self._marked is None or self._marked() is not caches[0][0]:  # a new cache: mark it once
            for layer_cache in caches:  # (k, v) or, FP8, (k, v, k_scale, v_scale)
                for t in layer_cache:
                    for dim in range(1, t.dim()):  # the block count stays symbolic: the pool size may change
                        torch._dynamo.mark_static(t, dim)
            self._marked = weakref.ref(caches[0][0])  # a weak reference: the cache is freed after its run
        kv_dtype = caches[0][0].dtype
        step_key = (meta.block_size, kv_dtype, bucket if self.static or self.torchair_cache else None)
        step = self.steps.get(step_key)
        if step is None:
            step = self.steps[step_key] = self._compile(meta.block_size, kv_dtype, bucket)
        if bucket not in self.startup:
            return self._first_call(step, bucket, meta.block_size, kv_dtype, inputs, caches)[:batch]
        with compile_settings():
            return step(*inputs, caches)[:batch]

    def _entry(self, block_size: int, kv_dtype: torch.dtype, bucket: int):
        return self.cache.entry(
            cache_key(
                self.model, batch_bucket=bucket, block_size=block_size, exe_mode=self.exe_mode, kv_cache_dtype=kv_dtype
            )
        )

    def _compile(self, block_size: int, kv_dtype: torch.dtype, bucket: int):
        if self.torchair_cache:  # one cache_compile directory per bucket: the bucket's entry (its key names the bucket)
            entry = self._entry(block_size, kv_dtype, bucket)
            entry.verify()  # an entry this user did not write (or a broken one) is discarded before torchair reads it
            entry.create()  # owner-only, before torchair writes into it
            compiler = platform.graph_compiler(self.exe_mode, cache_dir=entry.path)
            return compiler(self._step(block_size))
        return self.compiler(self._step(block_size))

    def _step(self, block_size: int) -> DecodeStep:
        return (StaticDecodeStep if self.static else DecodeStep)(self.model, block_size)

    def pad_inputs(self, input_ids, meta: ForwardMetadata, kv_lens: list[int], bucket: int):
        """input_ids, positions, slot_mapping [bucket], block_table [bucket, W], and (dynamic modes) kv_lens (bucket
        ints; a static graph makes its lengths from the positions)."""
        batch, block_size = input_ids.shape[0], meta.block_size
        width = math.ceil(self.max_positions / block_size)
        table = meta.block_table
        if table.shape[1] > width:
            raise ValueError(
                f"block_table has {table.shape[1]} columns; at most {width} "
                f"(max_position_embeddings {self.max_positions} / block_size {block_size})"
            )
        pad = bucket - batch
        padded_table = table.new_full((bucket, width), NULL_BLOCK)
        padded_table[:batch, : table.shape[1]] = table
        ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
        positions = torch.cat([meta.positions, meta.positions.new_zeros(pad)])
        slots = torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((pad,), NULL_BLOCK * block_size)])
        tensors = (ids, positions, slots, padded_table)
        for t in tensors:
            torch._dynamo.mark_static(t)
        if self.static:
            return tensors
        return (*tensors, kv_lens + [PAD_KV_LEN] * pad)

    def _first_call(self, step, bucket: int, block_size: int, kv_dtype: torch.dtype, inputs, caches) -> torch.Tensor:
        """Run this bucket's step once: loaded from its verified cache entry, or compiled and saved (inductor), or
        torchair's (its cache_compile files in the entry); the entry is signed after the call."""
        entry = None if self.cache is None else self._entry(block_size, kv_dtype, bucket)
        inductor_entry = entry is not None and not self.torchair_cache
        start = time.perf_counter()
        with entry.inductor_cache() if inductor_entry else contextlib.nullcontext():
            source = "loaded" if inductor_entry and entry.load() else "compiled"
            if self.torchair_cache:  # torchair decides whether its cache held the graph
                source = "torchair cache_compile"
            with _fresh_artifacts(), compile_settings():
                out = step(*inputs, caches)
                if inductor_entry and source == "compiled":
                    entry.save(torch.compiler.save_cache_artifacts())
                elif entry is not None:  # loaded or torchair's: sign what is there now (files it added included)
                    entry.sign()
        self.startup[bucket] = Startup(source, time.perf_counter() - start)
        return out

    def describe(self) -> list[str]:
        """Lines for the user: backend, how each bucket's graph was obtained, and any batch padding."""
        lines = [
            f"graph mode {platform.graph_backend_description(self.exe_mode)}; decode captured per batch "
            f"bucket {sorted(self.startup)}"
        ]
        if self.static:
            lines.append("  decode attention: torchair's operator, the KV lengths device tensors (no host list enters)")
        if self.inlined:
            lines.append(
                f"  inlined (traced and fused by the compiler, not called as operators): {', '.join(self.inlined)}"
            )
        for bucket, s in sorted(self.startup.items()):
            lines.append(
                f"  bucket {bucket}: {s.source}{' from the compile cache' if s.source == 'loaded' else ''}"
                f" in {s.seconds:.1f} s (first call)"
            )
        for batch, bucket in sorted(self.padding.items()):
            lines.append(
                f"  batch {batch} padded to the captured bucket {bucket} ({bucket - batch} padding slot(s) "
                f"write only the null KV block; their logits are dropped)"
            )
        return lines


@contextlib.contextmanager
def _fresh_artifacts():
    """Record only this compile's cache artefacts (so one entry holds one bucket's graph)."""
    try:
        from torch.compiler._cache import CacheArtifactManager

        manager = CacheArtifactManager.with_fresh_cache()
    except (ImportError, AttributeError):  # older torch: save whatever was recorded
        manager = contextlib.nullcontext()
    with manager:
        yield


def decode_forward(
    model, exe_mode: str = "eager", cache: CompileCache | None = None, buckets: tuple[int, ...] | None = None
):
    """What a runner calls for decode steps: the model itself (eager) or a GraphDecoder over `buckets` (the plan's;
    None: the default rule's, each captured on first use)."""
    if exe_mode == "eager":
        if cache is not None:
            raise ValueError("a compile cache needs a graph exe_mode (ge_graph or acl_graph)")
        return model
    return GraphDecoder(model, exe_mode, cache, buckets=buckets or None)
