"""Servers on loopback for the endpoint tests and the calibration: ours (`python -m optimized serve`, one process or
under torchrun, optionally through the planted-bug launcher) and transformers' own `transformers serve`, each a
subprocess started on port 0 (it reports the port it bound), waited for, and always stopped."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

REPO = Path(__file__).resolve().parents[2]
START_S = 300


@dataclass(frozen=True)
class Launch:
    """A server command started on port 0, and how to learn the port it bound: `port_of(log_path)` is the port once
    the server has told it (a port file, a log line), else None. Nothing picks a free port and hopes it stays free."""

    cmd: list[str]
    port_of: Callable[[Path], int | None]


@contextlib.contextmanager
def unused_port():
    """A loopback port that nothing listens on while the block runs: bound and held, never listened on (a connection
    to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def _port_file_reader(path: Path) -> Callable[[Path], int | None]:
    def port_of(_log: Path) -> int | None:
        text = path.read_text() if path.exists() else ""
        return int(text) if text.endswith("\n") else None

    return port_of


def _log_line_reader(pattern: str) -> Callable[[Path], int | None]:
    def port_of(log: Path) -> int | None:
        hit = re.search(pattern, log.read_text(errors="replace"))
        return int(hit.group(1)) if hit else None

    return port_of


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
def serving(launch: Launch, log_path: Path, health: str = "/health"):
    """Run the server until the block ends; yields the /v1 base URL."""
    with server_process(launch, log_path, health) as (base, _):
        yield base + "/v1"


def _wait_until_up(proc, launch: Launch, log_path: Path, health: str, start_s: float) -> str:
    """The base URL once the server told its port and `health` answers 200 there."""
    deadline, base = time.monotonic() + start_s, None
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {log_path.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start in {start_s} s: {log_path.read_text()[-3000:]}")
        if base is None and (port := launch.port_of(log_path)) is not None:
            base = f"http://127.0.0.1:{port}"
        try:
            if base is not None and httpx.get(base + health, timeout=2).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


@contextlib.contextmanager
def server_process(launch: Launch, log_path: Path, health: str = "/health", start_s: float = START_S):
    """Run the server until the block ends, once it told its port and `health` answers within `start_s`; yields
    (its base URL, its process)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(
            launch.cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield _wait_until_up(proc, launch, log_path, health, start_s), proc
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(60)


def ours(config: Path, *args: str, ranks: int = 1, bug_file: Path | None = None) -> Launch:
    """`python -m optimized serve` (under torchrun for ranks > 1) on port 0, the port read from its --port-file;
    `args`: more serve flags."""
    module = ["-m", "equivalence.endpoint.planted", str(bug_file)] if bug_file else ["-m", "optimized"]
    launch = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        if ranks > 1
        else [sys.executable]
    )
    port_file = Path(config).with_name(f"{Path(config).stem}-{uuid.uuid4().hex[:8]}.port")
    serve = ["serve", "--config", str(config), "--port", "0", "--port-file", str(port_file), *args]
    return Launch(launch + module + serve, _port_file_reader(port_file))


def transformers_serve(model_dir: Path) -> Launch:
    """`transformers serve` on port 0: uvicorn's start-up line names the port it bound."""
    exe = Path(sys.executable).with_name("transformers")
    cmd = [str(exe), "serve", str(model_dir), "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--dtype"]
    return Launch([*cmd, "float32"], _log_line_reader(r"Uvicorn running on http://127\.0\.0\.1:(\d+)"))
