"""torchair's entry points off the NPU: what graph mode calls on torchair (and torch_npu's `npugraph_ex` backend),
answered here by inductor, with a record of what the NPU would have been asked to compile.

`platform.graph_compiler` runs the same compile on every host: `patch_for_hcom()`, a `CompilerConfig`, then
`get_npu_backend(...)` or `inference.cache_compile(...)` for `ge_graph`, the `npugraph_ex` backend for `npugraph_ex`.
On an NPU those names are torchair's and torch_npu's; elsewhere they are this module's. Each compile appends a
`CompileRecord` (the backend, its options, every graph input's shape and the operators the graph calls, in order), and
a GE graph (mode "max-autotune", the recipe's `ge_graph`) with a symbolic shape is refused as torchair's static
compile would never produce one. torchair's decode attention (`torch.ops.air.npu_fused_infer_attention_score_v2`,
lengths as device tensors) runs in a GE graph only, as torchair's own CPU kernel says: called eagerly it fails.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

GE_GRAPH_MODE = "max-autotune"  # torchair's CompilerConfig.mode for a GE graph (its default)


class StaticGraphError(RuntimeError):
    """A GE graph was about to be compiled with a symbolic shape: ge_graph compiles one static graph per bucket."""


@dataclass
class CompileRecord:
    """One graph handed to the backend: what the NPU would compile."""

    backend: str  # "torchair" or "npugraph_ex"
    mode: str  # torchair's CompilerConfig.mode ("max-autotune": GE graph; "reduce-overhead": ACL graph), or "-"
    options: dict  # the compiler options given (frozen parameters, tiling, topology sort; npugraph_ex's options)
    inputs: list  # each graph input: a tensor's shape (tuple of ints, or strings where symbolic), an int, or a str
    ops: list[str] = field(default_factory=list)  # the operators the graph calls, in order

    @property
    def static(self) -> bool:
        return not any(
            isinstance(x, str) or (isinstance(x, tuple) and any(isinstance(d, str) for d in x)) for x in self.inputs
        )


RECORDS: list[CompileRecord] = []  # every compile of this process, oldest first
CACHE_COMPILES: list[dict] = []  # every inference.cache_compile call: its cache_dir and arguments
_state = SimpleNamespace(hcom_patched=False)
_running = threading.local()


@contextlib.contextmanager
def running_ge_graph():
    """Marks a compiled GE graph running on this thread (the compiled step enters it around each call)."""
    _running.depth = getattr(_running, "depth", 0) + 1
    try:
        yield
    finally:
        _running.depth -= 1


def in_ge_graph() -> bool:
    """Whether a compiled GE graph runs on this thread: torchair's attention runs only there."""
    return getattr(_running, "depth", 0) > 0


def patch_for_hcom() -> None:
    """torchair's patch that lets a graph capture the HCCL collectives; nothing to patch for inductor."""
    _state.hcom_patched = True


def hcom_patched() -> bool:
    return _state.hcom_patched


class _ExperimentalConfig:
    def __init__(self):
        self.frozen_parameter = False
        self.tiling_schedule_optimize = False
        self.topology_sorting_strategy = "DFS"  # torchair's default; the recipe asks for StableRDFS


class CompilerConfig:
    """The fields of torchair's CompilerConfig that graph mode sets."""

    def __init__(self):
        self.mode = GE_GRAPH_MODE
        self.experimental_config = _ExperimentalConfig()

    def options(self) -> dict:
        return dict(vars(self.experimental_config))


def _shape(x):
    def dim(d):
        return d if isinstance(d, int) else str(d)

    if isinstance(x, torch.Tensor):
        return tuple(dim(d) for d in x.shape)
    if isinstance(x, torch.SymInt):
        return str(x)
    return x if isinstance(x, int) else repr(x)


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]


def _inductor(gm, example_inputs, ge: bool):
    """Inductor's compile of the graph; a GE graph's runs are marked (torchair's attention runs only inside one)."""
    from torch._inductor.compile_fx import compile_fx

    compiled = compile_fx(gm, example_inputs)
    if not ge:
        return compiled

    def run(*args, **kwargs):  # inductor's callable, in its calling convention (its attributes copied below)
        with running_ge_graph():
            return compiled(*args, **kwargs)

    run.__dict__.update(getattr(compiled, "__dict__", {}))
    return run


def get_npu_backend(*, compiler_config: CompilerConfig | None = None):
    """torchair's backend: records the graph, refuses a GE graph with a symbolic shape, compiles with inductor."""
    config = compiler_config or CompilerConfig()

    def backend(gm: torch.fx.GraphModule, example_inputs):
        record = CompileRecord("torchair", config.mode, config.options(), [_shape(x) for x in example_inputs], _ops(gm))
        RECORDS.append(record)
        ge = config.mode == GE_GRAPH_MODE
        if ge and not record.static:
            raise StaticGraphError(
                f"a GE graph (exe_mode ge_graph) compiled with symbolic shapes {record.inputs}: ge_graph compiles one "
                f"static graph per batch bucket (dynamic=False), as torchair's GE compile does"
            )
        return _inductor(gm, example_inputs, ge=ge)

    return backend


def _cache_compile(func, *, cache_dir, config=None, dynamic=True, fullgraph=False, ge_cache=False, **kwargs):
    """torchair.inference.cache_compile: records the call, compiles `func` with the backend (no GE cache here)."""
    CACHE_COMPILES.append(dict(cache_dir=str(cache_dir), dynamic=dynamic, fullgraph=fullgraph, ge_cache=ge_cache))
    return torch.compile(func, backend=get_npu_backend(compiler_config=config), dynamic=dynamic, fullgraph=fullgraph)


inference = SimpleNamespace(cache_compile=_cache_compile)


def npugraph_ex(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
    """torch_npu's `npugraph_ex` dynamo backend (torch.compile(..., backend="npugraph_ex", options=...)): recorded,
    compiled with inductor."""
    RECORDS.append(
        CompileRecord("npugraph_ex", "-", dict(options or {}), [_shape(x) for x in example_inputs], _ops(gm))
    )
    return _inductor(gm, example_inputs, ge=False)


@functools.cache
def register_npugraph_ex() -> str:
    """Register the `npugraph_ex` backend name with dynamo (once); returns the name."""
    from torch._dynamo.backends.registry import register_backend

    with contextlib.suppress(Exception):  # a backend of that name already registered (torch_npu's) stays
        register_backend(name="npugraph_ex")(npugraph_ex)
    return "npugraph_ex"


def _fia_v2(*args, **kwargs):
    return torch.ops.air.npu_fused_infer_attention_score_v2(*args, **kwargs)


ops = SimpleNamespace(npu_fused_infer_attention_score_v2=_fia_v2)
