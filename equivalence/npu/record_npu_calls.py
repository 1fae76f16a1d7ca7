"""Every `torch.ops.npu` call the optimized model makes, recorded on the CPU: the contract the NPU replay tests check.

The model's build is recorded too (its load-time calls: one `npu_format_cast` per weight, enable_weight_nz). A call
is recorded as its operator and its arguments by schema name (defaults filled in): tensors as dtype, shape
and stride, everything else by value; never the data. `CONFIGURATIONS` are the runs recorded: the tiny fixtures
through `ModelRunner.generate` (prefill and greedy decode), single process in fp32, bf16, W4A8, W8A8 and W4A8 with
the per-token FP8 KV cache, the sequence-parallel prefill over 2 gloo ranks (both EP schemes, bf16, W4A8, W8A8,
W4A8 + FP8 KV; MC2 decode), and attention DP over 4 (attention TP 2 x DP 2, MoE EP 4: double-routing prefill, MC2
decode; bf16, W4A8 + FP8 KV, W8A8), and the SP and DP bf16 runs again on `tiny-h1024`, whose hidden size the
NPU's MC2 kernels take; W4A4 (MXFP4 attention and experts) single process on `tiny-h128` and in the recipe's
mxfp4_hadamard layout over 4 ranks on `tiny-h256` (attention TP 4, MoE EP 4: TP prefill, MC2 decode), and at batch 1
(one prompt: the FP4 matmul's single decode row, duplicated as the kernel needs). The Hadamard
rotation is plain torch arithmetic (no `torch.ops.npu` call), so the W4A4 runs record the unrotated conversion.
Communicator names are recorded as a placeholder (`COMMUNICATOR`). The deduplicated calls go to
`equivalence/spec/recorded_npu_calls.json`; regenerate it after a change to what the model calls with

    PYTHONPATH=. python -m equivalence.npu.record_npu_calls

`equivalence/npu/test_recorded_npu_calls.py` re-records the single-process runs and fails on a call the file lacks;
`equivalence/npu/test_npu_replay.py` replays every listed call on torch_npu against the portable kernel, the MC2
collectives as a multi-rank job (`record_mc2`, equivalence/npu/mc2_replay.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

RECORDING = Path(__file__).resolve().parents[1] / "spec" / "recorded_npu_calls.json"
REGENERATE = "PYTHONPATH=. python -m equivalence.npu.record_npu_calls"
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3]]
NEW_TOKENS = 2


@dataclass(frozen=True)
class Configuration:
    name: str
    world: int
    fixture: str
    w4a8: bool
    dtype: str
    scheme: str | None = None  # None: the tensor-parallel layout; else the SP prefill with this EP scheme
    w8a8: bool = False  # the W8A8 conversion (MXFP8 experts) instead of w4a8 / bf16
    attn_dp: bool = False  # attention TP world/2 x DP 2, MoE EP over the world (MC2 decode, double routing)
    kv_cache: str = "bf16"  # "fp8": the checkpoint's per-token FP8 KV cache scheme (quantized checkpoints)
    w4a4: bool = False  # the W4A4 conversion (MXFP4 attention and experts, MXFP4 activations)
    attn_tp: int = 0  # > 0: attention TP of this size with the TP prefill (the recipe's mxfp4_hadamard)
    prompts: tuple | None = None  # None: PROMPTS; else these (a batch of one: single-row decode linears)

    def requests(self) -> list[list[int]]:
        return [list(p) for p in self.prompts] if self.prompts is not None else PROMPTS

    def __post_init__(self):
        if self.kv_cache != "bf16" and not (self.w4a8 or self.w8a8):
            raise ValueError(f"{self.name}: kv_cache={self.kv_cache!r} comes with a W4A8 / W8A8 checkpoint")
        if self.attn_dp and (self.scheme is not None or self.world < 4):
            raise ValueError(f"{self.name}: attention DP needs world >= 4 and the TP prefill (scheme None)")

    def layout(self) -> dict:
        from equivalence.support.strategies import layout, sp_layout

        if self.attn_dp:
            return layout(self.world, attn_tp_size=self.world // 2, attn_dp=True)
        if self.attn_tp:
            return layout(self.world, attn_tp_size=self.attn_tp)
        return layout(1) if self.scheme is None else sp_layout(self.world, self.scheme)

    @property
    def quant(self) -> str | None:
        """The checkpoint's quantization scheme (a name of the scheme table; None: 16-bit)."""
        return "w4a4" if self.w4a4 else "w8a8" if self.w8a8 else "w4a8" if self.w4a8 else None

    def paths(self):
        """The phase paths the plan decides for this configuration (optimized/path_plan.py)."""
        from fixtures.tiny import tiny_config
        from optimized.config import ParallelConfig
        from optimized.path_plan import decide_paths

        return decide_paths(tiny_config(self.fixture), ParallelConfig(**self.layout()), self.quant)

    def checkpoint(self) -> Path:
        from fixtures.checkpoints import checkpoint, w4a4_checkpoint, w4a8_checkpoint, w8a8_checkpoint

        if self.w4a4:
            return w4a4_checkpoint(self.fixture)
        if self.w4a8 or self.w8a8:
            return (w8a8_checkpoint if self.w8a8 else w4a8_checkpoint)(self.fixture, kv_cache=self.kv_cache)
        return checkpoint(self.fixture)


