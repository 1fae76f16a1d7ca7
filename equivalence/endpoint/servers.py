"""Servers on loopback for the endpoint tests and the calibration: ours (`python -m optimized serve`, one process or
under torchrun, optionally through the planted-bug launcher) and transformers' own `transformers serve`, each a
subprocess on a free port, waited for, and always stopped."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
START_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_yaml(dtype: str = "float32", parallel: str | None = None, model: str = "fixture:tiny") -> str:
    lines = [
        f'model_config: {{model_path: "{model}", dtype: {dtype}}}',
        "data_config: {input_max_len: 64}",
        "scheduler_config: {batch_size: 4, max_new_tokens: 16, block_size: 16, max_prefill_tokens: 128}",
    ]
    if parallel:
        lines.append(f"parallel_config: {parallel}")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def serving(cmd: list[str], port: int, log_path: Path, health: str = "/health"):
    """Run `cmd` (a server on 127.0.0.1:port) until the block ends; yields the /v1 base URL."""
    with server_process(cmd, port, log_path, health) as (base, _):
        yield base + "/v1"


@contextlib.contextmanager
def server_process(cmd: list[str], port: int, log_path: Path, health: str = "/health", start_s: float = START_S):
    """Run `cmd` (a server on 127.0.0.1:port) until the block ends, once `health` answers within `start_s`; yields
    (its base URL, its process)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + start_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({proc.returncode}): {log_path.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start in {start_s} s: {log_path.read_text()[-3000:]}")
                try:
                    if httpx.get(base + health, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            yield base, proc
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(60)


def ours(config: Path, port: int, *, ranks: int = 1, bug_file: Path | None = None) -> list[str]:
    module = ["-m", "equivalence.endpoint.planted", str(bug_file)] if bug_file else ["-m", "optimized"]
    launch = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        if ranks > 1
        else [sys.executable]
    )
    return launch + module + ["serve", "--config", str(config), "--port", str(port)]


def transformers_serve(model_dir: Path, port: int) -> list[str]:
    exe = Path(sys.executable).with_name("transformers")
    return [
        str(exe),
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]
