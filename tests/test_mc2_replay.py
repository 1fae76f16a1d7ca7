"""The MC2 replay harness (equivalence/npu/mc2_replay.py) on the CPU: gloo ranks, portable kernels.

The NPU test (`test_npu_replay.py::test_recorded_mc2_on_torch_npu_equals_the_portable_kernels`) runs the same
harness on hccl ranks; here it is proven on its own terms: with the replay group's own name substituted the
recorded dispatch / combine replay and match their recorded outputs; with the recorded (stale) group name the
replay is refused before any collective; a corrupted expected row inside expand_x[:n_recv], a corrupted
expert_token_nums or combine output fails, while a row past n_recv (unspecified) does not; and every recorded MC2
call's configuration is one the MC2 replay covers.
"""

from __future__ import annotations

import functools

import pytest
import torch

from equivalence.npu import mc2_replay
from equivalence.npu.mc2_replay import COMBINE, DISPATCH, RankCapture
from equivalence.npu.record_npu_calls import CONFIGURATIONS, load_recording, mc2_configurations

pytestmark = pytest.mark.distributed

BY_NAME = {c.name: c for c in CONFIGURATIONS}
MC2_CONFIGURATIONS = tuple(c.name for c in mc2_configurations())  # what the NPU MC2 replay runs


@functools.lru_cache(maxsize=None)
def _captures(name: str) -> tuple[RankCapture, ...]:
    return tuple(mc2_replay.capture(BY_NAME[name]))


def _outcomes(rank: int, world: int, captures, variants: dict) -> dict:
    """Each variant's replay on this rank: 'ok' or the error's type and message (the replay group's name too, to
    show it differs from the recorded one). A refusal happens before any collective and a mismatch after both,
    on every rank alike, so one variant's failure cannot leave the next blocked."""
    import torch.distributed as dist

    out = {}
    for label, kwargs in variants.items():
        try:
            out[label] = mc2_replay.replay_task(rank, world, list(captures), **kwargs)
        except (AssertionError, ValueError) as err:
            out[label] = f"{type(err).__name__}: {err}"
    group = mc2_replay.new_replay_group(world)
    from optimized.distributed.parallel_state import comm_name

    out["name"] = comm_name(group)
    dist.destroy_process_group(group)
    return out


def _altered(captures, rank: int, **change) -> list[RankCapture]:
    """The captures with rank `rank`'s expected outputs changed (what a wrong kernel would be measured against)."""
    import dataclasses

    out = list(captures)
    out[rank] = dataclasses.replace(captures[rank], **change)
    return out


def _bump(t: torch.Tensor, row: int) -> torch.Tensor:
    t = t.clone()
    t[row] = t[row] + (1 if not t.dtype.is_floating_point else 1.0 + t[row].abs())
    return t


@pytest.mark.parametrize("name", MC2_CONFIGURATIONS)
def test_mc2_replay_passes_with_its_own_group_and_refuses_the_recorded_name(name):
    captures = _captures(name)
    world = captures[0].world
    assert len(captures) == world == BY_NAME[name].world
    recorded = captures[0].dispatch_args["group_ep"]
    out = _pool_outcomes(captures, {"own group": {}, "recorded name": {"substitute": False}})
    for rank, res in enumerate(out):
        assert res["own group"] == "ok", f"{name} rank {rank}: {res['own group']}"
        assert res["name"] != recorded, f"the replay group's name equals the recorded {recorded!r}: proves nothing"
        assert res["recorded name"].startswith(
            "StaleGroupNameError: npu_moe_distribute_dispatch_v2: group_ep="
            f"{recorded!r} does not name this replay's group"
        ), res


def _pool_outcomes(captures, variants: dict) -> list[dict]:
    from equivalence.support.dist import get_pool

    return get_pool(captures[0].world).run(_outcomes, captures, variants, timeout=180)