CONFIGURATIONS = (
    Configuration("tp1-float32", 1, "tiny", False, "float32"),
    Configuration("tp1-bfloat16", 1, "tiny", False, "bfloat16"),
    Configuration("tp1-w4a8", 1, "tiny", True, "bfloat16"),
    Configuration("tp1-w8a8", 1, "tiny", False, "bfloat16", w8a8=True),
    Configuration("sp2-alltoall-bfloat16", 2, "tiny", False, "bfloat16", "alltoall"),
    Configuration("sp2-alltoall-w8a8", 2, "tiny", False, "bfloat16", "alltoall", w8a8=True),
    Configuration("sp2-alltoall-w4a8", 2, "tiny", True, "bfloat16", "alltoall"),
    Configuration("sp2-allgather-w4a8", 2, "tiny-dense", True, "bfloat16", "allgather"),
    Configuration("tp1-w4a8-fp8kv", 1, "tiny", True, "bfloat16", kv_cache="fp8"),
    Configuration("sp2-alltoall-w4a8-fp8kv", 2, "tiny", True, "bfloat16", "alltoall", kv_cache="fp8"),
    Configuration("dp-tp2x2-ep4-bfloat16", 4, "tiny", False, "bfloat16", attn_dp=True),
    Configuration("dp-tp2x2-ep4-w4a8-fp8kv", 4, "tiny", True, "bfloat16", attn_dp=True, kv_cache="fp8"),
    Configuration("dp-tp2x2-ep4-w8a8", 4, "tiny", False, "bfloat16", attn_dp=True, w8a8=True),
    # hidden 1024: within the A3 MC2 kernels' 1024 <= H <= 8192, so an NPU can replay these MC2 calls
    Configuration("sp2-alltoall-bfloat16-h1024", 2, "tiny-h1024", False, "bfloat16", "alltoall"),
    Configuration("dp-tp2x2-ep4-bfloat16-h1024", 4, "tiny-h1024", False, "bfloat16", attn_dp=True),
    # W4A4 (MXFP4 x MXFP4 npu_quant_matmul, A4W4 npu_grouped_matmul, npu_swiglu); widths multiples of 128
    Configuration("tp1-w4a4", 1, "tiny-h128", False, "bfloat16", w4a4=True),
    Configuration("recipe-tp4-ep4-w4a4", 4, "tiny-h256", False, "bfloat16", w4a4=True, attn_tp=4),
    # batch 1, as the recipe's 950 W4A4 files decode: the FP4 matmul's single row arrives duplicated (M == 2)
    Configuration("tp1-w4a4-batch1", 1, "tiny-h128", False, "bfloat16", w4a4=True, prompts=(tuple(PROMPTS[0]),)),
)
SINGLE_PROCESS = tuple(c for c in CONFIGURATIONS if c.world == 1)


# ------------------------------------------------------------------------------------------------ recording


def _describe(value):
    if isinstance(value, torch.Tensor):
        return {
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "stride": list(value.stride()),
        }
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value)
    return value


# A communicator name (group_ep / group_tp) is the recording job's own (a gloo group counter that depends on which
# groups the worker made before), meaningless to another job: recorded as this placeholder, so the recording is the
# same whatever ran first; the MC2 replay (equivalence/npu/mc2_replay.py) substitutes its own group's name.
COMMUNICATOR = "<communicator name>"


def _is_communicator(arg, value) -> bool:
    return arg.name.startswith("group") and isinstance(value, str) and value != ""


def signature(func, args, kwargs) -> dict:
    """{"op": "<name>[.<overload>]", "args": {name: description}} of one call, defaults filled in."""
    schema = func._schema
    described = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            value = args[i]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            value = None
        described[arg.name] = COMMUNICATOR if _is_communicator(arg, value) else _describe(value)
    overload = func._overloadname
    op = func._overloadpacket.__name__ + ("" if overload == "default" else f".{overload}")
    return {"op": op, "args": described}


def call_key(call: dict) -> str:
    return json.dumps({"op": call["op"], "args": call["args"]}, sort_keys=True)


MC2_OPS = ("npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2")


def bind(func, args, kwargs) -> dict:
    """The arguments given to one call by schema name (defaults not filled in): what a replay passes as keywords."""
    names = [a.name for a in func._schema.arguments if not a.kwarg_only]
    return {**dict(zip(names, args)), **kwargs}


