"""The OpenAI-compatible HTTP server over a `Driver` (FastAPI): one application state (`state.ServerState`) and the
route modules (`routes/`) wired together; each route reads the state from `http.app.state.server`."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from optimized.serving.generation import error_of
from optimized.serving.protocol import ApiError
from optimized.serving.routes import chat, completions, health, models
from optimized.serving.state import MAX_BODY_BYTES, ServerState, max_chars_per_token  # noqa: F401 - re-exported

ROUTERS = (health.router, models.router, completions.router, chat.router)


async def api_error(_, e: ApiError):
    return JSONResponse(e.body(), status_code=e.status)


async def validation_error(_, e):
    return JSONResponse(ApiError(422, str(e)).body(), status_code=422)


async def unexpected_error(_, e):  # a bug: still an OpenAI-style JSON error, and the server goes on
    return JSONResponse(error_of(e).body(), status_code=500)


def build_app(driver, tokenizer, model_name: str, **limits) -> FastAPI:
    """The app over `driver`; `limits` are `ServerState`'s keywords (stop_ids, default_max_tokens,
    max_prompt_tokens, max_body_bytes, max_choices, vocab_size)."""
    state = ServerState(driver, tokenizer, model_name, **limits)
    app = FastAPI(title="qwen3-moe-npu", docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.max_prompt_chars = state.max_prompt_chars
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected_error)
    for router in ROUTERS:
        app.include_router(router)
    return app
