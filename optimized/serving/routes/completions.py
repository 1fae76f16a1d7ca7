"""POST /v1/completions: text or token-id prompts (or a list of either: one choice per prompt x n), echo, logprobs
with text offsets, streamed by SSE or whole."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request as HttpRequest

from optimized.serving import protocol
from optimized.serving.generation import Choice, Choices, choices_of, collect, requests_of, run, sse, submit, usage
from optimized.serving.protocol import ApiError
from optimized.serving.routes import pd
from optimized.serving.state import ServerState, state_of
from optimized.serving.text import Detokenizer

router = APIRouter()


def completion_logprobs(state: ServerState, c: Choice, events, offsets, echo_prompt: bool):
    request, text_of = c.request, state.token_text
    if request.logprobs is None:
        return None
    tokens, values, tops, starts = [], [], [], []
    if echo_prompt:
        tokens.append(text_of(request.prompt[0]))
        values.append(None)
        tops.append(None)
        for t, (v, top) in zip(request.prompt[1:], request.prompt_logprob_values or []):
            tokens.append(text_of(t))
            values.append(v)
            tops.append({text_of(i): lp for i, lp in top})
        starts += c.prompt_offsets
    for e in events:
        tokens.append(text_of(e.token))
        values.append(e.logprob)
        tops.append({text_of(i): lp for i, lp in e.top_logprobs})
    starts += [len(c.prompt_text) + o for o in offsets]
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": starts}


def echo_texts(tokenizer, prompt: list[int]) -> tuple[str, list[int]]:
    """The prompt's text and the offset in it where each prompt token's text begins."""
    detok, text, offsets = Detokenizer(tokenizer.decode), "", []
    for t in prompt:
        offsets.append(len(text))
        text += detok.add(t)
    return tokenizer.decode(prompt), offsets


async def prompts_of(state: ServerState, body: dict, n: int) -> list[list[int]]:
    """The prompts' token ids; every field is checked first: the one costly step, tokenizing, runs off the loop."""
    raw = protocol.completion_prompts(body)
    if len(raw) * n > state.max_choices:
        raise ApiError(
            400,
            f"{len(raw)} prompts x n={n} is {len(raw) * n} choices; allowed: at most {state.max_choices} per request",
            "n" if n > 1 else "prompt",
        )
    if protocol.stop_of(body) and state.tokenizer is None:
        raise ApiError(400, "'stop' strings need the checkpoint's tokenizer", "stop")
    protocol.include_usage_of(body)
    protocol.special_tokens_of(body)
    if any(isinstance(p, str) for p in raw) and state.tokenizer is None:
        raise ApiError(400, "'prompt' is text but the checkpoint has no tokenizer; send token ids", "prompt")
    for p in raw:
        if isinstance(p, str):
            state.check_chars(len(p), "prompt")
    hf = state.tokenizer.hf if state.tokenizer is not None else None
    prompts = await state.off_loop(lambda: [hf.encode(p) if isinstance(p, str) else list(p) for p in raw])
    for p in prompts:
        state.check_tokens(p, "prompt")
    return prompts


def stream_chunks(state, choices, events, http, echo: bool, include_usage: bool):
    async def chunks():
        total = 0
        async for c, event, text, reason in run(state, choices, events, http):
            first = not c.events
            c.events.append(event)
            total += 1
            choice = {
                "index": c.index,
                "text": (c.prompt_text if first else "") + text,
                "token_ids": ([*c.request.prompt] if first and echo else []) + [event.token],
                "finish_reason": reason,
                "logprobs": completion_logprobs(state, c, [event], c.offsets[-1:], echo and first),
            }
            yield {"choices": [choice]}
        if include_usage:
            yield {"choices": [], "usage": usage(choices, total)}

    return chunks()


def whole_choices(state: ServerState, choices: Choices, echo: bool) -> list[dict]:
    """On the worker thread: the logprobs' token texts decode every token."""
    return [
        {
            "index": c.index,
            "text": c.prompt_text + "".join(c.text),
            "finish_reason": c.reason,
            "token_ids": ([*c.request.prompt] if echo else []) + [e.token for e in c.events],
            "logprobs": completion_logprobs(state, c, c.events, c.offsets, echo),
        }
        for c in choices
    ]


@router.post("/v1/completions")
async def completions(http: HttpRequest):
    state = state_of(http)
    body, n = await state.body_of(http)
    remote = pd.params_of(state, body)  # prefill-decode disaggregation: this instance's side of the hand-off
    prompts = await prompts_of(state, body, n)
    echo = body.get("echo") is True
    base, requests = requests_of(state, body, prompts, n, chat=False)
    if pd.prefills(remote):
        pd.hold(requests)
    choices = choices_of(state, body, requests, n)
    if echo and state.tokenizer is not None:
        texts = await state.off_loop(lambda: [echo_texts(state.tokenizer, p) for p in prompts])
        for c in choices:
            c.prompt_text, c.prompt_offsets = texts[c.index // n]
    events = await pd.take_over(state, http, remote, requests) if remote else submit(state.driver, requests)
    head = {"id": base, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
    if body.get("stream"):
        return sse(head, stream_chunks(state, choices, events, http, echo, protocol.include_usage_of(body)))
    await collect(state, choices, events, http)
    out = await state.off_loop(whole_choices, state, choices, echo)
    result = {**head, "choices": out, "usage": usage(choices, sum(len(c.events) for c in choices))}
    return pd.with_result(state, result, remote, choices)