class NpuCallRecorder(TorchDispatchMode):
    """Records each `npu::` call and runs it on the portable kernel (also where torch_npu owns the namespace, so
    the model runs on the CPU there too). `capture=True` keeps the argument values of each signature's first call
    (what the NPU replay feeds torch_npu). `mc2=True` keeps, by call order, this rank's first call of each MC2
    collective with its arguments by name and its portable outputs (`mc2_calls`: what equivalence/npu/mc2_replay.py
    replays as a multi-rank job; ranks run in lockstep, so every rank's first dispatch / combine is the same
    layer of the same step, though their signatures differ by ep_rank_id)."""

    def __init__(self, capture: bool = False, mc2: bool = False):
        super().__init__()
        self.calls: dict[str, dict] = {}
        self.captured: dict[str, tuple] = {}
        self.mc2_calls: dict[str, dict] = {}
        self.capture = capture
        self.mc2 = mc2

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "npu":
            return func(*args, **kwargs)
        from optimized.ops.registry import PORTABLE_KERNELS

        call = signature(func, args, kwargs)
        key = call_key(call)
        self.calls.setdefault(key, call)
        if self.capture and key not in self.captured:
            self.captured[key] = (call["op"], _clone(args), _clone(kwargs))
        kernel = PORTABLE_KERNELS.get(call["op"], func)
        keep = self.mc2 and call["op"] in MC2_OPS and call["op"] not in self.mc2_calls
        arguments = _clone(bind(func, args, kwargs)) if keep else None  # before the kernel: inputs as given
        out = kernel(*args, **kwargs)
        if keep:
            self.mc2_calls[call["op"]] = {"arguments": arguments, "outputs": _clone(out)}
        return out


class NpuOpCounter(TorchDispatchMode):
    """How many times each `npu::` operator was called (by name, overload dropped), run as called."""

    def __init__(self):
        super().__init__()
        from collections import Counter

        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "npu":
            self.ops[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


@torch.no_grad()
def run_configuration(rank: int, world: int, config: Configuration, capture: bool = False):
    """Build the model (its load-time calls: the NZ weight casts) and generate from `PROMPTS` under a recorder ->
    (calls by key, captured arguments by key)."""
    from equivalence.support.parallel_support import dtype_of, runner_of, test_device
    from optimized.distributed import ParallelState
    from optimized.model_loader.build import load_model

    with NpuCallRecorder(capture) as recorder:
        model = load_model(
            config.checkpoint(),
            parallel=ParallelState.build(**config.layout()),
            dtype=dtype_of(config.dtype),
            device=str(test_device()),
        )
        runner_of(model).generate(config.requests(), NEW_TOKENS)
    return recorder.calls, recorder.captured


def record(config: Configuration, capture: bool = False) -> tuple[dict, dict]:
    """Rank 0's calls merged with every other rank's (ranks route different token counts)."""
    if config.world == 1:
        return run_configuration(0, 1, config, capture)
    from equivalence.support.dist import get_pool

    calls, captured = {}, {}
    for rank_calls, rank_captured in get_pool(config.world).run(run_configuration, config, capture, timeout=300):
        calls.update(rank_calls)
        for key, value in rank_captured.items():
            captured.setdefault(key, value)
    return calls, captured


@torch.no_grad()
def _mc2_task(rank: int, world: int, config: Configuration) -> dict[str, dict]:
    from equivalence.support.parallel_support import dtype_of, on_host, rank_model, runner_of

    model = rank_model(config.checkpoint(), config.layout(), dtype_of(config.dtype))
    with NpuCallRecorder(mc2=True) as recorder:
        runner_of(model).generate(config.requests(), NEW_TOKENS)
    return on_host(recorder.mc2_calls)


def record_mc2(config: Configuration) -> list[dict[str, dict]]:
    """Every rank's first MC2 dispatch and combine (`NpuCallRecorder.mc2_calls`), in rank order."""
    if config.world == 1:
        return [_mc2_task(0, 1, config)]
    from equivalence.support.dist import get_pool

    return get_pool(config.world).run(_mc2_task, config, timeout=300)


def mc2_configurations() -> tuple[Configuration, ...]:
    """The recording configurations whose decode runs MC2 (the plan's decode path, not the recording's)."""
    return tuple(c for c in CONFIGURATIONS if c.paths().mc2)


def load_recording() -> dict[str, dict]:
    """The committed calls by key."""
    data = json.loads(RECORDING.read_text())
    return {call_key(call): call for call in data["calls"]}


def main() -> None:
    merged: dict[str, dict] = {}
    for config in CONFIGURATIONS:
        for key, call in record(config)[0].items():
            merged.setdefault(key, {**call, "configurations": []})["configurations"].append(config.name)
    calls = sorted(merged.values(), key=lambda c: (c["op"], call_key(c)))
    RECORDING.parent.mkdir(parents=True, exist_ok=True)
    RECORDING.write_text(
        json.dumps(
            {
                "regenerate": REGENERATE,
                "prompts": PROMPTS,
                "new_tokens": NEW_TOKENS,
                "configurations": [c.name for c in CONFIGURATIONS],
                "calls": calls,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"{len(calls)} distinct calls of {len({c['op'] for c in calls})} operators -> {RECORDING}")


if __name__ == "__main__":
    main()
