"""GET /v1/models and /v1/models/{id}: the one model this server serves."""

from __future__ import annotations

from fastapi import APIRouter, Request as HttpRequest

from optimized.serving.protocol import ApiError
from optimized.serving.state import ServerState, state_of

router = APIRouter()


def model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "qwen3-moe-npu"}


@router.get("/v1/models")
async def models(http: HttpRequest):
    return {"object": "list", "data": [model_card(state_of(http))]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, http: HttpRequest):
    state = state_of(http)
    if model_id != state.model_name:
        raise ApiError(
            404,
            f"model {model_id!r} does not exist; this server serves {state.model_name!r}",
            "model",
            "model_not_found",
        )
    return model_card(state)
