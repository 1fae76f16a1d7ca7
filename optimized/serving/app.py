"""The OpenAI-compatible HTTP routes over a `Driver` (FastAPI).

`build_app(driver, tokenizer, ...)` -> a FastAPI app with /v1/completions and /v1/chat/completions (JSON, or SSE
ending `data: [DONE]`), /v1/models, /v1/models/{id}, /health, /metrics. Contract: limits come before any work (body
size, then every field, then a text prompt's length in characters, then tokenizing off the event loop on one worker
thread, which also detokenizes); one choice is one engine request (choice index = prompt index * n + j, choice j
seeded by `protocol.choice_seed(seed, j)`); each choice carries `token_ids`; a client that goes away aborts its
requests; a request that fails alone gets a JSON error, or an SSE `error` event then `data: [DONE]` once streaming,
and nothing else fails with it. Fields and status codes: docs/serving.md.
"""

import asyncio
import functools
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from optimized.executor.engine import RequestTooLarge
from optimized.executor.scheduler import Request
from optimized.serving import protocol
from optimized.serving.driver import EngineStopped
from optimized.serving.protocol import ApiError
from optimized.serving.text import Detokenizer, TextStream

POLL_S = 1.0  # how often a waiting non-streaming handler checks that its client is still there
MAX_BODY_BYTES = 16 * 1024 * 1024  # the default request body limit


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token can stand for: the longest vocabulary entry (special tokens included). A
    byte-level BPE entry spells one byte per character, so this also bounds its decoded characters."""
    return max(map(len, tokenizer.hf.get_vocab()), default=1) if tokenizer is not None else 1


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


def build_app(
    driver,
    tokenizer,
    model_name: str,
    *,
    stop_ids=(),
    default_max_tokens: int = 16,
    max_prompt_tokens=None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_choices: int = protocol.MAX_CHOICES,
    vocab_size: int | None = None,
):
    """max_prompt_tokens: the longest prompt accepted (data_config.input_max_len); longer ones get 413.
    max_body_bytes: the largest request body (413). max_choices: prompts x n of one request (400).
    vocab_size: the model's (logit_bias token ids are checked against it); None: the driver's engine's."""
    if vocab_size is None:
        vocab_size = getattr(getattr(getattr(driver, "engine", None), "runner", None), "vocab_size", None)
    app = FastAPI(title="qwen3-moe-npu", docs_url=None, redoc_url=None)
    created = int(time.time())
    max_prompt_chars = max_prompt_tokens * max_chars_per_token(tokenizer) if max_prompt_tokens else None
    worker = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    app.state.max_prompt_chars = max_prompt_chars

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(worker, functools.partial(fn, *args))

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e):
        return JSONResponse(ApiError(422, str(e)).body(), status_code=422)

    @app.exception_handler(Exception)
    async def _unexpected(_, e):  # a bug: still an OpenAI-style JSON error, and the server goes on
        return JSONResponse(error_of(e).body(), status_code=500)

    @app.get("/health")
    async def health():
        if driver.error is not None:
            return JSONResponse({"status": "error", "error": f"{type(driver.error).__name__}: {driver.error}"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(driver.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card():
        return {"id": model_name, "object": "model", "created": created, "owned_by": "qwen3-moe-npu"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise ApiError(
                404, f"model {model_id!r} does not exist; this server serves {model_name!r}", "model", "model_not_found"
            )
        return model_card()

    async def body_of(http: HttpRequest) -> tuple[dict, int]:
        """The parsed body and n; 413 as soon as the body is longer than the limit (before reading the rest)."""
        length = http.headers.get("content-length")
        too_big = ApiError(413, f"the request body is larger than the server's limit of {max_body_bytes} bytes")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            raise too_big
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise too_big
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        return body, protocol.check_common(body, model_name, vocab_size)

    def check_chars(n_chars: int, param: str) -> None:
        if max_prompt_chars is not None and n_chars > max_prompt_chars:
            raise ApiError(
                413,
                f"the prompt has {n_chars} characters: more than data_config.input_max_len="
                f"{max_prompt_tokens} tokens can hold (at most {max_prompt_chars // max_prompt_tokens}"
                f" characters per token)",
                param,
            )

    def check_tokens(prompt: list[int], param: str) -> None:
        if max_prompt_tokens is not None and len(prompt) > max_prompt_tokens:
            raise ApiError(
                413,
                f"the prompt has {len(prompt)} tokens, more than the server's limit "
                f"data_config.input_max_len={max_prompt_tokens}",
                param,
            )

    def requests_of(body: dict, prompts: list[list[int]], n: int, chat: bool) -> tuple[str, list[Request]]:
        keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        max_tokens = protocol.max_tokens_of(body, default_max_tokens, keys)
        sampling = protocol.sampling_of(body, vocab_size)
        if sampling.min_tokens > max_tokens:
            raise ApiError(
                400,
                f"'min_tokens' is {sampling.min_tokens}, more than the request's max tokens ({max_tokens})",
                "min_tokens",
            )
        logprobs = protocol.logprobs_of(body, chat)
        echo = not chat and protocol._typed(body, "echo", bool, "a boolean", False)
        ignore_eos = protocol._typed(body, "ignore_eos", bool, "a boolean", False)
        base = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        out = []
        for p, prompt in enumerate(prompts):
            for j in range(n):
                s = sampling if sampling.greedy else replace(sampling, seed=protocol.choice_seed(sampling.seed, j))
                out.append(
                    Request(
                        f"{base}-{p * n + j}",
                        prompt,
                        max_tokens,
                        s,
                        frozenset(() if ignore_eos else stop_ids),
                        logprobs,
                        prompt_logprobs=echo and logprobs is not None,
                    )
                )
        return base, out

    def submit(requests: list[Request]) -> asyncio.Queue:
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

    async def run(choices: list[Choice], events: asyncio.Queue, http: HttpRequest):
        """(choice, event, new text, finish reason or None) until every choice finished; aborts the unfinished ones
        when the client leaves, a stop string hits, one fails or the handler is cancelled. The events waiting on the
        queue are detokenized together on the worker thread, never on the event loop."""
        left = len(choices)
        try:
            while left:
                try:
                    first = await asyncio.wait_for(events.get(), POLL_S)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return
                    continue
                batch = [first]
                while not events.empty():
                    batch.append(events.get_nowait())
                batch = [(choices[k], item) for k, item in batch]
                texts = await off_loop(detokenize, batch)
                for (c, item), done in zip(batch, texts):
                    if c.ended:
                        continue
                    if isinstance(item, BaseException):  # the driver is done with it
                        c.ended = True
                        raise error_of(item)
                    if isinstance(done, Exception):
                        raise ApiError(
                            500, f"detokenizing failed: {type(done).__name__}: {done}", kind="server_error"
                        ) from None
                    c.request = item.request  # the engine's copy (with_seed): its prompt logprobs
                    offset, text, stopped = done
                    c.offsets.append(offset)
                    # read here, on the event: the engine thread may already be past this token
                    reason = "stop" if stopped else (item.request.finish_reason if item.finished else None)
                    if reason is not None:
                        left -= 1
                        c.ended = True
                        if not item.finished:  # a stop string: the engine would go on
                            driver.abort(c.request.request_id, "stop")
                    yield c, item, text, reason
        finally:
            for c in choices:
                if not c.ended:
                    c.ended = True
                    driver.abort(c.request.request_id)

    async def collect(choices, events, http):
        async for c, event, text, reason in run(choices, events, http):
            c.events.append(event)
            c.text.append(text)
            c.reason = reason

    def sse(head: dict, chunks):
        """The SSE body: each chunk, `data: [DONE]`; an error after the headers went out is an `error` event."""

        async def body():
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps({**head, **chunk})}\n\n"
            except Exception as e:  # noqa: BLE001 - the status line is gone: tell the client in the stream
                yield f"event: error\ndata: {json.dumps(error_of(e).body())}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    def token_text(t: int) -> str:
        return tokenizer.decode([t]) if tokenizer is not None else ""

    def usage(choices: "Choices", completion_tokens: int) -> dict:
        prompt = sum(len(c.request.prompt) for c in choices[:: choices.n])  # each prompt once, whatever n
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    # ---- /v1/completions
    def completion_logprobs(c: Choice, events, offsets, echo_prompt: bool):
        request = c.request
        if request.logprobs is None:
            return None
        tokens, values, tops, starts = [], [], [], []
        if echo_prompt:
            tokens.append(token_text(request.prompt[0]))
            values.append(None)
            tops.append(None)
            for t, (v, top) in zip(request.prompt[1:], request.prompt_logprob_values or []):
                tokens.append(token_text(t))
                values.append(v)
                tops.append({token_text(i): lp for i, lp in top})
            starts += c.prompt_offsets
        for e in events:
            tokens.append(token_text(e.token))
            values.append(e.logprob)
            tops.append({token_text(i): lp for i, lp in e.top_logprobs})
        starts += [len(c.prompt_text) + o for o in offsets]
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": starts}

    def echo_texts(prompt: list[int]) -> tuple[str, list[int]]:
        """The prompt's text and the offset in it where each prompt token's text begins."""
        detok, text, offsets = Detokenizer(tokenizer.decode), "", []
        for t in prompt:
            offsets.append(len(text))
            text += detok.add(t)
        return tokenizer.decode(prompt), offsets

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body, n = await body_of(http)
        raw = protocol.completion_prompts(body)
        if len(raw) * n > max_choices:
            raise ApiError(
                400,
                f"{len(raw)} prompts x n={n} is {len(raw) * n} choices; allowed: at most {max_choices} per request",
                "n" if n > 1 else "prompt",
            )
        stops, echo = protocol.stop_of(body), body.get("echo") is True
        if stops and tokenizer is None:
            raise ApiError(400, "'stop' strings need the checkpoint's tokenizer", "stop")
        include_usage = protocol.include_usage_of(body)
        if any(isinstance(p, str) for p in raw) and tokenizer is None:
            raise ApiError(400, "'prompt' is text but the checkpoint has no tokenizer; send token ids", "prompt")
        for p in raw:
            if isinstance(p, str):
                check_chars(len(p), "prompt")
        # every field is checked: the one costly step, tokenizing, runs off the event loop
        prompts = await off_loop(lambda: [tokenizer.hf.encode(p) if isinstance(p, str) else list(p) for p in raw])
        for p in prompts:
            check_tokens(p, "prompt")
        base, requests = requests_of(body, prompts, n, chat=False)
        choices = Choices(Choice(k, r, TextStream(tokenizer, stops)) for k, r in enumerate(requests))
        choices.n = n
        if echo and tokenizer is not None:
            texts = await off_loop(lambda: [echo_texts(p) for p in prompts])
            for c in choices:
                c.prompt_text, c.prompt_offsets = texts[c.index // n]
        events = submit(requests)
        head = {"id": base, "object": "text_completion", "created": int(time.time()), "model": model_name}

        if body.get("stream"):

            async def chunks():
                total = 0
                async for c, event, text, reason in run(choices, events, http):
                    first = not c.events
                    c.events.append(event)
                    total += 1
                    choice = {
                        "index": c.index,
                        "text": (c.prompt_text if first else "") + text,
                        "token_ids": ([*c.request.prompt] if first and echo else []) + [event.token],
                        "finish_reason": reason,
                        "logprobs": completion_logprobs(c, [event], c.offsets[-1:], echo and first),
                    }
                    yield {"choices": [choice]}
                if include_usage:
                    yield {"choices": [], "usage": usage(choices, total)}

            return sse(head, chunks())

        await collect(choices, events, http)
        # the logprobs' token texts decode every token: off the event loop, like the completion's text
        out = await off_loop(
            lambda: [
                {
                    "index": c.index,
                    "text": c.prompt_text + "".join(c.text),
                    "finish_reason": c.reason,
                    "token_ids": ([*c.request.prompt] if echo else []) + [e.token for e in c.events],
                    "logprobs": completion_logprobs(c, c.events, c.offsets, echo),
                }
                for c in choices
            ]
        )
        return {**head, "choices": out, "usage": usage(choices, sum(len(c.events) for c in choices))}

    # ---- /v1/chat/completions
    def chat_logprobs(request, events):
        if request.logprobs is None:
            return None

        def entry(t, lp):
            s = token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {
            "content": [
                {**entry(e.token, e.logprob), "top_logprobs": [entry(i, lp) for i, lp in e.top_logprobs]}
                for e in events
            ]
        }

    def chat_tokens(messages) -> list[int]:
        text = tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.hf.encode(text, add_special_tokens=False)  # the template already holds the specials

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        body, n = await body_of(http)
        messages = protocol.chat_messages(body)
        if n > max_choices:
            raise ApiError(400, f"'n' is {n}; allowed: at most {max_choices}", "n")
        stops = protocol.stop_of(body)
        include_usage = protocol.include_usage_of(body)
        if tokenizer is None or not getattr(tokenizer.hf, "chat_template", None):
            raise ApiError(
                400,
                "this checkpoint has no chat template (tokenizer_config.json 'chat_template'); use /v1/completions",
                "messages",
            )
        check_chars(sum(len(m["content"]) for m in messages), "messages")
        prompt = await off_loop(chat_tokens, messages)
        check_tokens(prompt, "messages")
        base, requests = requests_of(body, [prompt], n, chat=True)
        choices = Choices(Choice(k, r, TextStream(tokenizer, stops)) for k, r in enumerate(requests))
        choices.n = n
        events = submit(requests)
        head = {"id": base, "created": int(time.time()), "model": model_name}

        if body.get("stream"):

            async def chunks():
                for c in choices:
                    yield {
                        "object": "chat.completion.chunk",
                        "choices": [
                            {"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        ],
                    }
                total = 0
                async for c, event, text, reason in run(choices, events, http):
                    total += 1
                    choice = {
                        "index": c.index,
                        "delta": {"content": text},
                        "token_ids": [event.token],
                        "finish_reason": reason,
                        "logprobs": chat_logprobs(c.request, [event]),
                    }
                    yield {"object": "chat.completion.chunk", "choices": [choice]}
                if include_usage:
                    yield {"object": "chat.completion.chunk", "choices": [], "usage": usage(choices, total)}

            return sse(head, chunks())

        await collect(choices, events, http)
        out = await off_loop(
            lambda: [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": "".join(c.text)},
                    "finish_reason": c.reason,
                    "token_ids": [e.token for e in c.events],
                    "logprobs": chat_logprobs(c.request, c.events),
                }
                for c in choices
            ]
        )
        return {
            **head,
            "object": "chat.completion",
            "choices": out,
            "usage": usage(choices, sum(len(c.events) for c in choices)),
        }

    return app
