"""The PD router: the OpenAI-compatible front of a prefill-decode deployment (docs/serving.md, "Prefill-decode
disaggregation").

Per generation request (/v1/completions, /v1/chat/completions; one prompt, one choice):

1. refused at once when its max tokens alone do not fit the decode instances' max_model_len;
2. the prefill step: the client's body to a prefill instance with one output token, `stream` false and
   `"kv_transfer_params": {"do_remote_decode": true}`; its answer carries `kv_transfer_params` (the transfer id,
   the prompt's token ids, the first token, the token count); an error status (a prompt too long: 400 / 413) is
   relayed and nothing reaches a decode instance; a prompt plus max tokens too long for the decode side is refused
   (413) before any decode work;
3. the decode step: the client's original body (its stream flag and max tokens) to a decode instance with
   `"kv_transfer_params": {"do_remote_prefill": true, "prefill_url": ..., <what the prefill returned>}`; the decode
   instance pulls the KV from the prefill instance and answers the whole completion, first token included, which
   is relayed byte for byte (a stream chunk by chunk as it comes).

When the request ends before a decode instance answered 200 (the client went away, the decode instance refused or
was down, the prompt was too long), the router posts `/pd/v1/release {"transfer_id"}` to the prefill instance, so
its held blocks come back. An instance that cannot be reached is a 503 naming it; an instance's error status is
relayed with its body. `/health` asks every instance's /health (503 naming each one down); `/metrics` is
Prometheus text (router_metrics.py).
"""

from __future__ import annotations

import http.client
import json
import logging
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from optimized.pd.router_instances import RELEASE_ROUTE, Instance, InstanceDown, Pool
from optimized.pd.router_metrics import RouterMetrics

log = logging.getLogger("optimized.pd.router")

GENERATE_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}  # route -> is chat
MAX_BODY_BYTES = 16 * 1024 * 1024  # as the instances' own default limit
HEALTH_TIMEOUT_S = 5.0


def openai_error(status: int, message: str, kind: str, param=None) -> dict:
    """The OpenAI error object, as the instances' servers answer it (optimized/serving/protocol.py `ApiError`)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class RouterError(Exception):
    """A request's failure, answered as an OpenAI-style JSON error with `status` and counted under `cause`."""

    def __init__(self, status: int, message: str, cause: str, kind: str = "invalid_request_error", param=None):
        super().__init__(message)
        self.status, self.cause, self.kind, self.param = status, cause, kind, param

    def body(self) -> bytes:
        return json.dumps(openai_error(self.status, str(self), self.kind, self.param)).encode()


class Relayed(Exception):
    """An instance's own error answer, passed to the client as it came (status, content type, body); a body that is
    not JSON (not an OpenAI error: a proxy's page, a crash) becomes one naming the instance, with its status."""

    def __init__(self, instance: Instance, status: int, content_type: str, body: bytes, cause: str):
        super().__init__(f"HTTP {status}")
        if not content_type.startswith("application/json"):
            text = body.decode("utf-8", "replace").strip()[:200]
            message = f"{instance.role} instance {instance.url} answered HTTP {status}: {text}"
            body = json.dumps(openai_error(status, message, "upstream_error")).encode()
            content_type = "application/json"
        self.status, self.content_type, self.raw, self.cause = status, content_type, body, cause


def _down(e: InstanceDown) -> RouterError:
    e.instance.up = False
    return RouterError(503, str(e), f"{e.instance.role}_down", "service_unavailable")


def _max_tokens(body: dict, chat: bool) -> int | None:
    for key in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def check_single(body: dict, chat: bool) -> None:
    """One prompt and one choice per request: a transfer carries one sequence's KV."""
    n = body.get("n", 1)
    if n not in (None, 1):
        raise RouterError(
            400, f"'n' is {n!r}; the PD router serves one choice per request (allowed: 1)", "bad_request", param="n"
        )
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise RouterError(
                400,
                f"'prompt' holds {len(prompt)} prompts; the PD router serves one prompt per request",
                "bad_request",
                param="prompt",
            )


