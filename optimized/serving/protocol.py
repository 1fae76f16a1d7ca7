"""OpenAI request bodies -> engine requests, with OpenAI-style errors that name the field.

Status codes: 400 a value the API does not allow (n != 1, top_p out of range, an unknown model's prompt...),
422 a field of the wrong type or a missing required one, 413 a request that can never fit (context length,
KV pool, prefill token budget). Nothing is truncated or clamped.
"""
from __future__ import annotations

import numbers

from optimized.executor.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def _typed(body: dict, key: str, types, what: str, default=None):
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in (types if isinstance(types, tuple)
                                                                                    else (types,)))
    if not ok:
        raise ApiError(422, f"'{key}' must be {what}, got {type(value).__name__} {str(value)[:60]!r}", key)
    return value


def sampling_of(body: dict) -> SamplingParams:
    temperature = _typed(body, "temperature", numbers.Real, "a number", 1.0)
    top_p = _typed(body, "top_p", numbers.Real, "a number", 1.0)
    top_k = _typed(body, "top_k", int, "an integer", 0)
    seed = _typed(body, "seed", int, "an integer")
    if not 0 <= temperature <= 2:
        raise ApiError(400, f"'temperature' is {temperature}; allowed: 0 (greedy) to 2", "temperature")
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' is {top_p}; allowed: (0, 1]", "top_p")
    if top_k < 0 and top_k != -1:
        raise ApiError(400, f"'top_k' is {top_k}; allowed: >= 0 (0 or -1: no limit)", "top_k")
    if seed is not None and seed < 0:
        raise ApiError(400, f"'seed' is {seed}; allowed: a non-negative integer", "seed")
    return SamplingParams(float(temperature), max(top_k, 0), float(top_p), seed)


def max_tokens_of(body: dict, default: int, keys=("max_tokens",)) -> int:
    for key in keys:
        value = _typed(body, key, int, "an integer")
        if value is not None:
            if value < 1:
                raise ApiError(400, f"'{key}' is {value}; allowed: an integer >= 1", key)
            return value
    return default


def stop_of(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(422, "'stop' must be a string or a list of strings", "stop")
    if len(stop) > 4 or any(not s for s in stop):
        raise ApiError(400, f"'stop' has {len(stop)} entries; allowed: up to 4 non-empty strings", "stop")
    return stop


def check_common(body, model_name: str) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(422, "'model' is required: a string (GET /v1/models lists it)", "model")
    if model != model_name:
        raise ApiError(404, f"model {model!r} does not exist; this server serves {model_name!r}", "model",
                       "model_not_found")
    n = _typed(body, "n", int, "an integer", 1)
    if n != 1:
        raise ApiError(400, f"'n' is {n}; this server generates one choice per request (allowed: 1)", "n")
    _typed(body, "stream", bool, "a boolean", False)
    for key in ("presence_penalty", "frequency_penalty"):
        if _typed(body, key, numbers.Real, "a number", 0) != 0:
            raise ApiError(400, f"'{key}' is not supported (allowed: 0)", key)


def completion_prompt(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                          # a batch of one
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError(400, "'prompt' is text but the checkpoint has no tokenizer; send token ids", "prompt")
        if not prompt:
            raise ApiError(400, "'prompt' is empty", "prompt")
        return tokenizer.hf.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, f"'prompt' holds {len(prompt)} prompts; send one prompt per request", "prompt")
    raise ApiError(422, "'prompt' is required: a non-empty string or a non-empty list of token ids", "prompt")


def chat_prompt(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(422, "'messages' is required: a non-empty list of {role, content}", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ApiError(422, f"messages[{i}] must be an object with string 'role' and 'content'", f"messages[{i}]")
        if m["role"] not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}].role is {m['role']!r}; allowed: system, user, assistant",
                           f"messages[{i}].role")
    if tokenizer is None or not getattr(tokenizer.hf, "chat_template", None):
        raise ApiError(400, "this checkpoint has no chat template (tokenizer_config.json 'chat_template'); "
                            "use /v1/completions", "messages")
    text = tokenizer.hf.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                            tokenize=False, add_generation_prompt=True)
    return tokenizer.hf.encode(text, add_special_tokens=False)   # the template already holds the specials


def logprobs_of(body: dict, chat: bool) -> int | None:
    """Top-k logprobs per token, None when not asked."""
    if chat:
        if not _typed(body, "logprobs", bool, "a boolean", False):
            if body.get("top_logprobs") is not None:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        n = _typed(body, "top_logprobs", int, "an integer", 0)
        key = "top_logprobs"
    else:
        n = _typed(body, "logprobs", int, "an integer")
        if n is None:
            return None
        key = "logprobs"
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'{key}' is {n}; allowed: 0 to {MAX_TOP_LOGPROBS}", key)
    return n
