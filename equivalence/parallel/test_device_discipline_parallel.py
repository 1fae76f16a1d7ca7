"""Attention DP on a device that is not the CPU, over real gloo ranks: the multi-rank proof of device discipline.

Every rank of a world-2 gloo job (`equivalence.support.dist`, forked) puts its model on the fake `npu:0` of
`equivalence.support.fake_device`: the collectives (`c10d` operators from torch.distributed, `_c10d_functional` ones)
run
on the host values and land in the device tensors, a collective of host tensors is refused (HCCL moves device
tensors only), every other operator must take tensors of one device. Layout: the recipe's attention DP with
attention TP 1 (each rank its own DP group, its own requests and paged KV cache), MoE EP 2 over both ranks: the
prefill's MoE by double routing, the decode's by MC2 (npu_moe_distribute_dispatch_v2 / combine_v2), the selected
logits gathered over the job.
- the fake-device job generates bitwise the CPU job's tokens, returned logits and prompt logits (fp32, bf16),
  every decode step's MoE through MC2;
- one forward step of the runner (wrapped `model.forward`, so what the runner passes is what is checked): a
  decode step reads nothing back; a prefill step reads back exactly the double routing's split sizes (two host
  lists per MoE layer, what its all_to_all_v takes); neither step copies host data onto the device (FAILS while
  `DataParallelPhase.logits` builds its row index with `torch.tensor(picked, device=...)` inside the forward);
- a host tensor planted in the DP step's attention or MLP fails the step with DeviceMismatch on every rank;
- the collectives themselves: all_gather / reduce_scatter / all_to_all / all_reduce / broadcast and the functional
  all_gather / all_reduce give device tensors holding the gloo results; a host-only all_gather is refused.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from equivalence.support.dist import get_pool
from equivalence.support.parallel_support import dtype_of, run_property, same_on_all_ranks
from equivalence.support.strategies import BLOCK_SIZE, prompt_batches
from fixtures.tiny import tiny_config

pytestmark = pytest.mark.distributed

WORLD = 2
LAYOUT = dict(
    world_size=WORLD,
    attn_tp_size=1,
    moe_tp_size=1,
    moe_ep_size=WORLD,
    embed_tp_size=1,
    lmhead_tp_size=1,
    prefill_opt=False,
    moe_ep_scheme="auto",
    attn_dp=True,
)
CONFIG = tiny_config("tiny")
MOE_LAYERS = CONFIG.num_hidden_layers  # "tiny": every layer sparse
NEW_TOKENS = 3
DISPATCH, COMBINE = "npu.npu_moe_distribute_dispatch_v2.default", "npu.npu_moe_distribute_combine_v2.default"
# Four requests, two per DP group (dealt by load in tokens: 0 and 2 in group 0, 1 and 3 in group 1); lengths cross a
# block.
PROMPTS = [[1, 2, 3], list(range(4, 21)), list(range(9, 21)), list(range(30, 49))]


# ------------------------------------------------------------------------------------------ worker side


@functools.lru_cache(maxsize=4)
def _dp_model(fake: bool, dtype_name: str):
    """This rank's attention-DP model, on the fake npu:0 or on the CPU (every rank builds in the same order)."""
    from equivalence.support.fake_device import on_fake_device, register
    from fixtures.checkpoints import checkpoint
    from optimized.distributed import ParallelState
    from optimized.model_loader.build import load_model

    state = ParallelState.build(**LAYOUT)
    assert state.parallel.attn_dp_size == WORLD, state.parallel
    if not fake:
        return load_model(checkpoint("tiny"), parallel=state, dtype=dtype_of(dtype_name), device="cpu")
    with on_fake_device():
        return load_model(checkpoint("tiny"), parallel=state, dtype=dtype_of(dtype_name), device=register())


@torch.no_grad()
def _generate_task(rank, world, fake, dtype_name, prompts, n):
    from equivalence.support.fake_device import on_fake_device, to_host
    from optimized.executor.model_runner import ModelRunner

    model = _dp_model(fake, dtype_name)
    positions = [list(range(len(p))) for p in prompts]
    with on_fake_device() if fake else contextlib.nullcontext() as mode:
        res = ModelRunner(model, BLOCK_SIZE).generate(prompts, n, return_logits=True, prompt_logits_positions=positions)
    out = {
        "tokens": res.tokens,
        "logits": to_host(res.logits),
        "prompt_logits": to_host(res.prompt_logits),
        "decode_steps": len(res.decode_seconds),
    }
    if fake:
        seen = ("c10d.", "_c10d_functional.", "npu.npu_moe_distribute")
        out["ops"] = {op: c for op, c in mode.ops.items() if op.startswith(seen)}
    return out


