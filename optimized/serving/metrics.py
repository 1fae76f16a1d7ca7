"""Prometheus metrics of the server, in the text exposition format (no client library needed)."""

from __future__ import annotations

import threading

# Histogram buckets in seconds: TTFT spans queueing + prefill, TPOT one decode step.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = tuple(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{edge}"}} {n}' for edge, n in zip(self.buckets, self.counts)]
        return out + [
            f'{name}_bucket{{le="+Inf"}} {self.count}',
            f"{name}_sum {self.sum}",
            f"{name}_count {self.count}",
        ]


class Metrics:
    """Updated by the engine thread, read by /metrics: one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft, self.tpot = Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS)
        self.finished: dict[str, int] = {}
        self.prompt_tokens = self.generation_tokens = 0
        self.preemptions = 0
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up in the prefix cache / found there
        self.waiting = self.running = 0
        self.kv_usage = 0.0
        self.eplb = None  # the engine's EplbController (parallel_config.enable_eplb): its lines are appended

    def set_gauges(self, waiting: int, running: int, kv_usage: float) -> None:
        with self.lock:
            self.waiting, self.running, self.kv_usage = waiting, running, kv_usage

    def count_finished(self, reason: str) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def render(self) -> str:
        with self.lock:
            rows = [
                "# HELP qwen3_moe_time_to_first_token_seconds Arrival to first generated token.",
                "# TYPE qwen3_moe_time_to_first_token_seconds histogram",
                *self.ttft.lines("qwen3_moe_time_to_first_token_seconds"),
                "# HELP qwen3_moe_time_per_output_token_seconds Mean time per generated token after the first.",
                "# TYPE qwen3_moe_time_per_output_token_seconds histogram",
                *self.tpot.lines("qwen3_moe_time_per_output_token_seconds"),
                "# HELP qwen3_moe_requests_waiting Requests queued for admission.",
                "# TYPE qwen3_moe_requests_waiting gauge",
                f"qwen3_moe_requests_waiting {self.waiting}",
                "# HELP qwen3_moe_requests_running Requests in the running batch.",
                "# TYPE qwen3_moe_requests_running gauge",
                f"qwen3_moe_requests_running {self.running}",
                "# HELP qwen3_moe_kv_cache_usage_ratio Share of the paged KV pool's blocks held by requests.",
                "# TYPE qwen3_moe_kv_cache_usage_ratio gauge",
                f"qwen3_moe_kv_cache_usage_ratio {self.kv_usage}",
                "# HELP qwen3_moe_prompt_tokens_total Prompt tokens prefilled.",
                "# TYPE qwen3_moe_prompt_tokens_total counter",
                f"qwen3_moe_prompt_tokens_total {self.prompt_tokens}",
                "# HELP qwen3_moe_generation_tokens_total Tokens generated.",
                "# TYPE qwen3_moe_generation_tokens_total counter",
                f"qwen3_moe_generation_tokens_total {self.generation_tokens}",
                "# HELP qwen3_moe_preemptions_total Running requests preempted (KV blocks taken back when the pool ran "
                "out; recomputed later).",
                "# TYPE qwen3_moe_preemptions_total counter",
                f"qwen3_moe_preemptions_total {self.preemptions}",
                "# HELP qwen3_moe_prefix_cache_queries_total Prompt tokens looked up in the prefix cache at admission.",
                "# TYPE qwen3_moe_prefix_cache_queries_total counter",
                f"qwen3_moe_prefix_cache_queries_total {self.prefix_queries}",
                "# HELP qwen3_moe_prefix_cache_hits_total Prompt tokens found in the prefix cache (not computed "
                "again).",
                "# TYPE qwen3_moe_prefix_cache_hits_total counter",
                f"qwen3_moe_prefix_cache_hits_total {self.prefix_hits}",
                "# HELP qwen3_moe_requests_finished_total Finished requests by reason: stop (EOS or a stop string), "
                "length, abort (the client left), error (the request failed).",
                "# TYPE qwen3_moe_requests_finished_total counter",
                *(f'qwen3_moe_requests_finished_total{{reason="{k}"}} {v}' for k, v in sorted(self.finished.items())),
            ]
            if self.eplb is not None:
                rows += self.eplb.metrics_lines()
        return "\n".join(rows) + "\n"
