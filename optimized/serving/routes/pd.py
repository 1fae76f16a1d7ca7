"""Prefill-decode disaggregation on an instance started with `--pd-role prefill|decode`.

`GET /pd/v1/info`: the instance's role and the facts a router matches the two sides by. Prefill: a completion or chat
body with `"kv_transfer_params": {"do_remote_decode": true}` generates its first token and keeps the prompt's blocks
HELD; the response carries `kv_transfer_params` (transfer id, prompt ids, first token and its logprobs, the number of
tokens whose KV is held). `POST /pd/v1/transfer` writes that KV into the decode ranks the body names and answers with
the prefill side's digest; `POST /pd/v1/release` (or the hold timeout) frees the blocks. Decode: a body with
`"kv_transfer_params": {"do_remote_prefill": true, "prefill_url": ..., <the prefill's fields>}` reserves blocks
(waiting while none are free), asks the prefill for the transfer (retried once), checks the digest and the token
count, releases the prefill's blocks and continues from the first token, which the response shows as its first
generated token. docs/serving.md.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request as HttpRequest

from optimized.errors import UsageError
from optimized.executor.engine import TokenEvent, with_seed
from optimized.pd.digest import KvIntegrityError
from optimized.pd.instance import UnknownTransfer
from optimized.pd.kv_send import digest_data, digest_of, target_data
from optimized.pd.transfer_engine import TransferError
from optimized.serving.generation import error_of, submit, until_disconnect
from optimized.serving.protocol import ApiError
from optimized.serving.state import ServerState, state_of

router = APIRouter()
PARAM = "kv_transfer_params"
TRANSFER_TIMEOUT_S = 120.0  # one transfer call to the prefill instance (it writes every layer's KV)
log = logging.getLogger("uvicorn.error")


class ClientGone(Exception):
    """The client went away during the hand-off (its blocks are freed on both sides)."""


def _pd(state: ServerState, role: str | None = None):
    pd = getattr(state, "pd", None)
    if pd is None:
        raise ApiError(404, "this server runs no prefill-decode role (start it with --pd-role prefill|decode)")
    if role is not None and pd.role != role:
        raise ApiError(400, f"this instance's --pd-role is {pd.role}; the operation needs a {role} instance")
    return pd


def info(state: ServerState) -> dict:
    pd = _pd(state)
    runner = state.driver.engine.runner
    return {
        "role": pd.role,
        "max_model_len": runner.max_positions,
        "max_prompt_tokens": state.max_prompt_tokens,
        "block_size": runner.block_size,
        "kv_cache_dtype": str(runner.kv_cache_dtype).removeprefix("torch."),
        "attention": {"tp": pd.layout.tp, "dp": pd.layout.dp},
        "num_kv_heads": pd.num_kv_heads,
        "served_model_name": state.model_name,
    }


@router.get("/pd/v1/info")
async def pd_info(http: HttpRequest):
    return info(state_of(http))


async def _json(http: HttpRequest) -> dict:
    try:
        body = await http.json()
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("transfer_id"), str):
        raise ApiError(400, "the body needs 'transfer_id' (a string)", "transfer_id")
    return body


async def call(state: ServerState, op: str, *args, sink=None):
    return await asyncio.wrap_future(state.driver.call(op, args, sink))


@router.post("/pd/v1/transfer")
async def pd_transfer(http: HttpRequest):
    state = state_of(http)
    _pd(state, "prefill")
    body = await _json(http)
    decode, layout = body.get("decode"), body.get("decode_layout")
    if not isinstance(decode, list) or not decode or not isinstance(layout, dict):
        raise ApiError(400, "the body needs 'decode' (one entry per decode rank) and 'decode_layout' ({tp, dp})")
    try:
        digest = await call(state, "transfer", body["transfer_id"], decode, layout)
    except UnknownTransfer as e:
        raise ApiError(404, str(e), "transfer_id") from None
    except TransferError as e:
        raise ApiError(502, f"the KV transfer failed: {e}", kind="kv_transfer_error") from None
    except (UsageError, ValueError, KeyError, TypeError) as e:
        raise ApiError(400, f"the KV transfer cannot run: {type(e).__name__}: {e}") from None
    return {"transfer_id": body["transfer_id"], "num_tokens": digest.num_tokens, "digest": digest_data(digest)}


@router.post("/pd/v1/release")
async def pd_release(http: HttpRequest):
    state = state_of(http)
    _pd(state, "prefill")
    body = await _json(http)
    return {"transfer_id": body["transfer_id"], "released": await call(state, "release", body["transfer_id"])}


# ---- the generating routes' side
def params_of(state: ServerState, body: dict) -> dict | None:
    """The body's kv_transfer_params (checked against this instance's role), None without them."""
    params = body.get(PARAM)
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ApiError(400, f"'{PARAM}' must be an object", PARAM)
    if params.get("do_remote_decode") is True:
        _pd(state, "prefill")
        if body.get("stream"):
            raise ApiError(
                400, f"'{PARAM}.do_remote_decode' answers one token as one JSON body: 'stream' must be false"
            )
        body["max_tokens"] = 1  # the first token only; the decode side generates the rest
        body.pop("max_completion_tokens", None)
        if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 1:
            body["min_tokens"] = 1  # the decode side counts the rest (its draws go on from 1)
        return params
    if params.get("do_remote_prefill") is True:
        _pd(state, "decode")
        for key in ("prefill_url", "transfer_id"):
            if not isinstance(params.get(key), str):
                raise ApiError(400, f"'{PARAM}.{key}' must be a string", f"{PARAM}.{key}")
        for key in ("first_token", "num_tokens"):
            if isinstance(params.get(key), bool) or not isinstance(params.get(key), int):
                raise ApiError(400, f"'{PARAM}.{key}' must be an integer", f"{PARAM}.{key}")
        return params
    raise ApiError(400, f"'{PARAM}' needs do_remote_decode: true (prefill) or do_remote_prefill: true (decode)", PARAM)


def prefills(params: dict | None) -> bool:
    """The body asks this (prefill) instance for the first token and held KV."""
    return params is not None and params.get("do_remote_decode") is True


def with_result(state: ServerState, result: dict, params: dict | None, choices) -> dict:
    """A prefill's response carries its kv_transfer_params."""
    if prefills(params):
        result[PARAM] = prefill_result(state, choices[0])
    return result


