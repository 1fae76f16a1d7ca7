"""GET /health (503 naming the engine's error once it stopped) and GET /metrics (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse

from optimized.serving.state import state_of

router = APIRouter()


@router.get("/health")
async def health(http: HttpRequest):
    error = state_of(http).driver.error
    if error is not None:
        return JSONResponse({"status": "error", "error": f"{type(error).__name__}: {error}"}, 503)
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(http: HttpRequest):
    return PlainTextResponse(state_of(http).driver.metrics.render(), media_type="text/plain; version=0.0.4")
