"""Next-token choice for a whole batch in one call: greedy rows and sampled rows together, on the logits' device.

`choose(logits [B, V], sampling, penalties, generated) -> ids [B]` (int64, -1 where a row is not finite).
`SamplingParams(temperature, top_k, top_p, seed, ...)`: temperature 0 is the float32 argmax (first index on ties);
otherwise logits / temperature, cut to top_k (ties at the k-th kept) and top_p (the most likely token always stays),
and one token drawn by inverting the cumulative distribution at u = splitmix64(seed, stream, draw) on int64 tensors.
`stream` tells apart requests sharing a seed, `draw` counts the request's own tokens: a request's tokens depend only
on its logits and (seed, stream), not on the batch, the step it joined or the backend, and every rank draws alike.
Seeds take any value in [0, 2^64); `fresh_seed` gives an unseeded request one, the same on every rank.

Logits processors, applied to the float32 logits before all of the above (greedy rows too), in this order:
logit_bias; min_tokens (EOS ids -inf until reached); repetition_penalty r over prompt and generated tokens (logit / r
if positive else logit * r); frequency f and presence p over generated tokens (logit - f * count - p * (count > 0)).
`apply_penalties` is the batched form of reference/sampling.py's per-row rules, equal bit for bit.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

SEED_LIMIT = 1 << 64
MAX_LOGIT_BIAS = 300  # logit_bias entries of one request
MAX_BIAS = 100.0  # |bias| limit, as OpenAI's
MAX_STOP_IDS = 8  # stop ids a request with min_tokens may have (its EOS ids)
# repetition_penalty's range: a penalized logit x becomes x / r or x * r in float32, so r must stay a normal float32
# far from 0 and from its overflow (r ~ 1e-38 made x / r an inf and the draw NaN); within it, x / r / temperature
# stays finite for every |x| < 1e20 (temperature >= 1e-5 when sampling).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6
# top_k past every vocabulary is no limit: written to the device as 0 (an int64 row cannot hold any Python int)
TOP_K_NO_LIMIT_FROM = 1 << 31


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id; a dict is converted
    min_tokens: int = 0

    def __post_init__(self):
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not self.temperature >= 0
            or self.temperature == float("inf")
        ):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 is greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0: no limit)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT
        ):
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2^64) or None")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 <= v <= 2:
                raise ValueError(f"{name}={v!r} must be a number in [-2, 2] (0: off)")
        r = self.repetition_penalty
        if (
            isinstance(r, bool)
            or not isinstance(r, (int, float))
            or not MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY
        ):
            raise ValueError(
                f"repetition_penalty={r!r} must be a number in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}] (1: off)"
            )
        bias = self.logit_bias
        try:
            bias = tuple(sorted((t, b) for t, b in (bias.items() if isinstance(bias, dict) else bias)))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias={self.logit_bias!r} must map token ids to numbers") from None
        for t, b in bias:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias token id {t!r} must be an integer >= 0")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -MAX_BIAS <= b <= MAX_BIAS:
                raise ValueError(f"logit_bias[{t}]={b!r} must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token id twice")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
        object.__setattr__(self, "logit_bias", bias)
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"min_tokens={m!r} must be an integer >= 0")

    @property
    def device_top_k(self) -> int:
        """top_k as the device's int64 row: 0 (no limit) for any top_k no vocabulary reaches."""
        return 0 if self.top_k >= TOP_K_NO_LIMIT_FROM else self.top_k

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Any logits processor on (the engine keeps penalty state for the batch only while a row has one)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
        )


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
    return (x >> k) & ((1 << (64 - k)) - 1)  # logical: int64 >> is arithmetic


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

    temperature: torch.Tensor  # [B] float32, 0 for greedy rows
    top_k: torch.Tensor  # [B] int64, 0: no limit
    top_p: torch.Tensor  # [B] float32
    keys: torch.Tensor  # [B] int64 (seed_key)
    draws: torch.Tensor  # [B] int64, tokens the row's request has drawn so far


@dataclass
class BatchPenalties:
    """Per-row logits-processor state of a batch, on the device (executor/device_batch.py keeps it, only while a
    running row has a processor on; rows without one hold the neutral values, which change no logit)."""

    counts: torch.Tensor  # [B, V] int32: each token's count among the row's generated tokens
    prompt: torch.Tensor  # [B, V] bool: tokens of the row's prompt
    repetition: torch.Tensor  # [B] float32, 1: off
    frequency: torch.Tensor  # [B] float32
    presence: torch.Tensor  # [B] float32
    min_tokens: torch.Tensor  # [B] int64
    bias_ids: torch.Tensor  # [B, MAX_LOGIT_BIAS] int64 (padding: token 0 with bias 0)
    bias: torch.Tensor  # [B, MAX_LOGIT_BIAS] float32
    stop_ids: torch.Tensor  # [B, MAX_STOP_IDS] int64 (padding: token 0, not valid)
    stop_valid: torch.Tensor  # [B, MAX_STOP_IDS] bool


