"""POST /v1/chat/completions: messages through the checkpoint's chat template, streamed by SSE or whole."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request as HttpRequest

from optimized.serving import protocol
from optimized.serving.generation import Choices, choices_of, collect, requests_of, run, sse, submit, usage
from optimized.serving.protocol import ApiError
from optimized.serving.routes import pd
from optimized.serving.state import ServerState, state_of

router = APIRouter()


def chat_logprobs(state: ServerState, request, events):
    if request.logprobs is None:
        return None

    def entry(t, lp):
        s = state.token_text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {
        "content": [
            {**entry(e.token, e.logprob), "top_logprobs": [entry(i, lp) for i, lp in e.top_logprobs]} for e in events
        ]
    }


def chat_tokens(tokenizer, messages) -> list[int]:
    text = tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.hf.encode(text, add_special_tokens=False)  # the template already holds the specials


async def prompt_of(state: ServerState, body: dict, n: int) -> list[int]:
    """The templated prompt's ids; every field is checked first: tokenizing runs off the loop."""
    messages = protocol.chat_messages(body)
    if n > state.max_choices:
        raise ApiError(400, f"'n' is {n}; allowed: at most {state.max_choices}", "n")
    protocol.stop_of(body)
    protocol.include_usage_of(body)
    protocol.special_tokens_of(body)
    if state.tokenizer is None or not getattr(state.tokenizer.hf, "chat_template", None):
        raise ApiError(
            400,
            "this checkpoint has no chat template (tokenizer_config.json 'chat_template'); use /v1/completions",
            "messages",
        )
    state.check_chars(sum(len(m["content"]) for m in messages), "messages")
    prompt = await state.off_loop(chat_tokens, state.tokenizer, messages)
    state.check_tokens(prompt, "messages")
    return prompt


def stream_chunks(state: ServerState, choices: Choices, events, http, include_usage: bool):
    async def chunks():
        for c in choices:
            role = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            yield {"object": "chat.completion.chunk", "choices": [role]}
        total = 0
        async for c, event, text, reason in run(state, choices, events, http):
            total += 1
            choice = {
                "index": c.index,
                "delta": {"content": text},
                "token_ids": [event.token],
                "finish_reason": reason,
                "logprobs": chat_logprobs(state, c.request, [event]),
            }
            yield {"object": "chat.completion.chunk", "choices": [choice]}
        if include_usage:
            yield {"object": "chat.completion.chunk", "choices": [], "usage": usage(choices, total)}

    return chunks()


def whole_choices(state: ServerState, choices: Choices) -> list[dict]:
    return [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": "".join(c.text)},
            "finish_reason": c.reason,
            "token_ids": [e.token for e in c.events],
            "logprobs": chat_logprobs(state, c.request, c.events),
        }
        for c in choices
    ]


@router.post("/v1/chat/completions")
async def chat_completions(http: HttpRequest):
    state = state_of(http)
    body, n = await state.body_of(http)
    remote = pd.params_of(state, body)  # prefill-decode disaggregation: this instance's side of the hand-off
    prompt = await prompt_of(state, body, n)
    base, requests = requests_of(state, body, [prompt], n, chat=True)
    if pd.prefills(remote):
        pd.hold(requests)
    choices = choices_of(state, body, requests, n)
    events = await pd.take_over(state, http, remote, requests) if remote else submit(state.driver, requests)
    head = {"id": base, "created": int(time.time()), "model": state.model_name}
    if body.get("stream"):
        return sse(head, stream_chunks(state, choices, events, http, protocol.include_usage_of(body)))
    await collect(state, choices, events, http)
    out = await state.off_loop(whole_choices, state, choices)
    usage_ = usage(choices, sum(len(c.events) for c in choices))
    return pd.with_result(
        state, {**head, "object": "chat.completion", "choices": out, "usage": usage_}, remote, choices
    )
