"""The OpenAI-compatible HTTP routes over a `Driver` (FastAPI).

/v1/completions and /v1/chat/completions (streaming by SSE, ending `data: [DONE]`), /v1/models, /health,
/metrics. Each choice also carries `token_ids` (the generated ids; with echo on completions, the prompt's first),
which the proof tests and `bench serve` read. A handler whose client goes away aborts its request, which frees
its KV blocks.
"""
import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from optimized.executor.engine import RequestTooLarge
from optimized.executor.scheduler import Request
from optimized.serving import protocol
from optimized.serving.driver import EngineStopped
from optimized.serving.protocol import ApiError
from optimized.serving.text import TextStream

POLL_S = 1.0   # how often a waiting non-streaming handler checks that its client is still there


def build_app(driver, tokenizer, model_name: str, *, stop_ids=(), default_max_tokens: int = 16,
              max_prompt_tokens=None):
    """max_prompt_tokens: the longest prompt accepted (data_config.input_max_len); longer ones get 413."""
    app = FastAPI(title="qwen3-moe-npu", docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e):
        return JSONResponse(ApiError(422, str(e)).body(), status_code=422)

    @app.get("/health")
    async def health():
        if driver.error is not None:
            return JSONResponse({"status": "error", "error": f"{type(driver.error).__name__}: {driver.error}"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(driver.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "qwen3-moe-npu"}]}

    async def body_of(http: HttpRequest) -> dict:
        try:
            body = json.loads(await http.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        protocol.check_common(body, model_name)
        return body

    def engine_request(body, prompt, chat: bool) -> Request:
        if max_prompt_tokens is not None and len(prompt) > max_prompt_tokens:
            raise ApiError(413, f"the prompt has {len(prompt)} tokens, more than the server's limit "
                                f"data_config.input_max_len={max_prompt_tokens}", "messages" if chat else "prompt")
        keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        echo = not chat and protocol._typed(body, "echo", bool, "a boolean", False)
        logprobs = protocol.logprobs_of(body, chat)
        return Request(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", prompt,
                       protocol.max_tokens_of(body, default_max_tokens, keys), protocol.sampling_of(body),
                       frozenset(() if body.get("ignore_eos") else stop_ids), logprobs,
                       prompt_logprobs=echo and logprobs is not None)

    def submit(request: Request):
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        try:
            driver.submit(request, lambda item: loop.call_soon_threadsafe(events.put_nowait, item))
        except RequestTooLarge as e:
            raise ApiError(413, str(e), "prompt") from None
        except EngineStopped as e:
            raise ApiError(503, str(e), kind="server_error") from None
        except ValueError as e:
            raise ApiError(400, str(e), "prompt") from None
        return events

    async def events_of(request: Request, events: asyncio.Queue, http: HttpRequest, stream: TextStream):
        """(event, new text, finish reason or None) until the request finishes; aborts it when the client leaves or a stop string hits."""
        finished = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(events.get(), POLL_S)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return
                    continue
                if isinstance(item, BaseException):
                    raise ApiError(503 if isinstance(item, EngineStopped) else 400, str(item), kind="server_error")
                text = stream.add(item.token, item.finished)
                # read here, on the event: the engine thread may already be past this token
                reason = "stop" if stream.stopped else (item.request.finish_reason if item.finished else None)
                finished = item.finished and not stream.stopped
                yield item, text, reason
                if reason is not None:
                    return
        finally:
            if not finished:            # the client left, a stop string hit, or the handler was cancelled
                driver.abort(request.request_id)

    async def collect(request, events, http, stream):
        got, text, reason = [], [], None
        async for event, piece, reason in events_of(request, events, http, stream):
            got.append(event)
            text.append(piece)
        return got, "".join(text), reason

    def token_text(t: int) -> str:
        return tokenizer.decode([t]) if tokenizer is not None else ""

    def usage(request: Request, n: int) -> dict:
        return {"prompt_tokens": len(request.prompt), "completion_tokens": n, "total_tokens": len(request.prompt) + n}

    # ---- /v1/completions
    def completion_logprobs(request, events, echo_prompt: bool):
        if request.logprobs is None:
            return None
        tokens, values, tops = [], [], []
        if echo_prompt:
            tokens.append(token_text(request.prompt[0]))
            values.append(None)
            tops.append(None)
            for t, (v, top) in zip(request.prompt[1:], request.prompt_logprob_values or []):
                tokens.append(token_text(t))
                values.append(v)
                tops.append({token_text(i): lp for i, lp in top})
        for e in events:
            tokens.append(token_text(e.token))
            values.append(e.logprob)
            tops.append({token_text(i): lp for i, lp in e.top_logprobs})
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": [0] * len(tokens)}

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body = await body_of(http)
        prompt = protocol.completion_prompt(body, tokenizer)
        request = engine_request(body, prompt, chat=False)
        stops, echo = protocol.stop_of(body), body.get("echo") is True
        if stops and tokenizer is None:
            raise ApiError(400, "'stop' strings need the checkpoint's tokenizer", "stop")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = submit(request)
        stream = TextStream(tokenizer, stops)
        prompt_text = tokenizer.decode(prompt) if (echo and tokenizer is not None) else ""
        head = {"id": request.request_id, "object": "text_completion", "created": int(time.time()),
                "model": model_name}

        if body.get("stream"):
            async def sse():
                n = 0
                async for event, text, reason in events_of(request, events, http, stream):
                    first, n = n == 0, n + 1
                    choice = {"index": 0, "text": (prompt_text if first else "") + text,
                              "token_ids": ([*prompt] if first and echo else []) + [event.token],
                              "finish_reason": reason, "logprobs": completion_logprobs(request, [event], echo and first)}
                    yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
                if include_usage:
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(request, n)})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")

        got, text, reason = await collect(request, events, http, stream)
        choice = {"index": 0, "text": prompt_text + text, "finish_reason": reason,
                  "token_ids": ([*prompt] if echo else []) + [e.token for e in got],
                  "logprobs": completion_logprobs(request, got, echo)}
        return {**head, "choices": [choice], "usage": usage(request, len(got))}

    # ---- /v1/chat/completions
    def chat_logprobs(request, events):
        if request.logprobs is None:
            return None

        def entry(t, lp):
            s = token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(i, lp) for i, lp in e.top_logprobs]}
                            for e in events]}

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        body = await body_of(http)
        prompt = protocol.chat_prompt(body, tokenizer)
        request = engine_request(body, prompt, chat=True)
        stops = protocol.stop_of(body)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = submit(request)
        stream = TextStream(tokenizer, stops)
        head = {"id": request.request_id, "created": int(time.time()), "model": model_name}

        if body.get("stream"):
            async def sse():
                role = {"role": "assistant", "content": ""}
                yield f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', 'choices': [{'index': 0, 'delta': role, 'finish_reason': None}]})}\n\n"
                n = 0
                async for event, text, reason in events_of(request, events, http, stream):
                    n += 1
                    choice = {"index": 0, "delta": {"content": text}, "token_ids": [event.token],
                              "finish_reason": reason, "logprobs": chat_logprobs(request, [event])}
                    yield f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', 'choices': [choice]})}\n\n"
                if include_usage:
                    tail = {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(request, n)}
                    yield f"data: {json.dumps(tail)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")

        got, text, reason = await collect(request, events, http, stream)
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": reason, "token_ids": [e.token for e in got],
                  "logprobs": chat_logprobs(request, got)}
        return {**head, "object": "chat.completion", "choices": [choice], "usage": usage(request, len(got))}

    return app
