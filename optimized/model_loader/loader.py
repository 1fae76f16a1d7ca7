"""HF safetensors checkpoint -> this rank's shards, reading only the slices a rank owns.

`CheckpointReader` opens a single-file or index-sharded checkpoint with `safe_open` and hands out slices
through `get_slice`, so a rank never materializes a tensor it does not own. It counts the bytes it
reads (checked by a test: about 1/world of the sharded weights per rank) and remembers which tensors
were used, so unexpected leftovers are reported by name. `RandomWeights` stands in for a checkpoint of
the real shapes (benchmarks, latency runs) and never builds a full tensor either.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError

from optimized.model_loader.checkpoint_files import (
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    CheckpointError,
    FusedExpertView,
    declared_dtype,
    expand_fused_experts,
    open_file,
    weight_files,
)


def check_finite(tensor: torch.Tensor, name: str, label: str) -> None:
    """CheckpointError naming tensor `name` when a value read is NaN or inf: 16/32-bit floats, FP8 NaN bytes, or an
    MX scale byte 0xFF (E8M0 NaN, which the converter never writes). A NaN weight otherwise turns every logit into
    NaN and greedy decoding into token 0 forever, exit 0. One reduction over the bytes just read (aminmax propagates
    NaN and keeps +-inf; no temporary the size of the tensor); FP4 codes and other integers are always finite."""
    if tensor.numel() == 0:
        return
    if tensor.dtype in _FP8_NAN_BITS:  # E4M3FN: S.1111.111 is NaN (no inf); E5M2: exponent 11111 is inf / NaN
        bits = _FP8_NAN_BITS[tensor.dtype]
        bad = (tensor.view(torch.uint8) & bits) == bits
        what = "NaN / inf FP8 value(s)"
    elif tensor.dtype.is_floating_point:
        lo, hi = tensor.aminmax()
        if bool(torch.isfinite(lo) & torch.isfinite(hi)):
            return
        bad = ~torch.isfinite(tensor)
        what = "non-finite value(s) (NaN or inf)"
    elif tensor.dtype == torch.uint8 and name.endswith("weight_scale"):
        bad = tensor == 0xFF
        what = "E8M0 scale byte(s) 0xFF (NaN; `python -m optimized convert` never writes it)"
    else:
        return
    count = int(bad.sum())
    if count:
        raise CheckpointError(
            f"{label}: tensor {name!r} holds {count} {what}; the checkpoint is corrupt: re-download or re-convert it"
        )


_FP8_NAN_BITS = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}


class _NamedSource:
    """What the checkpoint-backed sources share: the name/shape checks, the byte count, the used set.

    Subclasses provide `label`, `names()`, `has(name)` and `_tensor(name)`, an object with `get_shape()`
    (or `.shape`) that can be indexed with a tuple of slices.
    """

    label: str

    def __init__(self, check_weights: bool = True):
        self.used: set[str] = set()
        self.bytes_read = 0
        self.check_weights = check_weights

    def read(self, name: str, expected_shape: tuple[int, ...], index: tuple = ()) -> torch.Tensor:
        """Read `name[index]` after checking the full tensor has `expected_shape`."""
        if not self.has(name):
            raise CheckpointError(f"{self.label}: missing tensor {name!r}")
        full = self._tensor(name)
        shape = tuple(full.get_shape() if hasattr(full, "get_shape") else full.shape)
        if shape != tuple(expected_shape):
            raise CheckpointError(
                f"{self.label}: tensor {name!r} has shape {shape}; the model expects {tuple(expected_shape)}"
            )
        tensor = full[index] if index else full[:]
        if self.check_weights:
            check_finite(tensor, name, self.label)
        self.used.add(name)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def skip(self, name: str) -> None:
        """`name` belongs to the model but another rank loads it: not unexpected here."""
        self.used.add(name)

    def check_all_used(self) -> None:
        unexpected = sorted(self.names() - self.used)
        if unexpected:
            shown = ", ".join(unexpected[:8]) + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else "")
            raise CheckpointError(f"{self.label}: unexpected tensors the model does not use: {shown}")


class CheckpointReader(_NamedSource):
    """A safetensors checkpoint (single file or sharded with an index); reads through `get_slice`.

    Fused expert tensors (transformers v5) are read under the per-expert names, one slice at a time; every
    tensor must have the dtype config.json declares. Broken files raise CheckpointError naming the file.
    """

    def __init__(self, path: str | os.PathLike, check_weights: bool = True):
        super().__init__(check_weights)
        self.path = Path(path)
        self.label = str(self.path)
        self._file_of = weight_files(self.path)
        self.dtype = declared_dtype(self.path, self._file_of)
        self._handles: dict[Path, object] = {}
        self._fused = expand_fused_experts(self._file_of, lambda n: self._slice(n).get_shape())

    def names(self) -> set[str]:
        fused = {name for name, _, _ in self._fused.values()}
        return (set(self._file_of) - fused) | set(self._fused)

    def has(self, name: str) -> bool:
        return name in self._fused or name in self._file_of

    def _slice(self, name: str):
        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = open_file(file)
        try:
            return self._handles[file].get_slice(name)
        except SafetensorError:  # the index maps `name` to a shard that does not hold it
            raise CheckpointError(
                f"{self.path / INDEX_FILE} maps tensor {name!r} to {file.name}, which does not "
                f"contain it; the index does not match the shards: re-download the checkpoint "
                f"(or its index)"
            ) from None

    def _tensor(self, name: str):
        if name in self._fused:
            fused, part, expert = self._fused[name]
            tensor = FusedExpertView(self._slice(fused), part, expert)
        else:
            tensor = self._slice(name)
        dtype = SAFETENSORS_DTYPES.get(tensor.get_dtype(), tensor.get_dtype())
        if self.dtype is not None and dtype != self.dtype:
            raise CheckpointError(
                f"{self.label}: tensor {name!r} has dtype {dtype} but config.json declares "
                f"dtype {self.dtype}; the file is corrupt or was written by another "
                f"conversion: re-download or re-convert it"
            )
        return tensor


class RandomWeights:
    """A weight source of the real shapes with seeded random values: each rank draws only its slice.

    Values are N(0, std) per tensor, seeded by the tensor name and the slice, so runs are repeatable.
    Norm weights get 1.0 (as in a freshly initialized model) so activations stay in range.
    """

    def __init__(self, seed: int = 0, std: float = 0.02):
        self.seed, self.std = seed, std
        self.used: set[str] = set()
        self.bytes_read = 0

    def read(self, name: str, expected_shape: tuple[int, ...], index: tuple = ()) -> torch.Tensor:
        self.used.add(name)
        if name.endswith("norm.weight"):
            return torch.ones(_sliced_shape(tuple(expected_shape), index))
        return self._values(name, tuple(expected_shape), index)

    def _values(self, name: str, shape: tuple[int, ...], index: tuple) -> torch.Tensor:
        """The values of `name[index]` (`shape`: the whole tensor's)."""
        # crc32, not hash(): str hashes change between processes, and every rank must draw the same values
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{name}:{index!r}".encode()))
        return torch.randn(_sliced_shape(shape, index), generator=generator) * self.std

    def skip(self, name: str) -> None:
        pass

    def check_all_used(self) -> None:
        pass


def _sliced_shape(shape: tuple[int, ...], index: tuple) -> tuple[int, ...]:
    out = list(shape)
    for dim, item in enumerate(index):
        if isinstance(item, slice):
            out[dim] = len(range(*item.indices(shape[dim])))
        else:
            raise TypeError(f"only slices are supported in a read index, got {item!r}")
    return tuple(out)


class StateDictSource(_NamedSource):
    """Weights from an in-memory `{checkpoint name: tensor}` dict (e.g. a reference model's state_dict),
    with the same checks as a checkpoint: benchmarks and tests share one set of weights this way."""

    def __init__(self, state_dict: dict[str, torch.Tensor], label: str = "state_dict", check_weights: bool = True):
        super().__init__(check_weights)
        self.state_dict, self.label = state_dict, label

    def names(self) -> set[str]:
        return set(self.state_dict)

    def has(self, name: str) -> bool:
        return name in self.state_dict

    def _tensor(self, name: str) -> torch.Tensor:
        return self.state_dict[name]