@torch.no_grad()
def _steps_task(rank, world, prompts, n):
    """Every forward step the runner makes in generate(prompts, n) on the fake device: (prefill?, host reads,
    host -> device copies, MC2 calls, the logits' type and device)."""
    from equivalence.support.fake_device import DeviceTensor, on_fake_device
    from optimized.executor.model_runner import ModelRunner

    model = _dp_model(True, "float32")
    steps = []
    with on_fake_device() as mode:

        def counted(ids, meta, caches, *a, _forward=type(model).forward, **kw):
            reads, transfers, dispatch = len(mode.host_reads), len(mode.transfers), mode.ops[DISPATCH]
            logits = _forward(model, ids, meta, caches, *a, **kw)
            steps.append(
                {
                    "prefill": meta.is_prefill,
                    "reads": mode.host_reads[reads:],
                    "transfers": mode.transfers[transfers:],
                    "mc2": mode.ops[DISPATCH] - dispatch,
                    "logits": (isinstance(logits, DeviceTensor), str(logits.device)),
                }
            )
            return logits

        model.forward = counted
        try:
            ModelRunner(model, BLOCK_SIZE).generate(prompts, n)
        finally:
            del model.forward
    return steps


@torch.no_grad()
def _planted_task(rank, world, where):
    """generate with a host tensor added in DataParallelStep.`where` -> the DeviceMismatch message (None: none)."""
    from equivalence.support.fake_device import DeviceMismatch, on_fake_device
    from optimized.executor.model_runner import ModelRunner
    from optimized.phases import DataParallelStep

    model = _dp_model(True, "float32")
    original = getattr(DataParallelStep, where)
    if where == "attention":

        def planted(self, attn, x, *a, **k):
            return original(self, attn, x + torch.zeros(x.shape[-1], dtype=x.dtype), *a, **k)
    else:

        def planted(self, block, router_in, expert_in):
            return original(self, block, router_in, expert_in + torch.zeros(expert_in.shape[-1], dtype=expert_in.dtype))

    setattr(DataParallelStep, where, planted)
    try:
        with on_fake_device():
            ModelRunner(model, BLOCK_SIZE).generate([[1, 2, 3], [4, 5]], 2)
    except DeviceMismatch as e:
        return str(e)
    finally:
        setattr(DataParallelStep, where, original)
    return None


def _collectives_task(rank, world):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from equivalence.support.fake_device import DeviceMismatch, DeviceTensor, on_fake_device, register
    from optimized.distributed import collectives as comm

    pg, out = dist.group.WORLD, {}
    with on_fake_device() as mode:
        x = torch.arange(4, dtype=torch.float32, device=register()).view(2, 2) + 10 * rank
        results = {
            "all_gather": comm.all_gather(x, pg),
            "reduce_scatter": comm.reduce_scatter(x, pg),
            "all_to_all": comm.all_to_all_single(x, pg),
            "all_reduce": comm.all_reduce(x.clone(), pg),
            "broadcast": comm.broadcast(x.clone(), pg),
            "funcol_all_gather": funcol.all_gather_single(x, 0, pg),
            "funcol_all_reduce": funcol.all_reduce(x, "sum", pg),
        }
        for name, t in results.items():
            host = t.host if isinstance(t, DeviceTensor) else None
            out[name] = (type(t).__name__, str(t.device), type(host).__name__, None if host is None else host.clone())
        try:
            comm.all_gather(torch.ones(2), pg)
            out["host_only"] = None
        except DeviceMismatch as e:
            out["host_only"] = str(e)
        out["ops"] = sorted(op for op in mode.ops if op.startswith(("c10d.", "_c10d_functional.")))
    return out


# ------------------------------------------------------------------------------------------ parent side


def _assert_bitwise(got, want, what):
    assert len(got) == len(want), f"{what}: {len(got)} != {len(want)} requests"
    for b, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{what} of request {b} differ from the CPU job's (max abs {(g - w).abs().max()})"


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_attention_dp_on_a_non_cpu_device_generates_what_the_cpu_job_generates(dtype_name):
    def check(prompts):
        pool = get_pool(WORLD)
        got = same_on_all_ranks(
            pool.run(_generate_task, True, dtype_name, prompts, NEW_TOKENS, timeout=120), "fake-device attention DP"
        )
        want = same_on_all_ranks(
            pool.run(_generate_task, False, dtype_name, prompts, NEW_TOKENS, timeout=120), "CPU attention DP"
        )
        what = f"attention DP {dtype_name} on npu:0, batch {len(prompts)}"
        assert got["tokens"] == want["tokens"], f"{what}: tokens {got['tokens']} != the CPU job's {want['tokens']}"
        _assert_bitwise(got["logits"], want["logits"], f"{what}: generated logits")
        _assert_bitwise(got["prompt_logits"], want["prompt_logits"], f"{what}: prompt logits")
        ops, steps = got["ops"], got["decode_steps"]
        assert ops.get(DISPATCH) == ops.get(COMBINE) == steps * MOE_LAYERS, f"{what}: MC2 calls {ops}"
        assert ops.get("c10d.alltoall_base_.default"), f"{what}: the prefill's double routing sent nothing: {ops}"
        assert ops.get("c10d._allgather_base_.default"), f"{what}: the logits were never gathered: {ops}"

    run_property(check, 2, prompts=prompt_batches(CONFIG.vocab_size, 1, 4, 24))


