"""One prefill instance, one decode instance and the router on one machine (`python -m optimized pd`).

Each instance is its own job: a plain process for one rank, else its own torchrun job (`--standalone`: its own
rendezvous on a port the kernel picks, so the two jobs never share a master port), each `serve --pd-role ROLE
--port 0 --port-file F`. The launcher waits for each port file and then each /health, starts the router in this
process on the given port, and waits: SIGTERM or Ctrl-C stops all three; an instance that exits is named and the
launcher stops the other and exits with status 1 (optimized/cli/pd.py runs it with the router).
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from optimized.errors import UsageError

POLL_S = 0.2
STOP_GRACE_S = 15.0  # SIGTERM, then this long before SIGKILL


def serve_command(role: str, config: str, nproc: int, port_file: str, host: str, extra: list[str]) -> list[str]:
    """The instance's command line: `serve --pd-role ROLE` on port 0, under torchrun when nproc > 1."""
    serve = ["-m", "optimized", "serve", "--config", config, "--pd-role", role, "--host", host]
    serve += ["--port", "0", "--port-file", port_file, *extra]
    if nproc == 1:
        return [sys.executable, *serve]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *serve]


@dataclass
class Instance:
    role: str
    config: str
    nproc: int
    port_file: Path
    proc: subprocess.Popen | None = None
    url: str | None = None

    @property
    def name(self) -> str:
        return f"the {self.role} instance ({self.config}, {self.nproc} process{'es' if self.nproc > 1 else ''})"

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


def say(line: str) -> None:
    print(f"pd: {line}", flush=True)


def healthy(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


class Launcher:
    def __init__(self, instances: list[Instance], host: str, command=serve_command, extra=(), startup_timeout_s=1800):
        self.instances, self.host, self.command = instances, host, command
        self.extra, self.startup_timeout_s = list(extra), startup_timeout_s

    def start(self) -> None:
        """Both instances started, their ports read and their /health 200; a UsageError naming one that exits or
        does not come up in time (the other is stopped)."""
        for inst in self.instances:
            cmd = self.command(inst.role, inst.config, inst.nproc, str(inst.port_file), self.host, self.extra)
            say(f"starting {inst.name}: {' '.join(cmd)}")
            # its own session: stopping it reaches every process of its job (torchrun and its workers)
            inst.proc = subprocess.Popen(cmd, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        for inst in self.instances:
            self._wait(inst, deadline, lambda i: i.port_file.exists(), "bind its port")
            inst.url = f"http://{self.host}:{int(inst.port_file.read_text())}"
            say(f"{inst.role} instance bound {inst.url}; waiting for its /health (the model loads)")
        for inst in self.instances:
            self._wait(inst, deadline, lambda i: healthy(i.url), "answer /health")
            say(f"{inst.role} instance ready at {inst.url}")

    def _wait(self, inst: Instance, deadline: float, ready, what: str) -> None:
        while not ready(inst):
            status = inst.exited()
            if status is not None:
                raise UsageError(f"{inst.name} exited with status {status} before it could {what} (its output above)")
            if time.monotonic() > deadline:
                raise UsageError(f"{inst.name} did not {what} within --startup-timeout={self.startup_timeout_s:g} s")
            time.sleep(POLL_S)

    def dead(self) -> Instance | None:
        return next((i for i in self.instances if i.exited() is not None), None)

    def stop(self) -> None:
        """SIGTERM to every instance's process group, SIGKILL to one still running after the grace period."""
        running = [i for i in self.instances if i.proc is not None and i.proc.poll() is None]
        for inst in running:
            _signal_group(inst.proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for inst in running:
            try:
                inst.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(inst.proc, signal.SIGKILL)
                inst.proc.wait()
            say(f"stopped the {inst.role} instance")


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group start_new_session made: its id is the child's pid
    except ProcessLookupError:
        pass
