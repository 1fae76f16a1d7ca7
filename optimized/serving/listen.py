"""The server's listening socket, bound before anything slow happens (the model loads after it): port 0 gets a free
port from the kernel and the caller reads which (`bound_port`), so nothing picks a port and hopes it stays free; a
port already taken is a UsageError naming it."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from optimized.errors import UsageError


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening: uvicorn listens on it when it starts)."""
    if not 0 <= port < 65536:
        raise UsageError(f"--port={port} must be in 0..65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is reusable
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(
                f"--port={port}: {host}:{port} is already in use; stop what listens there, choose another --port, or "
                "give --port 0 for any free port (its number is printed and written to --port-file)"
            ) from None
        raise UsageError(f"--host={host} --port={port} cannot be bound: {e.strerror or e}") from None
    return sock


def bound_port(sock: socket.socket) -> int:
    return sock.getsockname()[1]


def write_port_file(path: str | os.PathLike, port: int) -> None:
    """The port as one line, written whole (a reader polling for the file never sees it half written)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(f"{port}\n")
        os.replace(tmp, path)
    except OSError as e:
        raise UsageError(f"--port-file={path}: cannot be written: {e.strerror or e}") from None
