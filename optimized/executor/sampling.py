"""Next-token choice for a whole batch in one call: greedy rows and sampled rows together, on the logits' device.

`SamplingParams(temperature, top_k, top_p, seed)`: temperature 0 is greedy (argmax over float32, first index on
ties). Otherwise the logits are divided by the temperature in float32, restricted to the top_k largest (0: no
limit; ties at the k-th value are kept) and to the smallest set of most likely tokens whose probability reaches
top_p (the most likely token always stays), and one token is drawn from what is left by inverting its
cumulative distribution at a uniform number u.

u is counter-based, not drawn from a generator object: u = hash(seed, stream, draw) with splitmix64 on int64
tensors, where `stream` tells apart the requests sharing a seed (a batch's request index) and `draw` counts the
request's own generated tokens. So a request's tokens depend only on its logits and (seed, stream): not on the
batch around it, on the step it was admitted at, or on the backend (integer arithmetic is exact everywhere), and
every rank of a sharded run draws the same token. Seeds take any value in [0, 2^64) (an OpenAI client's 63-bit
seed included); unseeded requests get a random one (`fresh_seed`), the same on every rank.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

SEED_LIMIT = 1 << 64


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 is greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0: no limit)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2^64) or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def fresh_seed() -> int:
    """A random seed from the OS (not torch's default generator, which every process starts the same)."""
    return secrets.randbits(63)


# ---- the counter-based uniform numbers: splitmix64 on int64 tensors (wrapping arithmetic, logical shifts)
def _signed(v: int) -> int:
    v %= SEED_LIMIT
    return v - SEED_LIMIT if v >= 1 << 63 else v


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)        # logical: int64 >> is arithmetic


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _M1
    x = (x ^ _shift_right(x, 27)) * _M2
    return x ^ _shift_right(x, 31)


def seed_key(seed: int, stream: int = 0) -> int:
    """The int64 key of (seed, stream) that `uniforms` hashes with the draw counter (host ints, once per request)."""
    x = torch.tensor([_signed(seed)], dtype=torch.int64)
    return int(_mix(_mix(x) + _signed(stream)))


def uniforms(keys: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """[B] float32 in [0, 1) from int64 keys [B] and draw counters [B] (24 random bits: a float32 mantissa)."""
    return _shift_right(_mix(keys + draws), 40).float() * (1.0 / (1 << 24))


# ---- the batched choice
@dataclass
class BatchSampling:
    """Per-row sampling parameters of a batch, as device tensors (written when a request joins a batch row)."""
    temperature: torch.Tensor     # [B] float32, 0 for greedy rows
    top_k: torch.Tensor           # [B] int64, 0: no limit
    top_p: torch.Tensor           # [B] float32
    keys: torch.Tensor            # [B] int64 (seed_key)
    draws: torch.Tensor           # [B] int64, tokens the row's request has drawn so far


def sorted_filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                          top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] logits -> (probabilities [B, V] in descending-score order after temperature, top-k and top-p,
    and that order [B, V]). Rows with temperature 0 come out as if at temperature 1 (their choice is greedy)."""
    scores = logits.float() / torch.where(temperature > 0, temperature, 1.0).unsqueeze(-1)
    scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    vocab = scores.shape[-1]
    kth = scores.gather(-1, (top_k.clamp(1, vocab) - 1).unsqueeze(-1))            # [B, 1] the k-th largest
    limited = (top_k > 0).unsqueeze(-1) & (scores < kth)                            # ties at the k-th stay
    probs = torch.softmax(scores.masked_fill(limited, float("-inf")), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs                                    # mass of the likelier tokens
    probs = probs.masked_fill(before >= top_p.unsqueeze(-1), 0.0)                   # the first token never drops
    return probs / probs.sum(-1, keepdim=True), order


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[B, V] logits -> [B, V] float32 probabilities (vocabulary order) that one set of params samples from."""
    rows, device = logits.shape[0], logits.device
    probs, order = sorted_filtered_probs(logits, torch.full((rows,), float(params.temperature), device=device),
                                         torch.full((rows,), params.top_k, device=device),
                                         torch.full((rows,), float(params.top_p), device=device))
    return torch.zeros_like(probs).scatter(-1, order, probs)


def choose(logits: torch.Tensor, sampling: BatchSampling | None) -> torch.Tensor:
    """Chosen ids [B] (int64, on the logits' device), -1 where a row of logits is not finite.

    sampling None: every row greedy (no sampling work at all). Otherwise sampled rows draw with their own
    (key, draw) and greedy rows (temperature 0) take the argmax, in one batched computation."""
    scores = logits.float()
    # A row's sum is finite exactly when every logit is (NaN and +-inf propagate; a finite row would have to reach
    # |logit| ~ 1e33 to overflow it): one cheap reduction instead of an elementwise isfinite over [B, V].
    finite = torch.isfinite(scores.sum(-1))                                          # [B]
    chosen = scores.argmax(-1)
    if sampling is not None:
        safe = logits.masked_fill(~finite.unsqueeze(-1), 0.0)     # a NaN row would poison the row's cumsum only
        probs, order = sorted_filtered_probs(safe, sampling.temperature, sampling.top_k, sampling.top_p)
        cdf = torch.cumsum(probs, dim=-1)
        u = uniforms(sampling.keys, sampling.draws).unsqueeze(-1) * cdf[:, -1:]
        index = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)
        drawn = order.gather(-1, index).squeeze(-1)
        chosen = torch.where(sampling.temperature > 0, drawn, chosen)
    return torch.where(finite, chosen, -1)
