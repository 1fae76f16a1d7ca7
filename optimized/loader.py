"""HF safetensors checkpoint -> this rank's shards, reading only the slices a rank owns.

`CheckpointReader` opens a single-file or index-sharded checkpoint with `safe_open` and hands out slices
through `get_slice`, so a rank never materializes a tensor it does not own. It counts the bytes it
reads (checked by a test: about 1/world of the sharded weights per rank) and remembers which tensors
were used, so unexpected leftovers are reported by name. `RandomWeights` stands in for a checkpoint of
the real shapes (benchmarks, latency runs) and never builds a full tensor either.
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: a missing, unexpected or mis-shaped tensor."""


class CheckpointReader:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if (self.path / INDEX_FILE).exists():
            weight_map = json.loads((self.path / INDEX_FILE).read_text())["weight_map"]
            self._file_of = {name: self.path / file for name, file in weight_map.items()}
        elif (self.path / SINGLE_FILE).exists():
            with safe_open(self.path / SINGLE_FILE, framework="pt") as f:
                self._file_of = {name: self.path / SINGLE_FILE for name in f.keys()}
        else:
            raise CheckpointError(f"{self.path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        self._handles: dict[Path, object] = {}
        self.used: set[str] = set()
        self.bytes_read = 0

    def names(self) -> set[str]:
        return set(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def _slice(self, name: str):
        if name not in self._file_of:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, expected_shape: tuple[int, ...], index: tuple = ()) -> torch.Tensor:
        """Read `name[index]` after checking the full tensor has `expected_shape`."""
        part = self._slice(name)
        shape = tuple(part.get_shape())
        if shape != tuple(expected_shape):
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {shape}; the model expects "
                                  f"{tuple(expected_shape)}")
        tensor = part[index] if index else part[:]
        self.used.add(name)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def skip(self, name: str) -> None:
        """`name` belongs to the model but another rank loads it: not unexpected here."""
        self.used.add(name)

    def check_all_used(self) -> None:
        _check_all_used(str(self.path), self.names(), self.used)


class RandomWeights:
    """A weight source of the real shapes with seeded random values: each rank draws only its slice.

    Values are N(0, std) per tensor, seeded by the tensor name and the slice, so runs are repeatable.
    Norm weights get 1.0 (as in a freshly initialized model) so activations stay in range.
    """

    def __init__(self, seed: int = 0, std: float = 0.02):
        self.seed, self.std = seed, std
        self.used: set[str] = set()
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        return True

    def read(self, name: str, expected_shape: tuple[int, ...], index: tuple = ()) -> torch.Tensor:
        shape = _sliced_shape(tuple(expected_shape), index)
        self.used.add(name)
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        # crc32, not hash(): str hashes change between processes, and every rank must draw the same values
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{name}:{index!r}".encode()))
        return torch.randn(shape, generator=generator) * self.std

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


class StateDictSource:
    """Weights from an in-memory `{checkpoint name: tensor}` dict (e.g. a reference model's state_dict),
    with the same checks as a checkpoint: benchmarks and tests share one set of weights this way."""

    def __init__(self, state_dict: dict[str, torch.Tensor], label: str = "state_dict"):
        self.state_dict, self.label = state_dict, label
        self.used: set[str] = set()
        self.bytes_read = 0

    def names(self) -> set[str]:
        return set(self.state_dict)

    def has(self, name: str) -> bool:
        return name in self.state_dict

    def read(self, name: str, expected_shape: tuple[int, ...], index: tuple = ()) -> torch.Tensor:
        if name not in self.state_dict:
            raise CheckpointError(f"{self.label}: missing tensor {name!r}")
        tensor = self.state_dict[name]
        if tuple(tensor.shape) != tuple(expected_shape):
            raise CheckpointError(f"{self.label}: tensor {name!r} has shape {tuple(tensor.shape)}; the model "
                                  f"expects {tuple(expected_shape)}")
        part = tensor[index] if index else tensor
        self.used.add(name)
        self.bytes_read += part.numel() * part.element_size()
        return part

    def skip(self, name: str) -> None:
        self.used.add(name)

    def check_all_used(self) -> None:
        _check_all_used(self.label, self.names(), self.used)


def _check_all_used(label: str, names: set[str], used: set[str]) -> None:
    unexpected = sorted(names - used)
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else "")
        raise CheckpointError(f"{label}: unexpected tensors the model does not use: {shown}")