def _one(requests) -> None:
    if len(requests) != 1:
        raise ApiError(400, f"'{PARAM}' serves one prompt with n=1; the body asks for {len(requests)} choices", PARAM)


def hold(requests) -> None:
    """Prefill: the request's blocks are held when it finishes."""
    _one(requests)
    requests[0].hold_kv = True


def prefill_result(state: ServerState, choice) -> dict:
    """The response's kv_transfer_params: what the decode side needs to take the request over."""
    request, first = choice.request, choice.events[0]
    pd = _pd(state)
    return {
        "transfer_id": request.request_id,
        "prompt_token_ids": list(request.prompt),
        "first_token": first.token,
        "num_tokens": len(request.prompt),
        "first_logprob": first.logprob,
        "first_top_logprobs": None if first.top_logprobs is None else [list(t) for t in first.top_logprobs],
        "attention": {"tp": pd.layout.tp, "dp": pd.layout.dp},
    }


async def _post(client, url: str, body: dict) -> dict:
    r = await client.post(url, json=body, timeout=TRANSFER_TIMEOUT_S)
    if r.status_code != 200:
        raise TransferError(f"{url} answered {r.status_code}: {r.text[:500]}")
    return r.json()


async def _release(client, prefill: str, transfer_id: str) -> None:
    """Best effort: the prefill's hold timeout frees its blocks should this fail."""
    try:
        await _post(client, f"{prefill}/pd/v1/release", {"transfer_id": transfer_id})
    except Exception as e:  # noqa: BLE001 - the request's answer does not depend on it
        log.warning("releasing KV %s on %s failed: %s", transfer_id, prefill, e)


async def _transfer(state: ServerState, client, prefill: str, body: dict) -> dict:
    """The prefill's transfer call, retried once; a second failure is the client's 502 naming the prefill."""
    errors = []
    for _ in range(2):
        try:
            return await _post(client, f"{prefill}/pd/v1/transfer", body)
        except Exception as e:  # noqa: BLE001 - a refused connection, a timeout, a failed write: retried once
            errors.append(f"{type(e).__name__}: {e}")
    raise ApiError(
        502, f"the KV transfer from prefill {prefill} failed twice: {' / '.join(errors)}", PARAM, "kv_transfer_error"
    )


