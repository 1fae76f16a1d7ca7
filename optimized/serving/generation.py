"""What both generating routes share: the engine requests of a body, submitting them, and the loop that turns their
token events into text (off the event loop) until every choice ended, aborting what is left when the client goes away,
a stop string hits, one fails or the handler is cancelled."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field, replace

from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from optimized.executor.engine import RequestTooLarge
from optimized.executor.scheduler import Request
from optimized.serving import protocol
from optimized.serving.driver import EngineStopped
from optimized.serving.protocol import ApiError
from optimized.serving.state import ServerState
from optimized.serving.text import TextStream, text_decoder


def error_of(e: BaseException) -> ApiError:
    """The HTTP error of a request that failed in the engine's thread (its sink got the exception)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, EngineStopped):
        return ApiError(503, str(e), kind="server_error")
    if isinstance(e, RequestTooLarge):
        return ApiError(413, str(e), "prompt")
    if isinstance(e, ValueError):
        return ApiError(400, str(e), "prompt")
    return ApiError(500, f"the request failed: {type(e).__name__}: {e}", kind="server_error")


@dataclass
class Choice:
    index: int
    request: Request
    stream: TextStream
    prompt_text: str = ""  # echo: the prompt's text, sent first
    prompt_offsets: list = field(default_factory=list)  # echo + logprobs: text_offset of each prompt token
    events: list = field(default_factory=list)
    offsets: list = field(default_factory=list)  # text_offset of each generated token (in `text`)
    text: list = field(default_factory=list)
    reason: str | None = None
    ended: bool = False  # the engine is done with it (finished, failed or aborted by us)


class Choices(list):
    """The choices of one response, in index order; n: choices per prompt."""

    n = 1


def choices_of(state: ServerState, body: dict, requests: list[Request], n: int) -> Choices:
    """One choice per request, each streaming its text as the body asks (stop strings, special tokens)."""
    stops = protocol.stop_of(body)
    decode = text_decoder(state.tokenizer, *protocol.special_tokens_of(body)) if state.tokenizer is not None else None
    choices = Choices(Choice(k, r, TextStream(state.tokenizer, stops, decode)) for k, r in enumerate(requests))
    choices.n = n
    return choices


def requests_of(state: ServerState, body: dict, prompts: list[list[int]], n: int, chat: bool):
    """(response id, one engine request per prompt x n choice): choice j samples with `choice_seed(seed, j)`."""
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_tokens = protocol.max_tokens_of(body, state.default_max_tokens, keys)
    sampling = protocol.sampling_of(body, state.vocab_size)
    if sampling.min_tokens > max_tokens:
        raise ApiError(
            400,
            f"'min_tokens' is {sampling.min_tokens}, more than the request's max tokens ({max_tokens})",
            "min_tokens",
        )
    logprobs = protocol.logprobs_of(body, chat)
    echo = not chat and protocol._typed(body, "echo", bool, "a boolean", False)
    ignore_eos = protocol._typed(body, "ignore_eos", bool, "a boolean", False)
    stop_ids = frozenset(() if ignore_eos else state.stop_ids)
    base = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    out = []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            s = sampling if sampling.greedy else replace(sampling, seed=protocol.choice_seed(sampling.seed, j))
            rid = f"{base}-{p * n + j}"
            out.append(
                Request(rid, prompt, max_tokens, s, stop_ids, logprobs, prompt_logprobs=echo and logprobs is not None)
            )
    return base, out


