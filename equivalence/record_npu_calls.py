"""Every `torch.ops.npu` call the optimized model makes, recorded on the CPU: the contract the NPU replay tests check.

A call is recorded as its operator and its arguments by schema name (defaults filled in): tensors as dtype, shape
and stride, everything else by value; never the data. `CONFIGURATIONS` are the runs recorded: the tiny fixtures
through `ModelRunner.generate` (prefill and greedy decode), single process in fp32, bf16, W4A8 and W8A8, and the
sequence-parallel prefill over 2 gloo ranks (both EP schemes, bf16, W4A8 and W8A8). The deduplicated calls go to
`equivalence/spec/recorded_npu_calls.json`; regenerate it after a change to what the model calls with

    PYTHONPATH=. python -m equivalence.record_npu_calls

`equivalence/test_recorded_npu_calls.py` re-records the single-process runs and fails on a call the file lacks;
`equivalence/test_npu_replay.py` replays every listed call on torch_npu against the portable kernel.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

RECORDING = Path(__file__).resolve().parent / "spec" / "recorded_npu_calls.json"
REGENERATE = "PYTHONPATH=. python -m equivalence.record_npu_calls"
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3]]
NEW_TOKENS = 2


@dataclass(frozen=True)
class Configuration:
    name: str
    world: int
    fixture: str
    w4a8: bool
    dtype: str
    scheme: str | None = None   # None: the tensor-parallel layout; else the SP prefill with this EP scheme
    w8a8: bool = False          # the W8A8 conversion (MXFP8 experts) instead of w4a8 / bf16

    def layout(self) -> dict:
        from equivalence.strategies import layout, sp_layout
        return layout(1) if self.scheme is None else sp_layout(self.world, self.scheme)

    def checkpoint(self) -> Path:
        from fixtures.checkpoints import checkpoint, w4a8_checkpoint, w8a8_checkpoint
        return (w8a8_checkpoint if self.w8a8 else w4a8_checkpoint if self.w4a8 else checkpoint)(self.fixture)


CONFIGURATIONS = (
    Configuration("tp1-float32", 1, "tiny", False, "float32"),
    Configuration("tp1-bfloat16", 1, "tiny", False, "bfloat16"),
    Configuration("tp1-w4a8", 1, "tiny", True, "bfloat16"),
    Configuration("tp1-w8a8", 1, "tiny", False, "bfloat16", w8a8=True),
    Configuration("sp2-alltoall-bfloat16", 2, "tiny", False, "bfloat16", "alltoall"),
    Configuration("sp2-alltoall-w8a8", 2, "tiny", False, "bfloat16", "alltoall", w8a8=True),
    Configuration("sp2-alltoall-w4a8", 2, "tiny", True, "bfloat16", "alltoall"),
    Configuration("sp2-allgather-w4a8", 2, "tiny-dense", True, "bfloat16", "allgather"),
)
SINGLE_PROCESS = tuple(c for c in CONFIGURATIONS if c.world == 1)


# ------------------------------------------------------------------------------------------------ recording

def _describe(value):
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                "stride": list(value.stride())}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value)
    return value


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
        described[arg.name] = _describe(value)
    overload = func._overloadname
    op = func._overloadpacket.__name__ + ("" if overload == "default" else f".{overload}")
    return {"op": op, "args": described}


def call_key(call: dict) -> str:
    return json.dumps({"op": call["op"], "args": call["args"]}, sort_keys=True)


class NpuCallRecorder(TorchDispatchMode):
    """Records each `npu::` call and runs it on the portable kernel (also where torch_npu owns the namespace, so
    the model runs on the CPU there too). `capture=True` keeps the argument values of each signature's first call
    (what the NPU replay feeds torch_npu)."""

    def __init__(self, capture: bool = False):
        super().__init__()
        self.calls: dict[str, dict] = {}
        self.captured: dict[str, tuple] = {}
        self.capture = capture

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
        return kernel(*args, **kwargs)


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
    """Generate from `PROMPTS` under a recorder -> (calls by key, captured arguments by key)."""
    from equivalence.parallel_support import dtype_of, rank_model, runner_of

    model = rank_model(config.checkpoint(), config.layout(), dtype_of(config.dtype))
    with NpuCallRecorder(capture) as recorder:
        runner_of(model).generate(PROMPTS, NEW_TOKENS)
    return recorder.calls, recorder.captured


def record(config: Configuration, capture: bool = False) -> tuple[dict, dict]:
    """Rank 0's calls merged with every other rank's (ranks route different token counts)."""
    if config.world == 1:
        return run_configuration(0, 1, config, capture)
    from equivalence.dist import get_pool
    calls, captured = {}, {}
    for rank_calls, rank_captured in get_pool(config.world).run(run_configuration, config, capture, timeout=300):
        calls.update(rank_calls)
        for key, value in rank_captured.items():
            captured.setdefault(key, value)
    return calls, captured


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
    RECORDING.write_text(json.dumps({"regenerate": REGENERATE, "prompts": PROMPTS, "new_tokens": NEW_TOKENS,
                                     "configurations": [c.name for c in CONFIGURATIONS], "calls": calls},
                                    indent=1) + "\n")
    print(f"{len(calls)} distinct calls of {len({c['op'] for c in calls})} operators -> {RECORDING}")


if __name__ == "__main__":
    main()
