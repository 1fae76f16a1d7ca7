"""The PD router's Prometheus metrics, in the text exposition format: requests by route, errors by cause, KV
hand-offs (a prefill's transfer taken over by a decode instance that answered 200), releases (a prefill's held
blocks given back because the request ended before decode took them), and per instance an up gauge and the
requests in flight."""

from __future__ import annotations

import threading

PREFIX = "qwen3_moe_pd_router"

# Why a request failed: the `cause` label of the errors counter.
CAUSES = {
    "bad_request": "the request was refused by the router itself (not one prompt and one choice, bad JSON)",
    "too_long": "the prompt and max_tokens do not fit an instance's max_model_len",
    "prefill_down": "a prefill instance could not be reached",
    "decode_down": "a decode instance could not be reached",
    "prefill_rejected": "a prefill instance answered an error status",
    "decode_rejected": "a decode instance answered an error status",
    "bad_handoff": "a prefill instance answered without kv_transfer_params",
    "client_gone": "the client went away before the response was complete",
    "stream_broken": "the decode instance's stream ended early",
}


class RouterMetrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.handoffs = self.releases = 0

    def count_request(self, route: str) -> None:
        with self.lock:
            self.requests[route] = self.requests.get(route, 0) + 1

    def count_error(self, cause: str) -> None:
        assert cause in CAUSES, cause
        with self.lock:
            self.errors[cause] = self.errors.get(cause, 0) + 1

    def count_handoff(self) -> None:
        with self.lock:
            self.handoffs += 1

    def count_release(self) -> None:
        with self.lock:
            self.releases += 1

    def render(self, instances) -> str:
        name = PREFIX
        with self.lock:
            rows = [
                f"# HELP {name}_requests_total Generation requests received, by route.",
                f"# TYPE {name}_requests_total counter",
                *(f'{name}_requests_total{{route="{k}"}} {v}' for k, v in sorted(self.requests.items())),
                f"# HELP {name}_errors_total Requests that failed, by cause: "
                + "; ".join(f"{k}: {v}" for k, v in CAUSES.items())
                + ".",
                f"# TYPE {name}_errors_total counter",
                *(f'{name}_errors_total{{cause="{k}"}} {v}' for k, v in sorted(self.errors.items())),
                f"# HELP {name}_handoffs_total Prefilled requests whose KV a decode instance took over.",
                f"# TYPE {name}_handoffs_total counter",
                f"{name}_handoffs_total {self.handoffs}",
                f"# HELP {name}_releases_total Prefilled requests whose held KV blocks the router released.",
                f"# TYPE {name}_releases_total counter",
                f"{name}_releases_total {self.releases}",
            ]
        rows += [
            f"# HELP {name}_instance_up 1 when the instance answered its last health check or request, else 0.",
            f"# TYPE {name}_instance_up gauge",
            *(f'{name}_instance_up{{role="{i.role}",url="{i.url}"}} {int(i.up)}' for i in instances),
            f"# HELP {name}_instance_outstanding Requests the router has in flight at the instance.",
            f"# TYPE {name}_instance_outstanding gauge",
            *(f'{name}_instance_outstanding{{role="{i.role}",url="{i.url}"}} {i.outstanding}' for i in instances),
        ]
        return "\n".join(rows) + "\n"
