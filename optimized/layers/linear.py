"""Tensor-parallel linear layers (vLLM-style names), each loading only its shard of a checkpoint tensor.

Weights keep the checkpoint's `[out_features, in_features]` orientation. `tp` is any object with
`group`, `size` and `rank` (a `comm.GroupInfo`); size 1 means no communication. Each layer owns a quant
method (optimized/layers/quantization/: unquantized by default; the model's `QuantConfig` picks one per layer) that
creates its parameters, loads its slices and applies the matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from optimized.distributed import collectives as comm
from optimized.layers.quantization.unquantized import UnquantizedLinearMethod


def _split(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by the parallel size {parts}")
    return total // parts


class ReplicatedLinear(nn.Module):
    """Every rank holds the whole weight (the MoE router gate, float32 there; the SP prefill's o_proj)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, quant_method=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, out_features, in_features, dtype)

    def load(self, source, name: str) -> None:
        self.quant_method.load(self, source, name, (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


class ColumnParallelLinear(nn.Module):
    """Output features split across `tp`; rank r holds rows [r*out/tp, (r+1)*out/tp)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp,
        dtype: torch.dtype,
        gather_output: bool = False,
        quant_method=None,
    ):
        super().__init__()
        self.tp, self.gather_output = tp, gather_output
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = _split(out_features, tp.size, "out_features")
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, self.out_per_rank, in_features, dtype)

    def load(self, source, name: str) -> None:
        start = self.tp.rank * self.out_per_rank
        rows = slice(start, start + self.out_per_rank)
        self.quant_method.load(self, source, name, (self.out_features, self.in_features), (rows,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        return comm.all_gather(y, self.tp.group, dim=-1) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Input features split across `tp`; partial products are summed with all_reduce over `tp`.

    reduce_results=False: the layer returns this rank's partial product, for a caller that sums it its own way
    (attention DP reduce-scatters o_proj's partial sums back to each rank's rows, optimized/phases.py)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp,
        dtype: torch.dtype,
        quant_method=None,
        reduce_results: bool = True,
    ):
        super().__init__()
        self.tp, self.reduce_results = tp, reduce_results
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = _split(in_features, tp.size, "in_features")
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, out_features, self.in_per_rank, dtype)

    def load(self, source, name: str) -> None:
        start = self.tp.rank * self.in_per_rank
        cols = slice(start, start + self.in_per_rank)
        self.quant_method.load(self, source, name, (self.out_features, self.in_features), (slice(None), cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        return comm.all_reduce(y, self.tp.group) if self.reduce_results else y


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel weights of equal input size stacked into one matmul (dense gate|up)."""

    def __init__(self, in_features: int, out_features: list[int], tp, dtype: torch.dtype, quant_method=None):
        super().__init__()
        self.tp, self.in_features, self.out_features = tp, in_features, list(out_features)
        self.out_per_rank = [_split(n, tp.size, "out_features") for n in out_features]
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, sum(self.out_per_rank), in_features, dtype)

    def load(self, source, names: list[str]) -> None:
        offset = 0
        for name, total, per_rank in zip(names, self.out_features, self.out_per_rank):
            rows = slice(self.tp.rank * per_rank, (self.tp.rank + 1) * per_rank)
            self.quant_method.load(
                self, source, name, (total, self.in_features), (rows,), slice(offset, offset + per_rank)
            )
            offset += per_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads a rank holds: an even split, or 1 (replicated) when there are fewer KV heads than ranks."""
    if num_kv_heads >= tp_size:
        return _split(num_kv_heads, tp_size, "num_key_value_heads")
    if tp_size % num_kv_heads:
        raise ValueError(
            f"attention TP size {tp_size} is not a multiple of num_key_value_heads={num_kv_heads}; "
            "KV heads cannot be replicated evenly"
        )
    return 1


def first_kv_head(num_kv_heads: int, tp_size: int, tp_rank: int) -> int:
    """Global index of the first KV head on `tp_rank`: the one its query heads use when KV is replicated."""
    if num_kv_heads >= tp_size:
        return tp_rank * (num_kv_heads // tp_size)
    return tp_rank * num_kv_heads // tp_size


class QKVParallelLinear(nn.Module):
    """q, k and v projections merged into one matmul, split by heads across attention TP.

    Rank r holds query heads [r*Nq/tp, (r+1)*Nq/tp) and KV heads per `kv_heads_per_rank`; with fewer
    KV heads than ranks each rank holds the one KV head its query heads use (so KV is replicated).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        tp,
        dtype: torch.dtype,
        quant_method=None,
    ):
        super().__init__()
        self.tp, self.hidden_size, self.head_dim = tp, hidden_size, head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.q_heads = _split(num_heads, tp.size, "num_attention_heads")
        self.kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        rows = (self.q_heads + 2 * self.kv_heads) * head_dim
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, rows, hidden_size, dtype)

    @property
    def output_sizes(self) -> list[int]:
        return [self.q_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]

    def load(self, source, q_name: str, k_name: str, v_name: str) -> None:
        d = self.head_dim
        q0 = self.tp.rank * self.q_heads * d
        kv0 = first_kv_head(self.num_kv_heads, self.tp.size, self.tp.rank) * d
        q_rows, kv_rows = slice(q0, q0 + self.q_heads * d), slice(kv0, kv0 + self.kv_heads * d)
        q_size, kv_size = self.output_sizes[:2]
        load = self.quant_method.load
        load(self, source, q_name, (self.num_heads * d, self.hidden_size), (q_rows,), slice(0, q_size))
        load(
            self, source, k_name, (self.num_kv_heads * d, self.hidden_size), (kv_rows,), slice(q_size, q_size + kv_size)
        )
        load(self, source, v_name, (self.num_kv_heads * d, self.hidden_size), (kv_rows,), slice(q_size + kv_size, None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)