async def take_over(state: ServerState, http: HttpRequest, params: dict, requests) -> asyncio.Queue:
    """Prefill: `generation.submit`. Decode: the request continues here from the prefill's first token; its
    events queue (the first token's event first), as `generation.submit` returns one."""
    import httpx

    if prefills(params):
        return submit(state.driver, requests)
    _one(requests)
    pd = _pd(state, "decode")
    if requests[0].prompt_logprobs:
        raise ApiError(400, "'echo' with 'logprobs' needs the prompt's logits, which stay on the prefill side", "echo")
    driver, loop, events = state.driver, asyncio.get_running_loop(), asyncio.Queue()
    prefill, transfer_id = params["prefill_url"].rstrip("/"), params["transfer_id"]
    request = requests[0]
    sent_prompt = params.get("prompt_token_ids")
    if sent_prompt is not None and list(sent_prompt) != request.prompt:
        raise ApiError(400, f"'{PARAM}.prompt_token_ids' are not this body's prompt's tokens", PARAM)
    try:
        driver.engine.check(request)
    except ValueError as e:
        raise error_of(e) from None
    request = with_seed(request)
    first = params["first_token"]
    if not 0 <= first < (state.vocab_size or first + 1):
        raise ApiError(400, f"'{PARAM}.first_token' {first} is outside the vocabulary [0, {state.vocab_size})", PARAM)
    request.tokens = [first]
    try:
        top = params.get("first_top_logprobs")
        top = None if top is None else [(int(i), float(v)) for i, v in top]
        lp = params.get("first_logprob")
        lp = None if lp is None else float(lp)
    except (TypeError, ValueError):
        raise ApiError(400, f"'{PARAM}.first_logprob' / 'first_top_logprobs' are not the prefill's", PARAM) from None
    event = TokenEvent(request, first, lp, top)
    rid = request.request_id
    async with httpx.AsyncClient() as client:
        if first in request.stop_ids or request.max_tokens == 1:  # done at its first token: no KV needed
            request.finish_reason = "stop" if first in request.stop_ids else "length"
            event.finished = True
            await _release(client, prefill, transfer_id)
            events.put_nowait((0, event))
            return events
        gone = asyncio.ensure_future(until_disconnect(http))
        try:
            await _hand_off(state, pd, client, gone, request, params, prefill)
        except BaseException:
            driver.abort(rid)
            await _release(client, prefill, transfer_id)
            raise
        finally:
            gone.cancel()
        await _release(client, prefill, transfer_id)
    events.put_nowait((0, event))
    sink = lambda item: loop.call_soon_threadsafe(events.put_nowait, (0, item))  # noqa: E731
    await call(state, "start", rid, sink=sink)
    return events


async def _hand_off(state, pd, client, gone, request, params, prefill) -> None:
    """Reserve (while the client is there), transfer (to its end: the prefill writes into the reserved blocks),
    check the digest; raises ClientGone or the client's error."""
    reserve = asyncio.ensure_future(call(state, "reserve", request))
    done, _ = await asyncio.wait({reserve, gone}, return_when=asyncio.FIRST_COMPLETED)
    if reserve not in done:
        reserve.cancel()
        raise ClientGone("the client went away while the request waited for KV blocks")
    targets = reserve.result()
    body = {
        "transfer_id": params["transfer_id"],
        "decode": [target_data(t) for t in targets],
        "decode_layout": {"tp": pd.layout.tp, "dp": pd.layout.dp},
    }
    sent = await _transfer(state, client, prefill, body)
    if gone.done():
        raise ClientGone("the client went away during the KV transfer")
    try:
        taken = int(params["num_tokens"])
        if taken != len(request.prompt):
            raise KvIntegrityError(f"prefill holds KV of {taken} tokens, the prompt has {len(request.prompt)}")
        received = await call(state, "digest", request.request_id, taken)
        received.check_against(digest_of(sent["digest"]))
    except KvIntegrityError as e:
        raise ApiError(
            500,
            f"KvIntegrityError: the KV received from prefill {prefill} is not what it sent: {e}",
            PARAM,
            "kv_integrity_error",
        ) from None