def test_mc2_replay_checks_fail_on_planted_wrong_outputs():
    """Planted wrong expectations on rank 0 (as a wrong NPU kernel would produce): each fails by name, on rank 0
    only; a changed row past n_recv is unspecified and passes."""
    captures = _captures("sp2-alltoall-bfloat16")
    cap = captures[0]
    n, rows = cap.n_recv, cap.dispatch_out[0].shape[0]
    assert 0 < n < rows, f"need received rows and unspecified rows past them (n_recv={n}, A={rows})"
    expand_x, counts = cap.dispatch_out[0], cap.dispatch_out[3]
    with_output = lambda i, t: tuple(t if j == i else o for j, o in enumerate(cap.dispatch_out))  # noqa: E731
    variants = {
        "received row": {"expected": _altered(captures, 0, dispatch_out=with_output(0, _bump(expand_x, n - 1)))},
        "row past n_recv": {"expected": _altered(captures, 0, dispatch_out=with_output(0, _bump(expand_x, n)))},
        "expert_token_nums": {
            "expected": _altered(
                captures,
                0,
                dispatch_out=with_output(
                    3, counts.flip(0) if not torch.equal(counts, counts.flip(0)) else _bump(counts, 0)
                ),
            )
        },
        "combine output": {"expected": _altered(captures, 0, combine_out=_bump(cap.combine_out, 0))},
    }
    out = _pool_outcomes(captures, variants)
    assert out[0]["row past n_recv"] == "ok" and all(r == "ok" for k, r in out[1].items() if k != "name"), out
    assert "dispatch expand_x[:" in out[0]["received row"], out[0]["received row"]
    assert "dispatch expert_token_nums" in out[0]["expert_token_nums"], out[0]["expert_token_nums"]
    assert "combine output" in out[0]["combine output"], out[0]["combine output"]
    for label in ("received row", "expert_token_nums", "combine output"):
        assert out[0][label].startswith("AssertionError: sp2-alltoall-bfloat16 rank 0"), (label, out[0][label])


def test_mc2_capture_keeps_no_recorded_handle():
    """The combine's handles are opaque (spec §10.2): the capture drops them, so a replay can only give its own."""
    for cap in _captures("sp2-alltoall-bfloat16"):
        assert not set(mc2_replay.HANDLE_ARGS) & set(cap.combine_args), sorted(cap.combine_args)
        assert cap.dispatch_args["ep_rank_id"] == cap.rank


def test_every_recorded_mc2_call_is_covered_by_the_mc2_replay():
    """The single-process NPU replay skips the MC2 collectives (test_npu_replay.py): each recorded MC2 call's
    configuration must be one the MC2 replay runs (`mc2_configurations`, multi-rank), or no NPU test sees it."""
    covered = {c.name for c in mc2_configurations()}
    recorded = {}
    for call in load_recording().values():
        if call["op"] in (DISPATCH, COMBINE):
            for config in call["configurations"]:
                recorded.setdefault(config, set()).add(call["op"])
    assert recorded, "the recording has no MC2 call: the MC2 replay would prove nothing"
    assert set(recorded) == covered, (
        f"recorded MC2 configurations {sorted(recorded)} vs the MC2 replay's {sorted(covered)}"
    )
    assert all(ops == {DISPATCH, COMBINE} for ops in recorded.values()), recorded
    assert all(BY_NAME[c].world > 1 for c in covered), "an MC2 replay needs ep_world_size ranks"


def test_spawned_ranks_run_the_replay_as_the_npu_test_does():
    """The launcher of the NPU test (fresh spawned processes, default group on the platform backend: gloo here)
    runs the same replay; and a rank that raises fails the call with its traceback rather than hanging."""
    captures = list(_captures("sp2-alltoall-bfloat16"))
    assert mc2_replay.run_on_spawned_ranks(2, mc2_replay.replay_task, captures, timeout=240) == ["ok", "ok"]
    with pytest.raises(RuntimeError, match=r"(?s)rank 0 raised:.*StaleGroupNameError"):
        mc2_replay.run_on_spawned_ranks(2, mc2_replay.replay_task, captures, substitute=False, timeout=240)


def test_replay_arguments_reach_the_device_inside_their_dicts():
    """The replay hands the kernels its captured arguments by name (a dict): every tensor in it, nested ones too, is
    moved to the replay's device (a move that skipped dicts left the NPU kernels host tensors)."""
    from equivalence.support.parallel_support import to_device

    moved = to_device({"x": torch.ones(2, 3), "group_ep": "g", "ep_world_size": 2, "nested": [torch.zeros(1)]}, "meta")
    assert moved["x"].device.type == moved["nested"][0].device.type == "meta"
    assert (moved["group_ep"], moved["ep_world_size"]) == ("g", 2)
