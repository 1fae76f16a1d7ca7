"""What an NPU job is handed by name or key: the HCCL communicator name of a group (`parallel_state.comm_name`) is
asked for with this process's global rank, whatever its rank inside the group; the compile cache's torchair keys do
not hash the portable kernels (the GE graph calls torch_npu's), while inductor keys still do (the graph inlines them).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import optimized  # noqa: F401
from fixtures.checkpoints import checkpoint
from optimized import platform
from optimized.distributed import parallel_state
from optimized.executor.compile_cache import cache_key, key_hash
from optimized.ops import registry

pytestmark = pytest.mark.equivalence


class _HcclBackend:
    def __init__(self):
        self.asked: list[int] = []

    def get_hccl_comm_name(self, rank: int) -> str:
        self.asked.append(rank)
        return f"hccl_comm_{rank}"


class _EpGroup:
    """An EP group of global ranks (1, 3), seen from global rank 3 (its rank 1 inside the group)."""

    ranks = (1, 3)
    group_name = "ep"

    def __init__(self):
        self.backend = _HcclBackend()

    def _get_backend(self, device):
        assert device.type == "npu", device
        return self.backend


def test_comm_name_asks_for_the_hccl_name_with_the_global_rank(monkeypatch):
    group = _EpGroup()
    monkeypatch.setattr(platform, "backend_name", lambda: "npu")
    monkeypatch.setattr(parallel_state.dist, "get_rank", lambda g=None: 1 if g is group else 3)
    monkeypatch.setattr(parallel_state.dist, "get_global_rank", lambda g, r: g.ranks[r])
    with monkeypatch.context() as m:  # no torch_npu here: torch.device("npu") for the one call
        m.setattr(parallel_state.torch, "device", lambda name: SimpleNamespace(type=name))
        name = parallel_state.comm_name(group)
    assert name == "hccl_comm_3"
    assert group.backend.asked == [3], "the group's rank (1) would name device 1 for a process on device 3"


def _key(model, **kw):
    return cache_key(model, batch_bucket=4, block_size=16, exe_mode="ge_graph", kv_cache_dtype=torch.float32, **kw)


@pytest.fixture(scope="module")
def model():
    from optimized.model_loader.build import load_model

    return load_model(checkpoint("tiny"), dtype=torch.float32, num_hidden_layers=1, device="cpu")


@pytest.mark.parametrize("backend, hashed", [("cpu", True), ("cuda", True), ("npu", False)])
def test_only_inductor_keys_hash_the_portable_kernels(model, monkeypatch, backend, hashed):
    monkeypatch.setattr(platform, "backend_name", lambda: backend)
    before = _key(model)
    monkeypatch.setattr(registry, "kernels_source_hash", lambda: "0" * 16)  # a portable kernel edited
    after = _key(model)
    assert (key_hash(before) != key_hash(after)) == hashed, (backend, before["kernels_source"], after["kernels_source"])
    if not hashed:
        assert before["kernels_source"] is None and before["inlined_kernels"] == [], before


def test_the_key_tells_nz_weights_from_nd_weights(model):
    from optimized.model_loader.build import load_model

    nd = load_model(checkpoint("tiny"), dtype=torch.float32, num_hidden_layers=1, device="cpu", weight_nz=False)
    assert _key(model)["weight_nz"] is True and _key(nd)["weight_nz"] is False
    assert key_hash(_key(model)) != key_hash(_key(nd))
