"""The one assembly: an inference config (and the launch environment) to a running model and engine.

    launch = prepare(cfg, command="generate")       # host only: launch checks, compile cache, model config, tokenizer
    run = launch.start(batch=..., prefill_tokens=..., prompts=..., agree={...})  # job, plan, groups, model, runner
    run.runner.generate(...)  or  run.engine()      # the engine run to completion, or fed by a server
    run.close()

`prepare` runs before any process group exists and returns a `Launch`; `start` joins the job (bounded by the
collective timeout), checks that every rank holds the same config, model, prompts and `agree` fields, computes the
`ExecutionPlan` (printed by rank 0), builds the process groups with the plan's MC2 window, loads the model (weights
prepared once) and the runner, sizes the KV pool (given, or by memory after a profiling forward:
optimized/executor/kv_pool.py) and checks memory before any KV cache exists. It returns an `Assembly`, which owns
the process groups until `close()`. A YAML key is honoured or refused here, once; every error a user can fix is a
`UsageError` naming the key, file or option. docs/architecture.md tells the whole path.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field, replace
from pathlib import Path

from optimized import envs
from optimized.errors import UsageError


def load_config(
    path,
    *,
    model_path: str | None = None,
    dtype: str | None = None,
    max_new_tokens: int | None = None,
    block_size: int | None = None,
):
    """The inference config YAML with the command line's overrides; UsageError naming what is wrong."""
    from optimized.config import ConfigError, InferenceConfig

    path = Path(path)
    if path.is_dir():
        raise UsageError(f"config file {str(path)!r} is a directory; give the inference config YAML file in it")
    if not path.is_file():
        raise UsageError(f"config file {str(path)!r} not found")
    try:
        cfg = InferenceConfig.from_yaml(path)
    except ConfigError as e:
        raise UsageError(f"invalid inference config {path}: " + "; ".join(f"{k}: {m}" for k, m in e.errors)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read config file {str(path)!r}: {getattr(e, 'strerror', None) or e}") from None
    m, s = cfg.model_config, cfg.scheduler_config
    if model_path is not None:
        m.model_path = model_path
        if m.scheme[0] == "preset":
            m.with_ckpt = False
    if dtype is not None:
        m.dtype = dtype
    if max_new_tokens is not None:
        if max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1; got {max_new_tokens}")
        s.max_new_tokens = max_new_tokens
    if block_size is not None:
        s.block_size = block_size
    cfg.source = path
    return cfg


def check_launch(world_size: int, command: str) -> None:
    """parallel_config.world_size against the launcher, before any process group exists."""
    env_world = envs.world_size()  # an EnvError for a value that is not a positive integer
    launched = env_world or 1
    if launched == world_size:
        return
    how = f"launched with WORLD_SIZE={launched}" if env_world else "launched as a single process"
    if world_size > 1:
        raise UsageError(
            f"parallel_config.world_size is {world_size} but this job was {how}; start it with "
            f"`torchrun --nproc-per-node {world_size} -m optimized {command} ...`"
        )
    raise UsageError(f"parallel_config.world_size is 1 but this job was {how}; run it as a single process")


def open_compile_cache(cfg):
    """model_config.enable_cache_compile: the case's cache directory (env CASE_NAME, else derived), created
    owner-only before anything is loaded; None when off."""
    m, p = cfg.model_config, cfg.parallel_config
    if not m.enable_cache_compile:
        return None
    from optimized.executor.compile_cache import CompileCache, case_dir, default_case_name

    case = envs.case_name()
    try:
        root = case_dir(case or default_case_name(m.scheme[1], m.dtype, p, m.exe_mode))
    except ValueError as e:  # only a CASE_NAME can break the rule (a derived name follows it)
        raise envs.EnvError(envs.CASE_NAME, case, "a plain directory name", f"environment variable {e}") from None
    return CompileCache(root, trust=m.trust_compile_cache)  # CompileCacheError: a UsageError


def say(message: str) -> None:
    """A start-up line, printed once (by rank 0 under torchrun)."""
    if not envs.rank():  # unset or 0
        print(message, flush=True)


@dataclass
class Launch:
    """The host-side half of the assembly: everything checked and read before the job starts."""

    cfg: object
    command: str
    model_dir: Path
    hf_config: object
    tokenizer: object
    compile_cache: object
    check_weights: bool = True

    def start(
        self,
        *,
        batch: int,
        prefill_tokens: int,
        kv_pool_blocks: int | None = None,
        prompts: list[list[int]] | None = None,
        agree: dict | None = None,
        kv_pool_source: str = "--kv-pool-blocks",
        memory=None,
    ) -> "Assembly":
        """Join the job, plan, build the groups, the model and the runner. batch: the most requests decoding
        together; prefill_tokens: the tokens of a first prefill (the plan's volumes); kv_pool_blocks: the engine's
        pool per DP group, given by `kv_pool_source` (None: sized by memory, optimized/executor/kv_pool.py, after a
        profiling forward); agree: what every rank must hold the same (sampling, ...) besides the config, the model
        and the prompts; memory: where the memory figures come from (optimized/executor/memory.py; None: the
        device's own; a test states a device)."""
        from optimized.distributed import ParallelState, init_distributed
        from optimized.distributed.guard import (
            CollectiveTimeoutError,
            check_ranks_agree,
            collective_timeout_s,
            named_collective_errors,
            run_fingerprint,
        )
        from optimized.executor.plan import ExecutionPlan

        cfg = self.cfg
        m, p = cfg.model_config, cfg.parallel_config
        if kv_pool_blocks is not None and kv_pool_blocks < 2:
            raise UsageError(
                f"the KV pool of {kv_pool_blocks} block(s) must hold at least 2 (block 0 is the null block)"
            )
        timeout_s = collective_timeout_s(p.collective_timeout_s)  # EnvError: a bad QWEN3_MOE_COLLECTIVE_TIMEOUT_S
        from optimized import platform

        settings = platform.PlatformSettings(m.platform, m.exe_mode)  # model_config.platform_version, here only
        try:  # a rank that never joins (it failed before) makes the rendezvous time out: named
            with named_collective_errors(timeout_s):
                env = init_distributed(timeout=datetime.timedelta(seconds=timeout_s), settings=settings)
        except CollectiveTimeoutError as e:
            raise UsageError(f"joining the job: {e}") from None
        if env.world_size == 1:  # no process group: the settings are applied here
            settings.apply()
        run = Assembly(self, env, timeout_s)
        try:
            with run.named_errors():
                check_ranks_agree(
                    run_fingerprint(cfg.to_dict(), self.model_dir, prompts or [], command=self.command, **(agree or {}))
                )
                run.plan = ExecutionPlan.build(
                    cfg, self.hf_config, batch=batch, prefill_tokens=prefill_tokens, kv_pool_blocks=kv_pool_blocks
                )
                if env.rank == 0:
                    print(f"{run.plan.describe()}\n{settings.describe()}", flush=True)
                    if m.enable_hadamard:
                        from optimized.layers import hadamard

                        print(hadamard.describe(run.plan.scheme, m.hadamard_weight_path), flush=True)
                run.state = ParallelState.build(p, mc2_window_mb=run.plan.mc2_window_mb)
                run.model = self._load_model(run.state, env, run.plan.paths)
                run.runner = self._runner(run.model, run.plan.buckets, memory)
                pool = self._kv_pool(run, kv_pool_blocks, kv_pool_source)
                run.plan = replace(run.plan, kv_pool_blocks=pool.blocks, kv_pool=pool)
                try:  # mem_fraction_static: the weights, activations and the KV pool fit, before any cache exists
                    run.runner.check_memory(run.plan.kv_pool_blocks)
                except ValueError as e:
                    raise UsageError(str(e)) from None
                if env.rank == 0:
                    print(pool.line(), flush=True)
                    print(f"kv cache: {run.runner.describe_kv_cache(m.kv_cache_dtype)}", flush=True)
        except BaseException:
            run.close()
            raise
        return run

    def _kv_pool(self, run, given: int | None, source: str):
        """The KV pool: `given` (by `source`), or sized by memory after a profiling forward at the largest prefill a
        step can hold and the largest decode batch a step dispatches; every rank takes the smallest."""
        from optimized.executor import kv_pool
        from optimized.executor.plan import group_batch

        cfg, plan, runner = self.cfg, run.plan, run.runner
        if given is not None:
            return kv_pool.KVPool(given, runner.block_size, runner.block_bytes(), plan.dp_groups, source)
        s, max_positions = cfg.scheduler_config, self.hf_config.max_position_embeddings
        share = group_batch(plan.batch, plan.dp_groups)
        rows, length = profile_prefill(cfg, share, max_positions)
        activations = runner.profile_activations(rows, length, plan.dispatch_batch // plan.dp_groups)
        return kv_pool.sized_by_memory(
            device_bytes=runner.memory.total_bytes(),
            fraction=s.mem_fraction_static,
            weights_bytes=runner.weight_bytes(),
            activation_bytes=activations,
            other_bytes=runner.memory.other_bytes(),
            block_bytes=runner.block_bytes(),
            block_size=runner.block_size,
            group_batch=share,
            request_tokens=kv_pool.request_budget(cfg.data_config.input_max_len, s.max_new_tokens, max_positions),
            dp_groups=plan.dp_groups,
            agree=lambda n: smallest_over_ranks(n, runner.device) if run.env.world_size > 1 else n,
        )

    def _load_model(self, state, env, paths):
        from optimized import platform
        from optimized.layers.quantization.errors import QuantConfigError
        from optimized.model_loader.build import load_model
        from optimized.model_loader.loader import CheckpointError

        m = self.cfg.model_config
        try:
            return load_model(
                self.model_dir,
                parallel=state,
                dtype=m.torch_dtype,
                random_weights=not m.with_ckpt,
                seed=self.cfg.data_config.seed,
                num_hidden_layers=m.num_hidden_layers,
                device=platform.device(env.local_rank),
                check_weights=self.check_weights,
                force_eplb=m.eplb,
                weight_nz=m.enable_weight_nz,
                hadamard_weight_path=m.hadamard,
                paths=paths,
            )
        except (CheckpointError, QuantConfigError) as e:  # its message names the file; name the checkpoint if not
            raise UsageError(str(e) if str(self.model_dir) in str(e) else f"checkpoint {self.model_dir}: {e}") from None

    def _runner(self, model, buckets, memory=None):
        from optimized.executor.model_runner import ModelRunner
        from optimized.layers.quantization.errors import QuantConfigError

        m, s = self.cfg.model_config, self.cfg.scheduler_config
        try:
            return ModelRunner(
                model,
                s.block_size,
                exe_mode=m.exe_mode,
                compile_cache=self.compile_cache,
                kv_cache_dtype=m.kv_cache_dtype,
                max_prefill_tokens=s.max_prefill_tokens,
                mem_fraction_static=s.mem_fraction_static,
                enable_prefix_caching=s.enable_prefix_caching,
                batch_invariant=m.batch_invariant,
                enable_chunked_prefill=s.enable_chunked_prefill,
                max_num_batched_tokens=s.max_num_batched_tokens,
                graph_buckets=buckets,
                memory=memory,
                async_scheduling=s.async_scheduling,
            )
        except QuantConfigError as e:
            raise UsageError(f"model_config.kv_cache_dtype: {e}") from None


def profile_prefill(cfg, share: int, max_positions: int) -> tuple[int, int]:
    """(prompts, tokens each) of the largest prefill one step of a DP group can run, for the profiling forward: up to
    its share of the batch, each of the longest prompt, within the step's token budget (max_num_batched_tokens with
    chunked prefill, else max_prefill_tokens when set)."""
    s = cfg.scheduler_config
    length = min(cfg.data_config.input_max_len, max_positions - 1)  # a prompt leaves room for a new token
    budget = s.max_num_batched_tokens if s.enable_chunked_prefill else s.max_prefill_tokens
    if budget and budget < length:
        return 1, budget
    return max(1, min(share, budget // length if budget else share)), length


def smallest_over_ranks(n: int, device) -> int:
    """The smallest of every rank's `n` (one all-reduce)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def check_rotation_widths(cfg, hf_config) -> None:
    """enable_hadamard on a checkpoint whose scheme the rotation applies to (the table's `hadamard`): every rotated
    width a multiple of 128 (spec a4w4_hadamard.md §4.2), else a ConfigError naming model_config.enable_hadamard."""
    from optimized.config import ConfigError
    from optimized.layers import hadamard
    from optimized.layers.quantization.schemes import quant_scheme, scheme_row

    m = cfg.model_config
    if m.enable_hadamard is not True or not scheme_row(quant_scheme(hf_config)).hadamard:
        return  # off, or ignored for this checkpoint (as the recipe does)
    try:
        hadamard.check_widths(hf_config, cfg.parallel_config.attn_tp_size)
    except hadamard.RotationError as e:
        raise ConfigError([("model_config.enable_hadamard", str(e))]) from None


def prepare(cfg, command: str, *, check_weights: bool = True) -> Launch:
    """The launch checks and host reads, before any process group exists (see the module docstring)."""
    from optimized.config import ConfigError
    from optimized.model_loader.hf_config import load_hf_config
    from optimized.model_loader.model_path import resolve_model_path
    from optimized.model_loader.tokenizer import CheckpointTokenizer
    from optimized.executor.model_runner import BLOCK_GRANULARITY

    m, p, s = cfg.model_config, cfg.parallel_config, cfg.scheduler_config
    if s.block_size < 1 or s.block_size % BLOCK_GRANULARITY:
        raise UsageError(
            f"scheduler_config.block_size ({s.block_size}) must be a multiple of {BLOCK_GRANULARITY} "
            f"(the paged attention kernel's block granularity)"
        )
    compile_cache = open_compile_cache(cfg)  # an unusable cache directory fails before anything is loaded
    check_launch(p.world_size, command)
    model_dir = resolve_model_path(m.model_path, *m.scheme)
    try:
        hf_config = load_hf_config(model_dir)
    except UsageError:  # ModelConfigError, CheckpointError: they name the file and the key
        raise
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {model_dir}/config.json: {e}") from None
    try:
        cfg.validate_for_model(hf_config)
        check_rotation_widths(cfg, hf_config)
    except ConfigError as e:
        source = getattr(cfg, "source", None)
        raise UsageError(
            f"inference config {source or ''} does not fit the model {m.model_path}: ".replace("  ", " ")
            + "; ".join(f"{k}: {msg}" for k, msg in e.errors)
        ) from None
    tokenizer = CheckpointTokenizer.load(model_dir)  # PromptError naming the tokenizer file
    return Launch(cfg, command, model_dir, hf_config, tokenizer, compile_cache, check_weights)


@dataclass
class Assembly:
    """A started run: the job, the plan, the groups, the model and its runner."""

    launch: Launch
    env: object
    timeout_s: float
    plan: object = None
    state: object = None
    model: object = None
    runner: object = None
    _closed: bool = field(default=False, repr=False)

    @property
    def cfg(self):
        return self.launch.cfg

    def engine(self, *, warm_up: bool = False):
        """The serving engine over the plan's KV pool; warm_up: every graph bucket compiled (or loaded from the
        compile cache) now, so no compile ever happens on the request path."""
        from optimized.executor.engine import Engine

        s = self.cfg.scheduler_config
        with self.named_errors():
            try:
                engine = Engine(
                    self.runner,
                    batch_size=s.batch_size,
                    max_prefill_tokens=s.max_prefill_tokens,
                    num_blocks=self.plan.kv_pool_blocks,
                )
            except ValueError as e:  # the MC2 window / limits, mem_fraction_static
                raise UsageError(str(e)) from None
            if warm_up and self.plan.graph:
                engine.warm_up(self.plan.buckets)
        return engine

    @contextlib.contextmanager
    def named_errors(self):
        """Errors of a started run as one named UsageError (`rank r: ...` under torchrun)."""
        from optimized.distributed.guard import CollectiveTimeoutError, RankMismatchError, named_collective_errors
        from optimized.executor.compile_cache import CompileCacheError
        from optimized.executor.model_runner import NonFiniteLogitsError

        try:
            with named_collective_errors(self.timeout_s):
                yield
        except (CollectiveTimeoutError, RankMismatchError, NonFiniteLogitsError, CompileCacheError) as e:
            if self.env.world_size > 1:  # which rank says it
                raise UsageError(f"rank {self.env.rank}: {e}") from None
            if isinstance(e, UsageError):
                raise
            # non-finite logits are not a usage error, but `generate` reports them as one line naming step and request
            raise UsageError(str(e)) from None

    def profiled(self, config_file):
        """model_config.enable_profiler: a trace of what runs inside, one file per rank."""
        m = self.cfg.model_config
        if not m.enable_profiler:
            return contextlib.nullcontext(None)
        from optimized.executor.profiling import ensure_writable, profiled, trace_directory

        directory = trace_directory(m.output_path, config_file)
        ensure_writable(directory)  # ProfilerError naming the directory
        return profiled(directory, self.env.rank)

    def close(self) -> None:
        """The model's subgroups first, then the default group; then the groups themselves are freed."""
        if self._closed:
            return
        self._closed = True
        import gc

        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if self.state is not None:
                self.state.close()
            dist.destroy_process_group()
        # What holds the groups goes, so each gloo group's worker threads stop now, while Python runs. Left to the
        # interpreter's exit, a worker still releasing its last collective's tensors needs the GIL during
        # finalization and aborts the process ("terminate called without an active exception").
        self.state = self.model = self.runner = None
        gc.collect()


# ---- rank models outside a config run: the parallel bench, the latency harness, the first-divergence report
# They build several layouts in one job, or time a budget's shapes, so they take the pieces of `Launch.start` one by
# one: a plan per layout (`plan_for`), then the groups and the model on it (`build_model`), built only here.


@dataclass(frozen=True)
class WeightSource:
    """Where a model's weights come from. hf_config: the shapes (and what the MC2 window is sized for); checkpoint:
    a directory with config.json and safetensors; else source: a weight source of hf_config's shapes (random
    weights of a preset's shapes, or a state dict such as the reference's)."""

    hf_config: object
    checkpoint: Path | None = None
    source: object = None
    num_hidden_layers: int | None = None  # a checkpoint's first N layers only (None: all of them)

    @classmethod
    def from_checkpoint(cls, model_dir, hf_config=None, *, num_hidden_layers: int | None = None) -> "WeightSource":
        """A checkpoint's weights; hf_config: the shapes the window is sized for (default: its config.json)."""
        if hf_config is None:
            from optimized.model_loader.hf_config import load_hf_config

            hf_config = load_hf_config(model_dir)
        return cls(hf_config, checkpoint=Path(model_dir), num_hidden_layers=num_hidden_layers)

    @classmethod
    def random_weights(cls, hf_config, source=None, *, seed: int = 0) -> "WeightSource":
        """Random weights of hf_config's shapes: `source` (e.g. the latency harness's pooled one), else
        RandomWeights(seed)."""
        if source is None:
            from optimized.model_loader.loader import RandomWeights

            source = RandomWeights(seed)
        return cls(hf_config, source=source)

    @property
    def quant(self) -> str | None:
        """The weights' quantization scheme: a checkpoint's own config.json's (hf_config may give only the shapes),
        else hf_config's."""
        from optimized.layers.quantization.schemes import quant_scheme

        config = self.hf_config
        if self.checkpoint is not None:
            from optimized.model_loader.hf_config import load_hf_config

            config = load_hf_config(self.checkpoint)
        return quant_scheme(config)


def join_job(*, init_method: str | None = None, rank: int | None = None, world_size: int | None = None, timeout_s=None):
    """Join the job: torchrun's environment, or (init_method, rank, world_size) for ranks a bench started itself.
    timeout_s: how long a collective may wait (None: parallel_config's default / the environment's)."""
    from optimized.distributed import init_distributed

    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    return init_distributed(init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)


def leave_job() -> None:
    """The default process group destroyed, when there is one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def plan_for(
    weights: WeightSource,
    parallel,
    *,
    dtype,
    batch: int,
    exe_mode: str = "eager",
    block_size: int | None = None,
    prefill_tokens: int | None = None,
):
    """The ExecutionPlan of a rank model outside a config run (`ExecutionPlan.for_layout` over the weights' shapes
    and their checkpoint's scheme): its paths and MC2 window, for decode batches up to `batch` as a step of
    `exe_mode` dispatches them. `build_model` builds the groups and the model from it; the caller reads its fields."""
    from optimized.executor.plan import ExecutionPlan

    return ExecutionPlan.for_layout(
        weights.hf_config,
        parallel,
        quant=weights.quant,
        batch=batch,
        act_bytes=dtype.itemsize,
        exe_mode=exe_mode,
        block_size=block_size,
        prefill_tokens=prefill_tokens,
    )


def build_model(weights: WeightSource, parallel=None, *, dtype, device=None, plan=None, weight_nz: bool = True):
    """This rank's model over `parallel`'s groups (None: one process, no groups). plan: its `plan_for` (the groups
    get its MC2 window, the model its paths); None: the HCCL default window, the paths decided by the model."""
    from optimized.distributed import ParallelState
    from optimized.model_loader.build import load_model, model_from_source

    state = None
    if parallel is not None:
        state = ParallelState.build(parallel, mc2_window_mb=None if plan is None else plan.mc2_window_mb)
    paths = None if plan is None else plan.paths
    if weights.checkpoint is not None:
        return load_model(
            weights.checkpoint,
            parallel=state,
            dtype=dtype,
            device=device,
            weight_nz=weight_nz,
            num_hidden_layers=weights.num_hidden_layers,
            paths=paths,
        )
    return model_from_source(
        weights.hf_config, weights.source, parallel=state, dtype=dtype, device=device, weight_nz=weight_nz, paths=paths
    )


def build_runner(weights: WeightSource, parallel=None, *, dtype, device=None, plan, block_size: int):
    """`build_model` on `plan` and its ModelRunner (block_size, the plan's exe_mode): (model, runner)."""
    from optimized.executor.model_runner import ModelRunner

    model = build_model(weights, parallel, dtype=dtype, device=device, plan=plan)
    return model, ModelRunner(model, block_size, device, exe_mode=plan.exe_mode)
