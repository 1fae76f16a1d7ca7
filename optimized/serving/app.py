"""The OpenAI-compatible HTTP server over a `Driver` (FastAPI): one application state (`state.ServerState`) and the
route modules (`routes/`) wired together; each route reads the state from `http.app.state.server`.

`build_app(...)` -> a FastAPI app with /v1/completions and /v1/chat/completions (JSON, or SSE ending
`data: [DONE]`), /v1/models, /v1/models/{id}, /health, /metrics. Contract: limits come before any work (body size,
then every field, then a text prompt's length in characters, then tokenizing off the event loop on one worker
thread, which also detokenizes); one choice is one engine request (choice index = prompt index * n + j, choice j
seeded by `protocol.choice_seed(seed, j)`); each choice carries `token_ids`; a client that goes away aborts its
requests; a request that fails alone gets a JSON error, or an SSE `error` event then `data: [DONE]` once streaming,
and nothing else fails with it. Fields and status codes: docs/serving.md.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from optimized.serving.generation import error_of
from optimized.serving.protocol import ApiError
from optimized.serving.routes import chat, completions, health, models, pd
from optimized.serving.state import MAX_BODY_BYTES, ServerState, max_chars_per_token  # noqa: F401 - re-exported

ROUTERS = (health.router, models.router, completions.router, chat.router, pd.router)


async def api_error(_, e: ApiError):
    # A body too slow to arrive: the connection cannot carry another request, so it closes. A 413 leaves the
    # connection open: closing a socket whose client is still sending resets it, and the client may lose the 413
    # itself; the server reads the rest of the body and drops it.
    close = {"connection": "close"} if e.status == 408 else None
    return JSONResponse(e.body(), status_code=e.status, headers=close)


async def http_error(http: HttpRequest, e: HTTPException):
    """404 (no such route) and 405 (a route without that method) in the OpenAI error shape the other errors use."""
    where = f"{http.method} {http.url.path}"
    message = {404: f"{where}: no such route", 405: f"{where}: method not allowed"}.get(e.status_code, str(e.detail))
    return JSONResponse(ApiError(e.status_code, message).body(), status_code=e.status_code, headers=e.headers)


async def client_gone(http: HttpRequest, _):
    """The client closed its connection while sending the body: one log line (nobody is left to answer)."""
    client = "%s:%d" % tuple(http.client) if http.client else "a client"
    logging.getLogger("uvicorn.error").warning(
        "%s went away while sending the body of %s %s", client, http.method, http.url.path
    )
    return Response(status_code=400)


async def validation_error(_, e):
    return JSONResponse(ApiError(422, str(e)).body(), status_code=422)


async def unexpected_error(_, e):  # a bug: still an OpenAI-style JSON error, and the server goes on
    return JSONResponse(error_of(e).body(), status_code=500)


def build_app(driver, tokenizer, model_name: str, **limits) -> FastAPI:
    """The app over `driver`; `limits` are `ServerState`'s keywords (stop_ids, default_max_tokens,
    max_prompt_tokens, max_body_bytes, max_choices, vocab_size, body_timeout_s); the driver's `pd` (a
    `PdInstance`, or None) gives the instance its prefill-decode role (routes/pd.py)."""
    state = ServerState(driver, tokenizer, model_name, pd=getattr(driver, "pd", None), **limits)
    app = FastAPI(title="qwen3-moe-npu", docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.max_prompt_chars = state.max_prompt_chars
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_gone)
    app.add_exception_handler(Exception, unexpected_error)
    for router in ROUTERS:
        app.include_router(router)
    return app
