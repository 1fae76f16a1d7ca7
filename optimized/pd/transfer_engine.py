"""The KV transfer engine: one small interface, the Mooncake Transfer Engine behind it.

The calls are the recipe's (`executor/online/kv_transfer/transfer_engine.py`): `initialize(host, "P2PHANDSHAKE",
protocol, device)`, `register_memory`, `batch_transfer_sync_write`. With P2PHANDSHAKE there is no metadata server:
each engine listens on an RPC port Mooncake binds itself, and a peer is named by its session id "host:port". The
sender writes straight into the receiver's registered memory (a one-sided write); the receiver only registers.

On the CPU the protocol is `tcp` (PyPI `mooncake-transfer-engine-non-cuda`, which loads libibverbs even for TCP).
On an Ascend NPU the same interface runs the recipe's `ascend` protocol (Mooncake built with
`-DUSE_ASCEND_DIRECT=ON`, the `mooncake-transfer-engine-npu` build), the device name being the NPU's: nothing above
this module changes.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from optimized.errors import UsageError

HANDSHAKE = "P2PHANDSHAKE"  # peers exchange segment descriptors directly, no metadata server
PROTOCOLS = ("tcp", "ascend")


class TransferError(RuntimeError):
    """The transfer engine reported a failure (a peer gone, a write refused): not the user's to fix by an option."""


class KvTransferEngine(abc.ABC):
    """Moves bytes from this process's registered memory into a peer's registered memory."""

    @abc.abstractmethod
    def initialize(self, host: str, metadata: str, protocol: str, device: str) -> None: ...

    @property
    @abc.abstractmethod
    def session_id(self) -> str:
        """ "host:port" a peer names this engine by (valid after initialize)."""

    @abc.abstractmethod
    def register_memory(self, address: int, length: int) -> None: ...

    @abc.abstractmethod
    def batch_transfer_sync_write(
        self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]
    ) -> None:
        """Write each src[i] .. src[i] + lengths[i] of this process to dst[i] of `peer`; returns once all landed."""

    def register_tensor(self, tensor: torch.Tensor) -> None:
        """Register a tensor's whole storage (a KV cache tensor: its address stays put for the pool's lifetime)."""
        if not tensor.is_contiguous():
            raise UsageError(f"KV transfer registers contiguous tensors only; got strides {tensor.stride()}")
        self.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size())


class MooncakeTransferEngine(KvTransferEngine):
    def __init__(self):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise UsageError(
                "the KV transfer needs the Mooncake Transfer Engine: pip install -e '.[pd]' (CPU, protocol tcp; it "
                "needs the system package libibverbs1), or on an NPU the mooncake-transfer-engine-npu build"
            ) from e
        self._engine = TransferEngine()
        self._session_id = ""

    def initialize(self, host: str, metadata: str = HANDSHAKE, protocol: str = "tcp", device: str = "") -> None:
        if protocol not in PROTOCOLS:
            raise UsageError(f"KV transfer protocol {protocol!r}: expected one of {PROTOCOLS}")
        # the host without a port: Mooncake binds its own RPC port and reports it
        ret = self._engine.initialize(host, metadata, protocol, device)
        if ret != 0:
            raise TransferError(f"Mooncake initialize({host!r}, {metadata!r}, {protocol!r}, {device!r}) returned {ret}")
        self._session_id = f"{host}:{self._engine.get_rpc_port()}"

    @property
    def session_id(self) -> str:
        if not self._session_id:
            raise TransferError("the transfer engine has no session id before initialize()")
        return self._session_id

    def register_memory(self, address: int, length: int) -> None:
        ret = self._engine.register_memory(address, length)
        if ret != 0:
            raise TransferError(f"Mooncake register_memory(0x{address:x}, {length}) returned {ret}")

    def batch_transfer_sync_write(
        self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]
    ) -> None:
        if not len(src) == len(dst) == len(lengths):
            raise ValueError(f"{len(src)} sources, {len(dst)} destinations, {len(lengths)} lengths")
        if not src:
            return
        ret = self._engine.batch_transfer_sync_write(peer, list(src), list(dst), list(lengths))
        if ret != 0:
            raise TransferError(f"Mooncake batch_transfer_sync_write to {peer} ({len(src)} writes) returned {ret}")
