"""uvicorn over a socket bound beforehand (`listen.bind`, before the model loads): it serves on that socket, so the
port a client was told is the port served. Slow clients are bounded: a connection whose request headers are not
complete within `header_timeout_s` of its first byte (or of being opened) is closed; the body's bound is the app's
(`ServerState.body_timeout_s`, a 408)."""

from __future__ import annotations

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from optimized.serving.listen import bound_port

HEADER_TIMEOUT_S = 30.0  # --header-timeout: from a request's first byte to its last header line


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-header read timeout (uvicorn has none: a client trickling header bytes
    held its connection for ever). Idle keep-alive connections stay uvicorn's to close (`timeout_keep_alive`)."""

    header_timeout_s = HEADER_TIMEOUT_S
    _header_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._awaiting_headers():
            self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers were read: its body has the app's own bound
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._awaiting_headers():
            return
        client = "%s:%d" % self.client if self.client else "a client"
        self.logger.warning(
            "dropped %s: no complete request headers within %g s (--header-timeout)", client, self.header_timeout_s
        )
        self.transport.close()


class Server(uvicorn.Server):
    def __init__(self, app, sock, log_level: str = "warning", header_timeout_s: float = HEADER_TIMEOUT_S):
        protocol = type("H11Protocol", (BoundedH11Protocol,), {"header_timeout_s": header_timeout_s})
        host, port = sock.getsockname()[0], bound_port(sock)
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off", http=protocol))
        self.sock = sock

    def run(self, sockets=None) -> None:
        super().run(sockets=sockets or [self.sock])
