"""The PD router's view of its instances: their URLs, what each says about itself (`GET /pd/v1/info`), the start-up
compatibility checks, and the choice of an instance for the next request (the fewest requests in flight, ties in
turn).

An instance's info: {"role": "prefill" | "decode", "max_model_len", "block_size", "kv_cache_dtype",
"attention": {"tp", "dp"}, "served_model_name"}. Every instance must serve the same model with the same KV block
size and KV cache dtype (the transfer copies blocks byte for byte); attention TP and DP may differ between the two
sides (optimized/pd/rank_mapping.py).
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from dataclasses import dataclass, field

from optimized.errors import UsageError

ROLES = ("prefill", "decode")
INFO_ROUTE = "/pd/v1/info"
RELEASE_ROUTE = "/pd/v1/release"
SAME_ON_ALL = ("served_model_name", "block_size", "kv_cache_dtype")  # what every instance must agree on


class InstanceDown(Exception):
    """An instance could not be reached (refused, reset, timed out): the router answers 503 naming it."""

    def __init__(self, instance: "Instance", why: str):
        super().__init__(f"{instance.role} instance {instance.url} is down: {why}")
        self.instance = instance


def normalize_url(url: str, flag: str) -> str:
    """`http://host:port` from `host:port`, `http://host:port/` or `http://host:port/v1`; a UsageError naming the
    flag otherwise."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    parsed = urllib.parse.urlsplit(text)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "http" or not parsed.hostname or port is None or parsed.path.rstrip("/") not in ("", "/v1"):
        raise UsageError(f"{flag} {url!r}: expected an instance's address like http://HOST:PORT")
    host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
    return f"http://{host}:{port}"


@dataclass
class Instance:
    url: str
    role: str
    info: dict = field(default_factory=dict)
    up: bool = True
    outstanding: int = 0

    @property
    def address(self) -> tuple[str, int]:
        parsed = urllib.parse.urlsplit(self.url)
        return parsed.hostname, parsed.port

    def connection(self, timeout: float | None) -> http.client.HTTPConnection:
        host, port = self.address
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def get_json(self, route: str, timeout: float) -> tuple[int, dict]:
        """(status, parsed body) of GET `route`; InstanceDown when unreachable or not answering JSON."""
        conn = self.connection(timeout)
        try:
            conn.request("GET", route)
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as e:
            raise InstanceDown(self, f"GET {route}: {type(e).__name__}: {e}") from None
        finally:
            conn.close()
        try:
            return response.status, json.loads(raw)
        except ValueError:
            raise InstanceDown(self, f"GET {route} answered HTTP {response.status} without JSON") from None

    def post_json(self, route: str, body: dict, timeout: float) -> tuple[int, bytes]:
        conn = self.connection(timeout)
        try:
            conn.request("POST", route, json.dumps(body).encode(), {"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException) as e:
            raise InstanceDown(self, f"POST {route}: {type(e).__name__}: {e}") from None
        finally:
            conn.close()

    def health(self, timeout: float) -> str | None:
        """None when the instance answers /health with 200, else why not."""
        try:
            status, body = self.get_json("/health", timeout)
        except InstanceDown as e:
            self.up = False
            return str(e)
        self.up = status == 200
        if self.up:
            return None
        detail = body.get("error") if isinstance(body, dict) else None
        return f"{self.role} instance {self.url} is unhealthy: HTTP {status}" + (f" ({detail})" if detail else "")


def read_info(instance: Instance, timeout: float) -> dict:
    """The instance's /pd/v1/info, checked for its role and fields; a UsageError naming the instance otherwise."""
    flag = f"--{instance.role} {instance.url}"
    try:
        status, info = instance.get_json(INFO_ROUTE, timeout)
    except InstanceDown as e:
        raise UsageError(f"{flag}: cannot read {INFO_ROUTE}: {e}") from None
    if status != 200 or not isinstance(info, dict):
        raise UsageError(
            f"{flag}: {INFO_ROUTE} answered HTTP {status}; is it an instance started with `serve --pd-role`?"
        )
    missing = [k for k in ("role", "max_model_len", *SAME_ON_ALL) if k not in info]
    if missing:
        raise UsageError(f"{flag}: {INFO_ROUTE} lacks {', '.join(missing)}")
    if info["role"] != instance.role:
        raise UsageError(
            f"{flag}: the instance's role is {info['role']!r}, not {instance.role!r} (give it with --{info['role']})"
        )
    return info


def check_compatible(instances: list[Instance]) -> None:
    """Every instance agrees on the served model, the KV block size and the KV cache dtype, and of every prefill and
    decode pair one attention TP size divides the other (the rank mapping's rule): a UsageError naming the first
    instance that differs."""
    first = instances[0]
    for other in instances[1:]:
        for key in SAME_ON_ALL:
            if other.info[key] != first.info[key]:
                raise UsageError(
                    f"--{other.role} {other.url}: {key} is {other.info[key]!r} but --{first.role} {first.url} has "
                    f"{first.info[key]!r}; every instance must have the same {key}"
                )
    for decode in (i for i in instances if i.role == "decode"):
        for prefill in (i for i in instances if i.role == "prefill"):
            p_tp, d_tp = _attention_tp(prefill), _attention_tp(decode)
            if max(p_tp, d_tp) % min(p_tp, d_tp):
                raise UsageError(
                    f"--decode {decode.url}: attention TP {d_tp} and --prefill {prefill.url}'s attention TP {p_tp}: "
                    "one must divide the other for the KV transfer's rank mapping (docs/serving.md)"
                )


def _attention_tp(instance: Instance) -> int:
    tp = (instance.info.get("attention") or {}).get("tp", 1)
    if not isinstance(tp, int) or tp < 1:
        raise UsageError(f"--{instance.role} {instance.url}: {INFO_ROUTE} gives attention tp {tp!r}")
    return tp


class Pool:
    """The instances of both roles and the choice among them (thread-safe)."""

    def __init__(self, prefill: list[str], decode: list[str]):
        if not prefill or not decode:
            raise UsageError("the router needs at least one --prefill and one --decode instance")
        self.instances = [Instance(normalize_url(u, "--prefill"), "prefill") for u in prefill]
        self.instances += [Instance(normalize_url(u, "--decode"), "decode") for u in decode]
        seen = set()
        for inst in self.instances:
            if inst.url in seen:
                raise UsageError(f"--{inst.role} {inst.url}: given twice")
            seen.add(inst.url)
        self.lock = threading.Lock()
        self.turns = {role: 0 for role in ROLES}

    def connect(self, timeout: float) -> None:
        for inst in self.instances:
            inst.info = read_info(inst, timeout)
        check_compatible(self.instances)

    def of(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.role == role]

    @property
    def model_name(self) -> str:
        return self.instances[0].info.get("served_model_name", "")

    def max_model_len(self, role: str) -> int:
        return min(int(i.info["max_model_len"]) for i in self.of(role))

    def acquire(self, role: str) -> Instance:
        """The instance of `role` with the fewest requests in flight (ties in turn), counted until `release`."""
        with self.lock:
            candidates = self.of(role)
            turn = self.turns[role] = (self.turns[role] + 1) % len(candidates)
            order = candidates[turn:] + candidates[:turn]
            chosen = min(order, key=lambda i: (not i.up, i.outstanding))
            chosen.outstanding += 1
            return chosen

    def release(self, instance: Instance) -> None:
        with self.lock:
            instance.outstanding -= 1