def _rank_steps():
    """Per rank, the runner's forward steps (a prefill, then NEW_TOKENS - 1 decode steps)."""
    ranks = get_pool(WORLD).run(_steps_task, PROMPTS, NEW_TOKENS, timeout=120)
    for r, steps in enumerate(ranks):
        assert [s["prefill"] for s in steps] == [True] + [False] * (NEW_TOKENS - 1), f"rank {r}: {steps}"
        assert all(s["logits"] == (True, "npu:0") for s in steps), f"rank {r}: logits {[s['logits'] for s in steps]}"
    return ranks


def test_attention_dp_decode_step_reads_nothing_back_from_the_device():
    for r, steps in enumerate(_rank_steps()):
        for i, step in enumerate(steps[1:], start=1):
            assert step["mc2"] == MOE_LAYERS, f"rank {r} decode step {i}: {step['mc2']} MC2 dispatches"
            assert not step["reads"], (
                f"rank {r} decode step {i} read the device {len(step['reads'])} times: {step['reads']}"
            )


def test_attention_dp_prefill_step_reads_back_only_the_double_routing_split_sizes():
    """Path B's all_to_all_v takes host split sizes: `tokens_per_expert` and its exchanged counts, stacked and read
    in one transfer per MoE layer (layers/exchange.py split_sizes); nothing else leaves the device."""
    for r, steps in enumerate(_rank_steps()):
        prefill = steps[0]
        assert prefill["mc2"] == 0, f"rank {r}: the prefill went through MC2"
        reads = prefill["reads"]
        splits = all(read.startswith("tolist at optimized/layers/exchange.py:") for read in reads)
        assert splits and len(reads) == MOE_LAYERS, (
            f"rank {r}: the prefill's host reads {reads} != the split sizes ({MOE_LAYERS} tolist in exchange.py)"
        )


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_attention_dp_step_copies_no_host_data_onto_the_device__picked_rows_index_belongs_to_the_runner(phase):
    """FAILS while DataParallelPhase.logits (optimized/phases.py) builds the selected rows' index in the forward,
    `torch.tensor(picked, device=hidden.device)`: a host -> device copy every step; passes once the runner hands
    the step that index on the device (as it does the prefill's logits_indices)."""
    for r, steps in enumerate(_rank_steps()):
        for i, step in enumerate(steps):
            if step["prefill"] == (phase == "prefill"):
                assert not step["transfers"], (
                    f"rank {r} {phase} step {i} copied host data onto the device: {step['transfers']}"
                )


@pytest.mark.parametrize("where", ["attention", "moe"])
def test_a_host_tensor_planted_in_the_data_parallel_step_is_caught(where):
    messages = get_pool(WORLD).run(_planted_task, where, timeout=120)
    for r, message in enumerate(messages):
        assert message is not None, f"rank {r}: a host tensor in DataParallelStep.{where} went unnoticed"
        assert "aten.add.Tensor" in message and "['cpu', 'npu:0']" in message, f"rank {r}: {message}"


def test_collectives_on_the_fake_device_move_the_host_values_into_device_tensors():
    ranks = get_pool(WORLD).run(_collectives_task, timeout=60)
    x = [torch.arange(4, dtype=torch.float32).view(2, 2) + 10 * r for r in range(WORLD)]
    total = sum(x)
    for r, out in enumerate(ranks):
        want = {
            "all_gather": torch.cat(x),
            "reduce_scatter": total[r : r + 1],
            "all_to_all": torch.cat([t[r : r + 1] for t in x]),
            "all_reduce": total,
            "broadcast": x[0],
            "funcol_all_gather": torch.cat(x),
            "funcol_all_reduce": total,
        }
        for name, value in want.items():
            kind, device, host_kind, got = out[name]
            assert (kind, device, host_kind) == ("DeviceTensor", "npu:0", "Tensor"), f"rank {r} {name}: {out[name][:3]}"
            assert torch.equal(got, value), f"rank {r} {name}: {got} != {value}"
        assert out["host_only"] and "HCCL moves device tensors only" in out["host_only"], out["host_only"]
        for op in (
            "c10d._allgather_base_.default",
            "c10d._reduce_scatter_base_.default",
            "c10d.alltoall_base_.default",
            "c10d.allreduce_.default",
            "c10d.broadcast_.default",
            "_c10d_functional.all_gather_into_tensor.default",
            "_c10d_functional.all_reduce.default",
        ):
            assert op in out["ops"], f"rank {r}: {op} never reached the device discipline: {out['ops']}"
