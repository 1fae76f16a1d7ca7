"""A stand-in for a `serve --pd-role prefill|decode` instance, speaking the PD protocol with no model: for the router's
and the launcher's tests (the real instances' end-to-end proof is tests/test_pd_end_to_end.py).

Tokens are made up and deterministic: a text prompt's ids are its characters' code points mod 100; the first token
is (sum of the prompt ids) mod 100; each next token is (previous * 7 + 3) mod 100. A decode instance pulls the
transfer from the prefill instance (`POST /pd/v1/transfer`), as the real one does, and answers the whole completion
(streamed one token per SSE chunk, `chunk_delay_s` apart, when asked).

In a test: `FakeInstance("prefill", ...).start()` (a thread, port 0). As a process (the launcher's tests):
`python -m equivalence.support.fake_pd_instance serve --pd-role ROLE --config ANY --port 0 --port-file F`.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import os
import select
import socket
from pathlib import Path

MODEL = "fake-model"


def prompt_ids(body: dict) -> list[int]:
    if "messages" in body:
        text = "".join(m.get("content", "") for m in body["messages"])
        return [ord(c) % 100 for c in text]
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    return [ord(c) % 100 for c in prompt] if isinstance(prompt, str) else list(prompt)


def tokens_after(first: int, count: int) -> list[int]:
    out = [first]
    while len(out) < count:
        out.append((out[-1] * 7 + 3) % 100)
    return out[:count]


def expected_tokens(body: dict, max_tokens: int) -> list[int]:
    """What a router over fake instances answers for `body`: the reference the tests compare with."""
    return tokens_after(sum(prompt_ids(body)) % 100, max_tokens)


def error(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": status}}


class FakeInstance:
    def __init__(
        self,
        role: str,
        *,
        max_model_len: int = 64,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        model: str = MODEL,
        attention_tp: int = 1,
        chunk_delay_s: float = 0.0,
        answer_delay_s: float = 0.0,
        fail_status: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.role, self.max_model_len, self.chunk_delay_s = role, max_model_len, chunk_delay_s
        # decode: a non-streamed answer waits this long first, watching its client (as a real instance computes)
        self.answer_delay_s = answer_delay_s
        self.fail_status = fail_status
        self.health_error: str | None = None  # set: /health answers 503 with it (an engine that stopped)
        self.plain_error = False  # True: an error status comes with a text/plain body (not an OpenAI error)
        self.info = {
            "role": role,
            "max_model_len": max_model_len,
            "block_size": block_size,
            "kv_cache_dtype": kv_cache_dtype,
            "attention": {"tp": attention_tp, "dp": 1},
            "served_model_name": model,
        }
        self.lock = threading.Lock()
        self.requests: list[dict] = []  # every generation body received
        self.held: dict[str, list[int]] = {}  # prefill: transfer id -> prompt ids, until claimed or released
        self.claimed: list[str] = []
        self.released: list[str] = []
        self.release_event = threading.Event()
        self.stream_aborted = threading.Event()  # decode: the client of a stream went away before its end
        self.answer_waiting = threading.Event()  # decode: a non-streamed answer is being delayed
        self.answer_aborted = threading.Event()  # decode: its client went away while the answer was delayed
        self.next_id = 0
        handler = type("Handler", (_Handler,), {"fake": self})
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"

    def start(self) -> "FakeInstance":
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        """Gone: the port closes (a later connection is refused)."""
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------------------------------ behaviour

    def generate(self, body: dict, chat: bool) -> tuple[int, dict | None, list[int] | None]:
        """(status, JSON answer, or None with the tokens to stream)."""
        with self.lock:
            self.requests.append(body)
        if self.fail_status is not None:
            return self.fail_status, error(self.fail_status, f"the {self.role} instance refuses"), None
        params = body.get("kv_transfer_params") or {}
        ids = prompt_ids(body)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if self.role == "prefill":
            if not params.get("do_remote_decode") or max_tokens != 1 or body.get("stream"):
                return 400, error(400, f"not a prefill step: {params}, max_tokens {max_tokens}"), None
            if len(ids) + 1 > self.max_model_len:
                return (
                    413,
                    error(413, f"the prompt's {len(ids)} tokens exceed max_model_len {self.max_model_len}"),
                    None,
                )
            with self.lock:
                transfer_id = f"t{self.next_id}"
                self.next_id += 1
                self.held[transfer_id] = ids
            first = sum(ids) % 100
            answer = {"object": "text_completion", "model": MODEL, "choices": [{"index": 0, "text": str(first)}]}
            answer["kv_transfer_params"] = {
                "transfer_id": transfer_id,
                "prompt_token_ids": ids,
                "first_token": first,
                "num_tokens": len(ids),
            }
            return 200, answer, None
        if not params.get("do_remote_prefill") or "prefill_url" not in params:
            return 400, error(400, f"not a decode step: {params}"), None
        pull = json.dumps({"transfer_id": params["transfer_id"]}).encode()
        request = urllib.request.Request(
            params["prefill_url"] + "/pd/v1/transfer", pull, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                assert r.status == 200
        except Exception as e:  # noqa: BLE001 - the transfer failed: the decode request fails
            return 500, error(500, f"transfer {params['transfer_id']} failed: {e}"), None
        tokens = tokens_after(params["first_token"], max_tokens)
        if body.get("stream"):
            return 200, None, tokens
        text = " ".join(map(str, tokens))
        choice = {"index": 0, "token_ids": tokens, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return (
            200,
            {"object": "chat.completion" if chat else "text_completion", "model": MODEL, "choices": [choice]},
            None,
        )

    def claim(self, transfer_id: str) -> bool:
        with self.lock:
            if self.held.pop(transfer_id, None) is None:
                return False
            self.claimed.append(transfer_id)
            return True

    def release(self, transfer_id: str) -> None:
        with self.lock:
            self.held.pop(transfer_id, None)
            self.released.append(transfer_id)
        self.release_event.set()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeInstance

    def log_message(self, *_):
        pass

    def _json(self, status: int, obj) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):  # noqa: N802
        fake = self.fake
        if self.path == "/pd/v1/info":
            self._json(200, fake.info)
        elif self.path == "/health":
            if fake.health_error is None:
                self._json(200, {"status": "ok"})
            else:
                self._json(503, {"status": "error", "error": fake.health_error})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": fake.info["served_model_name"], "object": "model"}]})
        else:
            self._json(404, error(404, f"GET {self.path}: no such route"))

    def do_POST(self):  # noqa: N802
        fake = self.fake
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/pd/v1/transfer":
            ok = fake.claim(body["transfer_id"])
            self._json(200 if ok else 404, {"claimed": ok})
            return
        if self.path == "/pd/v1/release":
            fake.release(body["transfer_id"])
            self._json(200, {"released": True})
            return
        chat = self.path == "/v1/chat/completions"
        status, answer, stream = fake.generate(body, chat)
        if status >= 400 and fake.plain_error:
            raw = b"Internal Server Error"
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
            return
        if stream is None:
            if status == 200 and fake.role == "decode" and fake.answer_delay_s and not self._client_stays():
                fake.answer_aborted.set()
                self.close_connection = True
                return
            self._json(status, answer)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for i, token in enumerate(stream):
                delta = {"delta": {"content": f"{token} "}} if chat else {"text": f"{token} "}
                chunk = {"choices": [{"index": 0, "token_ids": [token], **delta}]}
                self._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
                time.sleep(fake.chunk_delay_s)
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            fake.stream_aborted.set()
            self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _client_stays(self) -> bool:
        """Wait `answer_delay_s`; False as soon as the client closed its side (readable with nothing to read)."""
        self.fake.answer_waiting.set()
        readable, _, _ = select.select([self.connection], [], [], self.fake.answer_delay_s)
        return not readable or self.connection.recv(1, socket.MSG_PEEK) != b""


def fake_serve_command(die: str | None = None, die_after_s: float = 0.0, fail_start: str | None = None):
    """A `command` for optimized/pd/launch.py starting this module instead of `serve`: the instance of role `die`
    exits with status 3 `die_after_s` after serving; the one of role `fail_start` exits with status 4 at once."""
    import sys

    def command(role, config, nproc, port_file, host, extra):
        cmd = [sys.executable, "-m", "equivalence.support.fake_pd_instance", "serve", "--pd-role", role]
        cmd += ["--config", config, "--host", host, "--port", "0", "--port-file", port_file, *extra]
        if role == die:
            cmd += ["--die-after-s", str(die_after_s)]
        if role == fail_start:
            cmd += ["--fail-start"]
        return cmd

    return command


def main(argv=None) -> None:
    """`serve --pd-role ROLE --config X --port 0 --port-file F [--host H]`, as the launcher starts an instance."""
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["serve"])
    ap.add_argument("--pd-role", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--served-model-name", default=MODEL)
    ap.add_argument("--die-after-s", type=float, help="exit with status 3 this long after serving")
    ap.add_argument("--fail-start", action="store_true", help="exit with status 4 before binding")
    args = ap.parse_args(argv)
    if args.fail_start:
        print(f"fake {args.pd_role} instance: failing at start", flush=True)
        raise SystemExit(4)
    fake = FakeInstance(args.pd_role, host=args.host, port=args.port, model=args.served_model_name).start()
    tmp = Path(args.port_file + ".tmp")  # written whole: the launcher never reads half a port (no torch import here)
    tmp.write_text(f"{fake.server.server_address[1]}\n")
    os.replace(tmp, args.port_file)
    print(f"fake {args.pd_role} instance ({args.config}) on {fake.url}", flush=True)
    if args.die_after_s is not None:
        time.sleep(args.die_after_s)
        raise SystemExit(3)
    threading.Event().wait()


if __name__ == "__main__":
    main()
