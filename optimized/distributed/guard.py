"""Fail fast in multi-rank runs: a collective timeout suited to inference, and a start-up check that every
rank holds the same config, model and prompts.

- `collective_timeout_s(configured)`: parallel_config.collective_timeout_s, overridden by
  QWEN3_MOE_COLLECTIVE_TIMEOUT_S, default 120 s (torch's 30 minutes are for training). `named_collective_errors`
  turns the backend's "timed out" into CollectiveTimeoutError naming the setting and the likely cause (a rank stopped
  or stuck); a rendezvous store that does not answer in time is StoreTimeoutError.
- `check_ranks_agree(fields)`: one all_gather of every rank's small {key: value} dict; RankMismatchError names the
  first key on which a rank differs from rank 0, with both values. `run_fingerprint(...)` builds that dict: the
  inference config, the checkpoint's config.json and weight files (digests), the prompts (digest), the options.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
from pathlib import Path

from optimized import envs
from optimized.config import DEFAULT_COLLECTIVE_TIMEOUT_S
from optimized.errors import UsageError

TIMEOUT_ENV = envs.COLLECTIVE_TIMEOUT_S
TIMEOUT_KEY = "parallel_config.collective_timeout_s"


class CollectiveTimeoutError(UsageError, RuntimeError):
    """A collective did not complete within the configured timeout (a peer rank stopped or is stuck)."""


class StoreTimeoutError(CollectiveTimeoutError):
    """The job's rendezvous store did not answer within the collective timeout (`init_distributed`)."""


class RankMismatchError(UsageError, RuntimeError):
    """The ranks of one job were started with different configs, models or prompts."""


def collective_timeout_s(configured: float | None = None) -> float:
    """The collective timeout in seconds: the environment variable, else `configured`, else the default."""
    value = envs.collective_timeout_s()  # an EnvError (a ValueError) unless a positive number
    if value is not None:
        return value
    return float(configured) if configured is not None else DEFAULT_COLLECTIVE_TIMEOUT_S


def collective_timeout(configured: float | None = None) -> datetime.timedelta:
    return datetime.timedelta(seconds=collective_timeout_s(configured))


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _is_peer_loss(e: BaseException) -> bool:
    text = str(e).lower()
    return any(s in text for s in ("connection closed by peer", "connection reset by peer", "broken pipe"))


@contextlib.contextmanager
def named_collective_errors(timeout_s: float):
    """Re-raise a backend's collective timeout / lost-peer error as one named, actionable error."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, (CollectiveTimeoutError, RankMismatchError)):
            raise
        if _is_timeout(e):
            raise CollectiveTimeoutError(
                f"a collective did not complete within {TIMEOUT_KEY}={timeout_s:g} s (environment override "
                f"{TIMEOUT_ENV}): another rank stopped, crashed or is stuck; check the other ranks' output, or "
                f"raise the timeout if a step legitimately takes longer ({first_line(e)})"
            ) from None
        if _is_peer_loss(e):
            raise CollectiveTimeoutError(
                f"a collective failed because another rank exited or lost its connection; "
                f"check the other ranks' output ({first_line(e)})"
            ) from None
        raise


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


# ---------------------------------------------------------------------------------------------- agreement


def digest(obj) -> str:
    data = obj if isinstance(obj, bytes) else json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _flatten(prefix: str, obj, out: dict) -> None:
    if isinstance(obj, dict):
        for k in sorted(obj):
            _flatten(f"{prefix}.{k}" if prefix else str(k), obj[k], out)
    else:
        out[prefix] = obj


def run_fingerprint(config_dict: dict, model_dir, prompts: list[list[int]], **options) -> dict:
    """What every rank of one generate run must agree on, as a flat {key: small value} dict."""
    fields: dict = {}
    _flatten("", config_dict, fields)
    model_dir = Path(model_dir)
    config_json = model_dir / "config.json"
    fields["model.config_json"] = digest(config_json.read_bytes()) if config_json.is_file() else None
    weights = sorted((p.name, p.stat().st_size) for p in model_dir.glob("*.safetensors"))
    fields["model.weight_files"] = f"{len(weights)} file(s), digest {digest(weights)}"
    fields["prompts"] = f"{len(prompts)} prompt(s) of {[len(p) for p in prompts][:8]} tokens, digest {digest(prompts)}"
    for key, value in sorted(options.items()):
        fields[f"options.{key}"] = value
    return fields


def check_ranks_agree(fields: dict, group=None) -> None:
    """One all_gather of every rank's `fields`; RankMismatchError naming the first disagreeing key."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, fields, group=group)
    base = gathered[0]
    for rank, other in enumerate(gathered[1:], start=1):
        for key in list(base) + [k for k in other if k not in base]:
            mine, theirs = base.get(key, "<absent>"), other.get(key, "<absent>")
            if mine != theirs:
                raise RankMismatchError(
                    f"rank {rank} was started with {key}={theirs!r} but rank 0 with {key}="
                    f"{mine!r}; start every rank with the same config, model and prompts"
                )
