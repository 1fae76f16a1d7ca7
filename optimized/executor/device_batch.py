"""The running batch as device tensors: each running request of this rank's DP group owns one row, in the order
the scheduler runs them, from when it is admitted until it finishes.

A row holds the request's block table, the position its next input token is written at, its last chosen id and
its sampling parameters. They are written once, when the request is admitted (`admit`: the one host-to-device
copy of a request's blocks and parameters; a request recomputed after a preemption is admitted again, its position
past its generated tokens and its draw counter at their count), and from then on change on the device only: a
decode step reads rows [0, n) as views, the chosen ids are written back in place, positions and draw counters step
by one. The blocks a running request takes when its next token starts a new block are written into its row when
taken (`grow`: one small copy for all the rows that took one in a step). A finished request's row is closed up by
shifting the later rows one place (device copies, order kept); a preempted one is always the last row. The last row
of the tensors is the dummy row: the null block at position 0, token 0, for a DP group with nothing to run in a
step.
"""
from __future__ import annotations

import torch

from optimized.executor.kv_cache import NULL_BLOCK, slot_mapping
from optimized.executor.sampling import BatchSampling, seed_key

PAD_KV_LEN = 2   # KV length of a dummy or padding row: never 1, which a graph compiler specializes (executor/graph.py)


class DeviceBatch:
    def __init__(self, capacity: int, width: int, device: torch.device):
        """capacity: the most rows (the DP group's share of batch_size); width: block-table columns
        (ceil(max_position_embeddings / block_size))."""
        rows = capacity + 1                                    # + the dummy row
        self.capacity, self.width, self.device, self.n = capacity, width, device, 0
        self.table = torch.full((rows, width), NULL_BLOCK, dtype=torch.int32, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.last_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.sampling = BatchSampling(torch.zeros(rows, device=device), torch.zeros(rows, dtype=torch.int64, device=device),
                                      torch.ones(rows, device=device), torch.zeros(rows, dtype=torch.int64, device=device),
                                      torch.zeros(rows, dtype=torch.int64, device=device))
        self._tensors = (self.table, self.positions, self.last_ids, *vars(self.sampling).values())

    @property
    def dummy(self) -> int:
        return self.capacity

    def admit(self, requests) -> tuple[int, int]:
        """Rows for newly admitted requests (blocks allocated): their table rows, positions and sampling rows,
        written in one copy per tensor. Returns the rows' span [start, end)."""
        start, end = self.n, self.n + len(requests)
        if end > self.capacity:
            raise RuntimeError(f"the device batch holds {self.capacity} rows; {end} asked")
        if len(requests):
            table = [r.blocks + [NULL_BLOCK] * (self.width - len(r.blocks)) for r in requests]
            self.table[start:end] = torch.tensor(table, dtype=torch.int32, device=self.device)
            self.positions[start:end] = torch.tensor([len(r.prefill_ids) for r in requests], device=self.device)
            s = self.sampling
            params = [r.sampling for r in requests]
            s.temperature[start:end] = torch.tensor([float(p.temperature) for p in params], device=self.device)
            s.top_k[start:end] = torch.tensor([p.top_k for p in params], device=self.device)
            s.top_p[start:end] = torch.tensor([float(p.top_p) for p in params], device=self.device)
            s.keys[start:end] = torch.tensor([seed_key(p.seed or 0, r.stream) for p, r in zip(params, requests)],
                                             device=self.device)
            if any(r.tokens for r in requests):      # recomputed: their draws go on from the tokens they have
                s.draws[start:end] = torch.tensor([len(r.tokens) for r in requests], device=self.device)
            else:
                s.draws[start:end] = 0
        self.n = end
        return start, end

    def grow(self, blocks: list[tuple[int, int, int]]) -> None:
        """(row, column, block) entries written into the block table: one host-to-device copy of the triples."""
        for row, column, _ in blocks:
            if not (0 <= row < self.n and 0 <= column < self.width):
                raise IndexError(f"table entry ({row}, {column}) is outside the running rows 0..{self.n - 1} or the "
                                 f"table's {self.width} columns")
        entries = torch.tensor(blocks, dtype=torch.int64, device=self.device)        # [k, 3]
        self.table[entries[:, 0], entries[:, 1]] = entries[:, 2].to(self.table.dtype)

    def remove(self, row: int) -> None:
        """Close up row `row`: later rows move one place up (device copies; the order is kept)."""
        if not 0 <= row < self.n:
            raise IndexError(f"row {row} is not a running row (0..{self.n - 1})")
        if row < self.n - 1:
            for t in self._tensors:
                t[row:self.n - 1] = t[row + 1:self.n].clone()
        self.n -= 1

    def sampling_rows(self, start: int, end: int) -> BatchSampling:
        s = self.sampling
        return BatchSampling(*(t[start:end] for t in vars(s).values()))

    def record(self, start: int, end: int, chosen: torch.Tensor, decoded: bool) -> None:
        """After a step: rows [start, end) chose `chosen` (-1: non-finite); a decode step also moved them one
        position on."""
        self.last_ids[start:end] = chosen.clamp(min=0)
        self.sampling.draws[start:end] += 1
        if decoded:
            self.positions[start:end] += 1

    def slots(self, start: int, end: int, block_size: int) -> torch.Tensor:
        """Each row's cache slot for its next token, from the device table and positions."""
        rows = torch.arange(end - start, device=self.device)
        return slot_mapping(self.table[start:end], rows, self.positions[start:end], block_size)
