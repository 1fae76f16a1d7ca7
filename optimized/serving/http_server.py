"""uvicorn over a socket bound beforehand (`listen.bind`, before the model loads): it serves on that socket, so the
port a client was told is the port served."""

from __future__ import annotations

import uvicorn

from optimized.serving.listen import bound_port


class Server(uvicorn.Server):
    def __init__(self, app, sock, log_level: str = "warning"):
        host = sock.getsockname()[0]
        super().__init__(uvicorn.Config(app, host=host, port=bound_port(sock), log_level=log_level, lifespan="off"))
        self.sock = sock

    def run(self, sockets=None) -> None:
        super().run(sockets=sockets or [self.sock])