def submit(driver, requests: list[Request]) -> asyncio.Queue:
    """Every request or none: (choice index, event or exception) items on one queue."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    done = []
    try:
        for k, request in enumerate(requests):
            driver.submit(request, lambda item, k=k: loop.call_soon_threadsafe(events.put_nowait, (k, item)))
            done.append(request)
    except BaseException as e:
        for request in done:
            driver.abort(request.request_id)
        raise error_of(e) from None
    return events


def detokenize(batch):
    """On the worker thread: each token event's new text, in order ((offset, text, a stop string hit), an
    exception when detokenizing failed, or None for an item that is not a token of a live choice)."""
    out = []
    for c, item in batch:
        if c.ended or c.stream.stopped or isinstance(item, BaseException):
            out.append(None)
            continue
        offset = c.stream.offset
        try:
            if item.finished and item.token in item.request.stop_ids:  # EOS: its text is not shown
                text = c.stream.finish()
            else:
                text = c.stream.add(item.token, item.finished)
        except Exception as e:  # noqa: BLE001 - this request fails, nothing else
            out.append(e)
            continue
        out.append((offset, text, c.stream.stopped))
    return out


async def until_disconnect(http: HttpRequest) -> None:
    """Returns when the client has gone away (the body is read: the next ASGI message is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def watch_disconnect(http: HttpRequest, events: asyncio.Queue) -> None:
    """Waits for the client to go away and then puts a `(None, None)` item on the choices' event queue, so the loop
    learns of it with its next item: one task per response, nothing per token."""
    await until_disconnect(http)
    events.put_nowait((None, None))


async def next_batch(events: asyncio.Queue) -> list | None:
    """The events waiting (at least one), or None when the client went away."""
    batch = [await events.get()]
    while not events.empty():
        batch.append(events.get_nowait())
    return None if any(k is None for k, _ in batch) else batch


def outcome(driver, c: Choice, item, done):
    """(new text, finish reason or None) of one token event for its choice; raises the choice's failure."""
    if isinstance(item, BaseException):  # the driver is done with it
        c.ended = True
        raise error_of(item)
    if isinstance(done, Exception):
        raise ApiError(500, f"detokenizing failed: {type(done).__name__}: {done}", kind="server_error") from None
    c.request = item.request  # the engine's copy (with_seed): its prompt logprobs
    offset, text, stopped = done
    c.offsets.append(offset)
    # read here, on the event: the engine thread may already be past this token
    reason = "stop" if stopped else (item.request.finish_reason if item.finished else None)
    if reason is not None:
        c.ended = True
        if not item.finished:  # a stop string: the engine would go on
            driver.abort(c.request.request_id, "stop")
    return text, reason


async def run(state: ServerState, choices: list[Choice], events: asyncio.Queue, http: HttpRequest):
    """(choice, event, new text, finish reason or None) until every choice finished; aborts the unfinished ones
    when the client leaves, a stop string hits, one fails or the handler is cancelled. The events waiting on the
    queue are detokenized together on the worker thread, never on the event loop."""
    left = len(choices)
    watcher = asyncio.ensure_future(watch_disconnect(http, events))
    try:
        while left:
            batch = await next_batch(events)
            if batch is None:
                return
            batch = [(choices[k], item) for k, item in batch]
            texts = await state.off_loop(detokenize, batch)
            for (c, item), done in zip(batch, texts):
                if c.ended:
                    continue
                text, reason = outcome(state.driver, c, item, done)
                left -= reason is not None
                yield c, item, text, reason
    finally:
        watcher.cancel()
        for c in choices:
            if not c.ended:
                c.ended = True
                state.driver.abort(c.request.request_id)


async def collect(state: ServerState, choices, events, http) -> None:
    async for c, event, text, reason in run(state, choices, events, http):
        c.events.append(event)
        c.text.append(text)
        c.reason = reason


def sse(head: dict, chunks) -> StreamingResponse:
    """The SSE body: each chunk, `data: [DONE]`; an error after the headers went out is an `error` event."""

    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps({**head, **chunk})}\n\n"
        except Exception as e:  # noqa: BLE001 - the status line is gone: tell the client in the stream
            yield f"event: error\ndata: {json.dumps(error_of(e).body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def usage(choices: Choices, completion_tokens: int) -> dict:
    prompt = sum(len(c.request.prompt) for c in choices[:: choices.n])  # each prompt once, whatever n
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}
