"""The running batch as device tensors: each running request of this rank's DP group owns one row, in the order
the scheduler runs them, from when it is admitted until it finishes.

A row holds the request's block table, the position of its next input token, its last chosen id and its sampling
parameters. `admit` writes a request's row once (the one host-to-device copy of its blocks and parameters; a
recomputed request re-admitted with its position and draw counter past its generated tokens); from then on rows
change on the device only: a decode step reads rows [0, n) as views, `record` writes the chosen ids back and steps
positions and draw counters, `grow` writes the blocks taken in a step (one small copy), `remove_rows` closes up the
rows of the requests that left in a step at once, one gather per tensor (order kept; a preempted request is always a
last row, so preemption only shortens the batch). The last row of the tensors is the dummy row: the null block at
position 0, token 0.

Logits-processor state (`BatchPenalties`) exists only while a running row uses one, so a batch without processors
pays nothing; per row it costs V * 5 bytes plus the bias and stop tables (about 764 KB at Qwen3's V = 151936).
"""

from __future__ import annotations

import torch

from optimized.executor.kv_cache import NULL_BLOCK
from optimized.executor.sampling import MAX_LOGIT_BIAS, MAX_STOP_IDS, BatchPenalties, BatchSampling, seed_key

PAD_KV_LEN = 2  # KV length of a dummy or padding row: never 1, which a graph compiler specializes (executor/graph.py)