def apply_penalties(logits: torch.Tensor, p: BatchPenalties, generated: torch.Tensor) -> torch.Tensor:
    """[B, V] float32 logits -> the processed logits (module docstring, steps 1-4). generated: [B] int64, the
    tokens each row generated so far (the draw counters)."""
    x = logits.float().scatter_add(1, p.bias_ids, p.bias)  # 1. logit_bias
    active = p.stop_valid & (generated < p.min_tokens).unsqueeze(-1)
    x = x.scatter_add(1, p.stop_ids, torch.where(active, float("-inf"), 0.0))  # 2. min_tokens
    generated_once = p.counts > 0
    r = p.repetition.unsqueeze(-1)
    x = torch.where(p.prompt | generated_once, torch.where(x > 0, x / r, x * r), x)  # 3. repetition
    return x - (p.frequency.unsqueeze(-1) * p.counts.float() + p.presence.unsqueeze(-1) * generated_once.float())  # 4.


_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32


def sorted_filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] logits -> (probabilities [B, V] in descending-score order after temperature, top-k and top-p,
    and that order [B, V]). Rows with temperature 0 come out as if at temperature 1 (their choice is greedy)."""
    scores = logits.float() / torch.where(temperature > 0, temperature, 1.0).unsqueeze(-1)
    scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    vocab = scores.shape[-1]
    kth = scores.gather(-1, (top_k.clamp(1, vocab) - 1).unsqueeze(-1))  # [B, 1] the k-th largest
    limited = (top_k > 0).unsqueeze(-1) & (scores < kth)  # ties at the k-th stay
    probs = torch.softmax(scores.masked_fill(limited, float("-inf")), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the likelier tokens
    # The first token never drops (its `before` is exactly 0): a top_p too small for float32 (below ~1.4e-45, 0 on
    # the device) keeps it as any top_p below its probability does, instead of dropping every token.
    probs = probs.masked_fill(before >= top_p.clamp(min=_TINY).unsqueeze(-1), 0.0)
    return probs / probs.sum(-1, keepdim=True), order


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[B, V] logits -> [B, V] float32 probabilities (vocabulary order) that one set of params samples from."""
    rows, device = logits.shape[0], logits.device
    probs, order = sorted_filtered_probs(
        logits,
        torch.full((rows,), float(params.temperature), device=device),
        torch.full((rows,), params.device_top_k, device=device),
        torch.full((rows,), float(params.top_p), device=device),
    )
    return torch.zeros_like(probs).scatter(-1, order, probs)


def choose(
    logits: torch.Tensor,
    sampling: BatchSampling | None,
    penalties: BatchPenalties | None = None,
    generated: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chosen ids [B] (int64, on the logits' device), -1 where a row of logits is not finite.

    sampling None: every row greedy (no sampling work at all). Otherwise sampled rows draw with their own
    (key, draw) and greedy rows (temperature 0) take the argmax, in one batched computation. penalties (with
    `generated`, [B] tokens generated so far): the logits processors, applied first to every row."""
    scores = logits.float()
    # A row's sum is finite exactly when every logit is (NaN and +-inf propagate; a finite row would have to reach
    # |logit| ~ 1e33 to overflow it): one cheap reduction instead of an elementwise isfinite over [B, V].
    finite = torch.isfinite(scores.sum(-1))  # [B] (the model's logits)
    if penalties is not None:
        scores = apply_penalties(scores, penalties, generated)
    chosen = scores.argmax(-1)
    if sampling is not None:
        safe = scores.masked_fill(~finite.unsqueeze(-1), 0.0)  # a NaN row would poison the row's cumsum only
        probs, order = sorted_filtered_probs(safe, sampling.temperature, sampling.top_k, sampling.top_p)
        cdf = torch.cumsum(probs, dim=-1)
        u = uniforms(sampling.keys, sampling.draws).unsqueeze(-1) * cdf[:, -1:]
        index = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)
        drawn = order.gather(-1, index).squeeze(-1)
        chosen = torch.where(sampling.temperature > 0, drawn, chosen)
    return torch.where(finite, chosen, -1)