def prefill_body(body: dict, chat: bool) -> dict:
    """The prefill step's body: the client's, with one output token, no stream, and the transfer asked for. The
    sampling fields stay (the prefill instance draws the first token); min_tokens is capped at that one token."""
    out = dict(body)
    out.pop("stream_options", None)
    out["stream"] = False
    out["max_tokens"] = 1
    if chat and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if isinstance(out.get("min_tokens"), int) and out["min_tokens"] > 1:
        out["min_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


class Router:
    """The flow over a `Pool`; `timeout_s` bounds each read from an instance."""

    def __init__(self, pool: Pool, timeout_s: float = 600.0):
        self.pool, self.timeout_s, self.metrics = pool, timeout_s, RouterMetrics()

    # ------------------------------------------------------------------------------------------ the steps

    def prefill(self, body: dict, chat: bool, route: str) -> tuple[Instance, dict]:
        inst = self.pool.acquire("prefill")
        try:
            status, ctype, raw = self._post(inst, route, prefill_body(body, chat))
        finally:
            self.pool.release(inst)
        if status >= 400:
            cause = "too_long" if status == 413 else "prefill_rejected"
            raise Relayed(inst, status, ctype, raw, cause)
        try:
            params = json.loads(raw)["kv_transfer_params"]
            transfer_id = params["transfer_id"]
        except (ValueError, KeyError, TypeError):
            raise RouterError(
                502,
                f"prefill instance {inst.url} answered HTTP {status} without kv_transfer_params.transfer_id: is it "
                "started with `serve --pd-role prefill`?",
                "bad_handoff",
                "bad_gateway",
            ) from None
        if not isinstance(transfer_id, str):
            raise RouterError(502, f"prefill instance {inst.url}: transfer_id {transfer_id!r}", "bad_handoff")
        return inst, params

    def check_fits(self, params: dict, body: dict, chat: bool) -> None:
        """The prompt (as the prefill counted it) plus max tokens within the decode side's max_model_len."""
        max_tokens = _max_tokens(body, chat)
        limit = self.pool.max_model_len("decode")
        prompt = params.get("num_tokens")
        if isinstance(prompt, int) and max_tokens is not None and prompt + max_tokens > limit:
            raise RouterError(
                413,
                f"the prompt's {prompt} tokens plus max_tokens {max_tokens} exceed the decode instances' "
                f"max_model_len {limit}",
                "too_long",
                param="max_tokens",
            )

    def decode_request(self, prefill: Instance, params: dict, body: dict, route: str, client: socket.socket):
        """(decode instance, open connection, its response with status 200); a Relayed / RouterError otherwise;
        ClientGone (the decode connection closed, so the instance aborts the request) when `client` leaves before
        the decode instance starts answering (a non-streamed answer comes whole, at the end of the generation)."""
        decode = self.pool.acquire("decode")
        try:
            out = dict(body)
            out["kv_transfer_params"] = {**params, "do_remote_prefill": True, "prefill_url": prefill.url}
            conn = decode.connection(self.timeout_s)
            try:
                conn.request("POST", route, json.dumps(out).encode(), {"Content-Type": "application/json"})
                await_answer(conn.sock, client, self.timeout_s)
                response = conn.getresponse()
            except ClientGone:
                conn.close()
                raise
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                raise _down(InstanceDown(decode, f"POST {route}: {type(e).__name__}: {e}")) from None
            if response.status >= 400:
                raw = response.read()
                conn.close()
                raise Relayed(decode, response.status, response.getheader("Content-Type", ""), raw, "decode_rejected")
            decode.up = True
            return decode, conn, response
        except BaseException:
            self.pool.release(decode)
            raise

    def release(self, prefill: Instance, transfer_id: str) -> None:
        """The prefill instance's held blocks back (best effort: a transfer already taken over is not held)."""
        self.metrics.count_release()
        try:
            prefill.post_json(RELEASE_ROUTE, {"transfer_id": transfer_id}, HEALTH_TIMEOUT_S)
        except InstanceDown as e:
            log.warning("could not release transfer %s: %s", transfer_id, e)

    def _post(self, inst: Instance, route: str, body: dict) -> tuple[int, str, bytes]:
        conn = inst.connection(self.timeout_s)
        try:
            conn.request("POST", route, json.dumps(body).encode(), {"Content-Type": "application/json"})
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as e:
            raise _down(InstanceDown(inst, f"POST {route}: {type(e).__name__}: {e}")) from None
        finally:
            conn.close()
        inst.up = True
        return response.status, response.getheader("Content-Type", ""), raw

    # ------------------------------------------------------------------------------------------ the others

    def health(self) -> tuple[int, dict]:
        down = {}
        for inst in self.pool.instances:
            why = inst.health(HEALTH_TIMEOUT_S)
            if why is not None:
                down[inst.url] = why
        instances = {i.url: {"role": i.role, "up": i.up} for i in self.pool.instances}
        if down:
            return 503, {"status": "error", "error": "; ".join(down.values()), "instances": instances}
        return 200, {"status": "ok", "instances": instances}

    def models(self, route: str) -> tuple[int, str, bytes]:
        """The first reachable prefill instance's answer (every instance serves the same model)."""
        last = None
        for inst in self.pool.of("prefill"):
            conn = inst.connection(HEALTH_TIMEOUT_S)
            try:
                conn.request("GET", route)
                response = conn.getresponse()
                return response.status, response.getheader("Content-Type", ""), response.read()
            except (OSError, http.client.HTTPException) as e:
                last = InstanceDown(inst, f"GET {route}: {type(e).__name__}: {e}")
            finally:
                conn.close()
        raise _down(last)


class ClientGone(Exception):
    """The client closed its connection while the router waited for an instance's answer."""


def await_answer(upstream: socket.socket, client: socket.socket, timeout_s: float) -> None:
    """Return once `upstream` (an instance's connection) has its answer to read; ClientGone as soon as `client`
    closes its side first; TimeoutError after `timeout_s` without either."""
    deadline = time.monotonic() + timeout_s
    watched = [upstream, client]
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no answer in {timeout_s:g} s")
        readable, _, _ = select.select(watched, [], [], remaining)
        if upstream in readable:
            return
        if client in readable:
            if client_gone(client):
                raise ClientGone
            watched = [upstream]  # the client sent more bytes (a next request): its end shows only after the answer


def client_gone(sock: socket.socket) -> bool:
    """The client closed its side (it sends nothing else while it waits for the answer, so a readable socket with
    no data is its end)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "qwen3-moe-pd-router"
    router: Router  # set on the subclass `serve_router` makes

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.address_string(), *args)

    # ---------------------------------------------------------------------------------------- answering

    def _answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type or "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._answer(status, json.dumps(obj).encode())

    def _error(self, e: RouterError) -> None:
        self.router.metrics.count_error(e.cause)
        self._answer(e.status, e.body())

    # -------------------------------------------------------------------------------------------- GET

    def do_GET(self):  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        try:
            if path == "/health":
                status, body = self.router.health()
                self._json(status, body)
            elif path == "/metrics":
                text = self.router.metrics.render(self.router.pool.instances)
                self._answer(200, text.encode(), "text/plain; version=0.0.4")
            elif path == "/v1/models" or path.startswith("/v1/models/"):
                status, content_type, raw = self.router.models(path)
                self._answer(status, raw, content_type)
            else:
                self._error(RouterError(404, f"GET {path}: no such route", "bad_request"))
        except RouterError as e:
            self._error(e)

    # ------------------------------------------------------------------------------------------- POST

    def do_POST(self):  # noqa: N802
        path = self.path.split("?", 1)[0]
        try:
            body = self._read_body()
        except RouterError as e:
            self.close_connection = True
            self._error(e)
            return
        if path not in GENERATE_ROUTES:
            self._error(RouterError(404, f"POST {path}: no such route", "bad_request"))
            return
        self.router.metrics.count_request(path)
        try:
            self._generate(path, body, GENERATE_ROUTES[path])
        except RouterError as e:
            self._error(e)
        except Relayed as e:
            self.router.metrics.count_error(e.cause)
            self._answer(e.status, e.raw, e.content_type)
        except (BrokenPipeError, ConnectionResetError):  # the client left before its answer was written
            self.router.metrics.count_error("client_gone")
            self.close_connection = True

    def _read_body(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RouterError(411, "a request body needs a Content-Length", "bad_request")
        if int(length) > MAX_BODY_BYTES:
            raise RouterError(413, f"the request body is {length} bytes; allowed: {MAX_BODY_BYTES}", "bad_request")
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise RouterError(400, f"the request body is not JSON: {e}", "bad_request") from None
        if not isinstance(body, dict):
            raise RouterError(400, "the request body must be a JSON object", "bad_request")
        return body

    def _generate(self, route: str, body: dict, chat: bool) -> None:
        router = self.router
        check_single(body, chat)
        max_tokens = _max_tokens(body, chat)
        limit = router.pool.max_model_len("decode")
        if max_tokens is not None and max_tokens >= limit:
            raise RouterError(
                413,
                f"max_tokens {max_tokens} leaves no room for a prompt in the decode instances' max_model_len {limit}",
                "too_long",
                param="max_tokens",
            )
        prefill, params = router.prefill(body, chat, route)
        transfer_id = params["transfer_id"]
        taken = False
        try:
            router.check_fits(params, body, chat)
            try:
                if client_gone(self.connection):  # gone during the prefill: no decode work at all
                    raise ClientGone
                decode, conn, response = router.decode_request(prefill, params, body, route, self.connection)
            except ClientGone:
                router.metrics.count_error("client_gone")
                self.close_connection = True
                return
            taken = True  # the decode instance answered 200: it owns the transfer from here
            router.metrics.count_handoff()
            try:
                if body.get("stream") is True:
                    # a client gone mid-stream: the transfer is released too (a no-op once the decode took it)
                    taken = self._relay_stream(response)
                else:
                    try:
                        raw = response.read()
                    except (OSError, http.client.HTTPException) as e:
                        raise RouterError(
                            502,
                            f"decode instance {decode.url}: the answer broke off: {type(e).__name__}: {e}",
                            "stream_broken",
                            "bad_gateway",
                        ) from None
                    self._answer(response.status, raw, response.getheader("Content-Type", ""))
            finally:
                conn.close()
                router.pool.release(decode)
        finally:
            if not taken:
                router.release(prefill, transfer_id)

    def _relay_stream(self, response) -> bool:
        """The decode instance's SSE as it comes, in chunked encoding; False when the client went away (the decode
        connection is then closed: the instance aborts the request). A stream ending before `data: [DONE]` gets an
        error event and its own `data: [DONE]`, as the instances end a failed stream."""
        self.send_response(response.status)
        self.send_header("Content-Type", response.getheader("Content-Type", "text/event-stream"))
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        metrics = self.router.metrics
        tail = b""  # the stream's last bytes: did it end with `data: [DONE]`?
        try:
            while True:
                try:
                    data, why = response.read1(65536), "the decode instance closed the stream before its end"
                except (OSError, http.client.HTTPException) as e:
                    data, why = b"", f"the decode instance's stream broke: {type(e).__name__}: {e}"
                if not data:
                    if not tail.rstrip().endswith(b"data: [DONE]"):
                        metrics.count_error("stream_broken")
                        event = openai_error(503, why, "service_unavailable")
                        self._chunk(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
                    break
                if client_gone(self.connection):
                    raise BrokenPipeError
                self._chunk(data)
                tail = (tail + data)[-64:]
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            return True
        except (BrokenPipeError, ConnectionResetError):
            metrics.count_error("client_gone")
            self.close_connection = True
            return False

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


class RouterServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False


def make_server(router: Router, sock: socket.socket) -> RouterServer:
    """The HTTP server on the already bound socket `sock` (optimized/serving/listen.py's `bind`)."""
    handler = type("Handler", (Handler,), {"router": router})
    server = RouterServer(sock.getsockname()[:2], handler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.server_address = sock.getsockname()[:2]
    server.server_activate()
    return server


def serve_in_thread(server: RouterServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, args=(0.1,), name="pd router", daemon=True)
    thread.start()
    return thread