class DeviceBatch:
    def __init__(self, capacity: int, width: int, device: torch.device, vocab_size: int = 0):
        """capacity: the most rows (the DP group's share of batch_size); width: block-table columns
        (ceil(max_position_embeddings / block_size)); vocab_size: the penalty state's width."""
        rows = capacity + 1  # + the dummy row
        self.capacity, self.width, self.device, self.n = capacity, width, device, 0
        self.vocab_size = vocab_size
        self.penalties: BatchPenalties | None = None
        self.penalized: list[bool] = []  # host: which running rows have a processor on
        self.table = torch.full((rows, width), NULL_BLOCK, dtype=torch.int32, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.last_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.sampling = BatchSampling(
            torch.zeros(rows, device=device),
            torch.zeros(rows, dtype=torch.int64, device=device),
            torch.ones(rows, device=device),
            torch.zeros(rows, dtype=torch.int64, device=device),
            torch.zeros(rows, dtype=torch.int64, device=device),
        )
        self._tensors = (self.table, self.positions, self.last_ids, *vars(self.sampling).values())
        self._rows = torch.arange(rows, device=device)  # row indices: `remove_rows` gathers by views of it

    @property
    def dummy(self) -> int:
        return self.capacity

    def _new_penalties(self) -> BatchPenalties:
        rows, v, d = self.capacity + 1, self.vocab_size, self.device
        return BatchPenalties(
            torch.zeros(rows, v, dtype=torch.int32, device=d),
            torch.zeros(rows, v, dtype=torch.bool, device=d),
            torch.ones(rows, device=d),
            torch.zeros(rows, device=d),
            torch.zeros(rows, device=d),
            torch.zeros(rows, dtype=torch.int64, device=d),
            torch.zeros(rows, MAX_LOGIT_BIAS, dtype=torch.int64, device=d),
            torch.zeros(rows, MAX_LOGIT_BIAS, device=d),
            torch.zeros(rows, MAX_STOP_IDS, dtype=torch.int64, device=d),
            torch.zeros(rows, MAX_STOP_IDS, dtype=torch.bool, device=d),
        )

    def _tensor_list(self):
        return self._tensors + (tuple(vars(self.penalties).values()) if self.penalties is not None else ())

    def _admit_penalties(self, requests, start: int, end: int) -> None:
        """The processor rows of newly admitted requests: neutral for those without; for the others their
        parameters, prompt mask and generated-token counts (one copy per tensor, of the penalized rows only)."""
        flags = [r.sampling.penalized for r in requests]
        self.penalized[start:end] = flags
        if self.penalties is None and not any(flags):
            return
        if self.penalties is None:
            self.penalties = self._new_penalties()
        p = self.penalties
        p.counts[start:end] = 0
        p.prompt[start:end] = False
        p.repetition[start:end] = 1.0
        p.frequency[start:end] = 0.0
        p.presence[start:end] = 0.0
        p.min_tokens[start:end] = 0
        p.bias_ids[start:end] = 0
        p.bias[start:end] = 0.0
        p.stop_ids[start:end] = 0
        p.stop_valid[start:end] = False
        rows = [(start + i, r) for i, r in enumerate(requests) if r.sampling.penalized]
        if not rows:
            return
        d = self.device
        at = torch.tensor([i for i, _ in rows], device=d)
        params = [r.sampling for _, r in rows]
        p.repetition[at] = torch.tensor([float(q.repetition_penalty) for q in params], device=d)
        p.frequency[at] = torch.tensor([float(q.frequency_penalty) for q in params], device=d)
        p.presence[at] = torch.tensor([float(q.presence_penalty) for q in params], device=d)
        p.min_tokens[at] = torch.tensor([q.min_tokens for q in params], device=d)
        bias_ids = [[t for t, _ in q.logit_bias] + [0] * (MAX_LOGIT_BIAS - len(q.logit_bias)) for q in params]
        bias = [[float(b) for _, b in q.logit_bias] + [0.0] * (MAX_LOGIT_BIAS - len(q.logit_bias)) for q in params]
        p.bias_ids[at] = torch.tensor(bias_ids, device=d)
        p.bias[at] = torch.tensor(bias, device=d)
        stops = [sorted(r.stop_ids) if r.sampling.min_tokens else [] for _, r in rows]
        p.stop_ids[at] = torch.tensor([s + [0] * (MAX_STOP_IDS - len(s)) for s in stops], device=d)
        p.stop_valid[at] = torch.tensor([[True] * len(s) + [False] * (MAX_STOP_IDS - len(s)) for s in stops], device=d)
        # the prompt mask and the counts of tokens already generated (a recompute), as (row, token) pairs
        prompt = [(i, t) for i, r in rows for t in r.prompt]
        pairs = torch.tensor(prompt + [(i, t) for i, r in rows for t in r.tokens], device=d)  # [k, 2]
        p.prompt[pairs[: len(prompt), 0], pairs[: len(prompt), 1]] = True
        if len(pairs) > len(prompt):
            gen = pairs[len(prompt) :]
            p.counts.index_put_((gen[:, 0], gen[:, 1]), torch.ones_like(gen[:, 0], dtype=torch.int32), accumulate=True)

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
            s.top_k[start:end] = torch.tensor([p.device_top_k for p in params], device=self.device)
            s.top_p[start:end] = torch.tensor([float(p.top_p) for p in params], device=self.device)
            s.keys[start:end] = torch.tensor(
                [seed_key(p.seed or 0, r.stream) for p, r in zip(params, requests)], device=self.device
            )
            if any(r.tokens for r in requests):  # recomputed: their draws go on from the tokens they have
                s.draws[start:end] = torch.tensor([len(r.tokens) for r in requests], device=self.device)
            else:
                s.draws[start:end] = 0
            self._admit_penalties(requests, start, end)
        self.n = end
        return start, end

    def admit_decoding(self, requests) -> tuple[int, int]:
        """Rows for requests whose prompt KV another engine computed and whose first token it chose (tokens ==
        [first]): as a recompute's rows (draw counter 1, penalty counts of that token), but starting at decode: the
        first token is the next input, at the position after the prompt."""
        start, end = self.admit(requests)
        if end > start:
            self.positions[start:end] -= 1
            self.last_ids[start:end] = torch.tensor([r.tokens[-1] for r in requests], device=self.device)
        return start, end

    def grow(self, blocks: list[tuple[int, int, int]]) -> None:
        """(row, column, block) entries written into the block table: one host-to-device copy of the triples."""
        for row, column, _ in blocks:
            if not (0 <= row < self.n and 0 <= column < self.width):
                raise IndexError(
                    f"table entry ({row}, {column}) is outside the running rows 0..{self.n - 1} or the "
                    f"table's {self.width} columns"
                )
        entries = torch.tensor(blocks, dtype=torch.int64, device=self.device)  # [k, 3]
        self.table[entries[:, 0], entries[:, 1]] = entries[:, 2].to(self.table.dtype)

    def remove(self, row: int) -> None:
        """Close up row `row` (one finished request outside a step: an abort)."""
        self.remove_rows([row])

    def remove_rows(self, rows) -> None:
        """Close up the rows `rows` (the requests that left in one step; any order) at once: the rows after the
        first of them keep their order and move up by one gather per tensor (index rows built on the device from
        views of one arange: no host copy); rows at the end only shorten the batch (a preemption: no copy)."""
        gone = sorted(set(rows))
        if len(gone) != len(rows) or (gone and not (0 <= gone[0] and gone[-1] < self.n)):
            raise IndexError(f"rows {list(rows)} are not distinct running rows (0..{self.n - 1})")
        if not gone:
            return
        first, kept = gone[0], self.n - len(gone)
        if kept > first:  # a row after a removed one stays: gather rows first.. of those kept
            runs, at = [], first
            for r in (*gone, self.n):
                if r > at:
                    runs.append(self._rows[at:r])
                at = r + 1
            index = runs[0] if len(runs) == 1 else torch.cat(runs)
            for t in self._tensor_list():
                t[first:kept] = t.index_select(0, index)
        for r in reversed(gone):
            del self.penalized[r]
        self.n = kept
        if self.penalties is not None and not any(self.penalized):
            self.penalties = None  # no running row has a processor on: free the state

    def sampling_rows(self, start: int, end: int) -> BatchSampling:
        s = self.sampling
        return BatchSampling(*(t[start:end] for t in vars(s).values()))

    def penalty_rows(self, start: int, end: int) -> BatchPenalties | None:
        """Rows [start, end) of the processor state; None when none of them has a processor on."""
        if self.penalties is None or not any(self.penalized[start:end]):
            return None
        return BatchPenalties(*(t[start:end] for t in vars(self.penalties).values()))

    def record(self, start: int, end: int, chosen: torch.Tensor, decoded: bool) -> None:
        """After a step: rows [start, end) chose `chosen` (-1: non-finite); a decode step also moved them one
        position on."""
        self.last_ids[start:end] = chosen.clamp(min=0)
        if self.penalties is not None:  # the generated-token counts (a row that chose -1 finishes: no count)
            ones = (chosen >= 0).to(torch.int32).unsqueeze(-1)
            self.penalties.counts[start:end].scatter_add_(1, chosen.clamp(min=0).unsqueeze(-1), ones)
        self.sampling.draws[start:end] += 1
        if decoded:
            self.positions[start:end] += 1
