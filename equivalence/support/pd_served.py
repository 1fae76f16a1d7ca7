"""Real `serve` servers in this process for the prefill-decode tests: a colocated server or a `--pd-role` instance
(its own engine and Mooncake transfer engine, protocol tcp on 127.0.0.1), each on a thread at 127.0.0.1:0, on the
tiny fixture in fp32 or in bfloat16 with the per-token FP8 KV cache."""

from __future__ import annotations

import json
import threading
import time


TIMEOUT_S = 60  # a wait on a server, not a timing bound: a lost server fails the test instead of hanging it
MODEL = "tiny"


def pd_config(fp8: bool = False):
    from optimized.config import InferenceConfig

    model = {"model_path": "fixture:tiny", "dtype": "float32"}
    if fp8:  # the per-token FP8 KV cache quantizes 16-bit K/V
        model = {**model, "dtype": "bfloat16", "kv_cache_dtype": "float8"}
    return InferenceConfig.from_dict(
        {
            "model_config": model,
            "data_config": {"input_max_len": 48},
            "scheduler_config": {"batch_size": 3, "max_new_tokens": 8, "block_size": 16, "max_prefill_tokens": 64},
        }
    )


class Served:
    """One server in a thread on 127.0.0.1:0; `role` None: colocated."""

    def __init__(self, role: str | None, pool: int = 9, hold_timeout_s: float = 120.0, fp8: bool = False):
        from optimized.cli.serve import build_engine, make_server
        from optimized.serving.listen import bind, bound_port

        cfg = pd_config(fp8)
        self.engine, tokenizer, stop_ids, _ = build_engine(cfg, kv_pool_blocks=pool)
        self.pd = None
        if role is not None:
            from optimized.pd.instance import PdInstance
            from optimized.pd.transfer_engine import MooncakeTransferEngine

            mc = MooncakeTransferEngine()
            mc.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
            self.pd = PdInstance(role, self.engine, mc, hold_timeout_s=hold_timeout_s)
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{bound_port(self.sock)}"
        self.server, self.driver = make_server(cfg, self.engine, tokenizer, stop_ids, MODEL, self.sock, pd=self.pd)
        self.free = self.engine.cache.free_blocks
        self.driver.start()
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + TIMEOUT_S
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(TIMEOUT_S)
        self.driver.stop()
        self.sock.close()

    def settled(self) -> bool:
        """Every block back in the pool (waits for the engine thread to apply what is queued)."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            if self.engine.cache.free_blocks == self.free and self.engine.idle and not self.engine.handoff.held:
                return True
            time.sleep(0.02)
        return False


def post(url: str, path: str, body: dict):
    import httpx  # the serving tests skip without it

    return httpx.post(url + path, json=body, timeout=TIMEOUT_S)


def stream_chunks(url: str, path: str, body: dict) -> list[dict]:
    """A streamed request's SSE chunks, parsed; the stream must end with `data: [DONE]`."""
    import httpx

    chunks = []
    with httpx.stream("POST", url + path, json=body, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        lines = list(r.iter_lines())
    assert "data: [DONE]" in lines, lines[-3:]
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[6:]))
    return chunks
