"""OpenAI request bodies -> engine requests, with OpenAI-style errors that name the field.

Status codes: 400 a value the API does not allow (top_p out of range, a lone surrogate, a field this server does
not implement...), 422 a field of the wrong type or a missing required one, 413 a request that can never fit
(the body size, the prompt length, the context length, the KV pool, the prefill token budget). Nothing is
truncated or clamped, and no field that would change the output is silently ignored: the fields this server
does not implement are refused unless they hold their neutral value (see `UNSUPPORTED`).
"""

from __future__ import annotations

import numbers
import re

from optimized.executor.sampling import (
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)

MAX_TOP_LOGPROBS = 20
# Below this temperature sampling is greedy (argmax), as other OpenAI-compatible servers do: dividing logits by a
# smaller one overflows float32 (temperature 1e-300 made every logit inf and the draw NaN).
GREEDY_TEMPERATURE = 1e-5
MAX_SEED = 2**64 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_CHOICES = 64  # prompts x n of one request (each choice is one engine request)

# field -> (is its value neutral?, what is allowed): refused with a 400 naming the field otherwise.
UNSUPPORTED = {
    "suffix": (lambda v: v == "", '"" (no suffix)'),
    "tools": (lambda v: v == [], "[] (no tools)"),
    "tool_choice": (lambda v: v == "none", '"none"'),
    "functions": (lambda v: v == [], "[] (no functions)"),
    "function_call": (lambda v: v == "none", '"none"'),
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"}'),
}


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
    ok = isinstance(value, types) and not (
        isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,))
    )
    if not ok:
        raise ApiError(422, f"'{key}' must be {what}, got {type(value).__name__} {str(value)[:60]!r}", key)
    return value


def lone_surrogate(value, path: str = "", depth: int = 0):
    """(path, index) of the first string in a parsed JSON body holding a lone surrogate (valid JSON, not valid
    Unicode: no tokenizer or encoder takes it), else None."""
    if depth > 64:
        return None
    if isinstance(value, str):
        hit = _SURROGATE.search(value)
        return (path or "body", hit.start()) if hit else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(k, str) and (hit := lone_surrogate(k, path or "body", depth + 1)):
            return hit
        hit = lone_surrogate(v, f"{path}[{k}]" if isinstance(k, int) else (f"{path}.{k}" if path else k), depth + 1)
        if hit:
            return hit
    return None


def check_unicode(body) -> None:
    hit = lone_surrogate(body)
    if hit is not None:
        path, i = hit
        raise ApiError(
            400,
            f"'{path}' is not valid Unicode: a lone surrogate at character {i} (UTF-16 halves must come in pairs)",
            path,
        )


def processors_of(body: dict, vocab_size: int | None = None) -> dict:
    """The logits processors' fields (optimized/executor/sampling.py states their meaning and order) as
    SamplingParams keywords; 400 naming the field for a value out of range. vocab_size None: token ids unchecked
    here (the engine checks them)."""
    out = {}
    for key in ("presence_penalty", "frequency_penalty"):
        v = _typed(body, key, numbers.Real, "a number", 0.0)
        if not -2 <= v <= 2:
            raise ApiError(400, f"'{key}' is {v}; allowed: -2 to 2", key)
        out[key] = float(v)
    r = _typed(body, "repetition_penalty", numbers.Real, "a number", 1.0)
    if not MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY:
        raise ApiError(
            400,
            f"'repetition_penalty' is {r}; allowed: {MIN_REPETITION_PENALTY:g} to {MAX_REPETITION_PENALTY:g} (1: off)",
            "repetition_penalty",
        )
    out["repetition_penalty"] = float(r)
    m = _typed(body, "min_tokens", int, "an integer", 0)
    if m < 0:
        raise ApiError(400, f"'min_tokens' is {m}; allowed: an integer >= 0 (and <= max_tokens)", "min_tokens")
    out["min_tokens"] = m
    bias = _typed(body, "logit_bias", dict, "an object mapping token ids (strings) to numbers", {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' has {len(bias)} entries; allowed: at most {MAX_LOGIT_BIAS}", "logit_bias")
    parsed = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ApiError(400, f"'logit_bias' key {key[:40]!r} is not a token id (a string of digits)", "logit_bias")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise ApiError(
                400, f"'logit_bias' token id {token} is outside the vocabulary [0, {vocab_size})", "logit_bias"
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ApiError(422, f"'logit_bias[{key}]' must be a number, got {type(value).__name__}", "logit_bias")
        if not -MAX_BIAS <= value <= MAX_BIAS:
            raise ApiError(400, f"'logit_bias[{key}]' is {value}; allowed: -{MAX_BIAS:g} to {MAX_BIAS:g}", "logit_bias")
        if token in parsed:
            raise ApiError(400, f"'logit_bias' names token id {token} twice", "logit_bias")
        parsed[token] = float(value)
    out["logit_bias"] = parsed
    return out


def sampling_of(body: dict, vocab_size: int | None = None) -> SamplingParams:
    processors = processors_of(body, vocab_size)
    temperature = _typed(body, "temperature", numbers.Real, "a number", 1.0)
    top_p = _typed(body, "top_p", numbers.Real, "a number", 1.0)
    top_k = _typed(body, "top_k", int, "an integer", 0)
    seed = seed_of(body)
    if not 0 <= temperature <= 2:
        raise ApiError(400, f"'temperature' is {temperature}; allowed: 0 (greedy) to 2", "temperature")
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' is {top_p}; allowed: (0, 1]", "top_p")
    if top_k < 0 and top_k != -1:
        raise ApiError(400, f"'top_k' is {top_k}; allowed: >= 0 (0 or -1: no limit)", "top_k")
    if temperature < GREEDY_TEMPERATURE:
        return SamplingParams(0.0, 0, 1.0, seed, **processors)
    return SamplingParams(float(temperature), max(top_k, 0), float(top_p), seed, **processors)


def seed_of(body: dict) -> int | None:
    seed = _typed(body, "seed", int, "an integer")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ApiError(400, f"'seed' is {seed}; allowed: an integer from 0 to 2**64 - 1 ({MAX_SEED})", "seed")
    return seed


def choice_seed(seed: int | None, i: int) -> int | None:
    """The seed of choice i of a request with `n` > 1: choice 0 samples with the request's seed, choice i with
    seed + i (mod 2**64), so every choice is reproducible alone as an n = 1 request with that seed."""
    return None if seed is None else (seed + i) % (MAX_SEED + 1)


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


def include_usage_of(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(
            422,
            f"'stream_options' must be an object such as {{\"include_usage\": true}}, got "
            f"{type(options).__name__} {str(options)[:60]!r}",
            "stream_options",
        )
    if body.get("stream") is not True:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise ApiError(
            400,
            f"'stream_options.{unknown[0]}' is not supported; allowed: include_usage",
            f"stream_options.{unknown[0]}",
        )
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise ApiError(
            422,
            f"'stream_options.include_usage' must be a boolean, got {type(usage).__name__}",
            "stream_options.include_usage",
        )
    if options.get("continuous_usage_stats"):
        raise ApiError(
            400,
            "'stream_options.continuous_usage_stats' is not supported; allowed: false",
            "stream_options.continuous_usage_stats",
        )
    return usage


def check_common(body, model_name: str, vocab_size: int | None = None) -> int:
    """The checks every route shares; returns n (choices per prompt)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_unicode(body)
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(422, "'model' is required: a string (GET /v1/models lists it)", "model")
    if model != model_name:
        raise ApiError(
            404, f"model {model!r} does not exist; this server serves {model_name!r}", "model", "model_not_found"
        )
    n = _typed(body, "n", int, "an integer", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"'n' is {n}; allowed: 1 to {MAX_CHOICES}", "n")
    best_of = _typed(body, "best_of", int, "an integer")
    if best_of is not None and best_of != n:
        raise ApiError(
            400,
            f"'best_of' is {best_of}; ranking candidates is not supported, allowed: equal to 'n' ({n}) or absent",
            "best_of",
        )
    _typed(body, "stream", bool, "a boolean", False)
    for key, (neutral, allowed) in UNSUPPORTED.items():
        value = body.get(key)
        if value is None:
            continue
        try:
            ok = neutral(value) and not isinstance(value, bool)
        except TypeError:
            ok = False
        if not ok:
            raise ApiError(400, f"'{key}' is not supported by this server (allowed: {allowed} or absent)", key)
    sampling_of(body, vocab_size)
    return n


def completion_prompts(body: dict) -> list:
    """The prompts of a /v1/completions body: each a string or a list of token ids (not yet tokenized)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(
            422, "'prompt' is required: a string, a list of token ids, or a non-empty list of either", "prompt"
        )
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            if not p:
                raise ApiError(400, f"'prompt[{i}]' is empty" if len(prompt) > 1 else "'prompt' is empty", "prompt")
        elif not (isinstance(p, list) and p and all(_is_id(t) for t in p)):
            raise ApiError(422, f"'prompt[{i}]' must be a non-empty string or a non-empty list of token ids", "prompt")
    return prompt


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def chat_messages(body: dict) -> list[dict]:
    """[{role, content}] with the content as one string; a content given as a list of text parts is joined with
    newlines. Other part types (images, audio) are refused."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(422, "'messages' is required: a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(
                422, f"messages[{i}] must be an object with a string 'role' and a 'content'", f"messages[{i}]"
            )
        if m["role"] not in ("system", "user", "assistant"):
            raise ApiError(
                400, f"messages[{i}].role is {m['role']!r}; allowed: system, user, assistant", f"messages[{i}].role"
            )
        for key in ("tool_calls", "function_call"):
            if m.get(key):
                raise ApiError(400, f"messages[{i}].{key} is not supported by this server", f"messages[{i}].{key}")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise ApiError(422, f"{where} must be an object with a 'type'", where)
                if part["type"] != "text":
                    raise ApiError(400, f"{where}.type is {part['type']!r}; allowed: 'text'", f"{where}.type")
                if not isinstance(part.get("text"), str):
                    raise ApiError(422, f"{where}.text must be a string", f"{where}.text")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise ApiError(
                422, f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content"
            )
        out.append({"role": m["role"], "content": content})
    return out


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


def special_tokens_of(body: dict) -> tuple[bool, bool]:
    """(skip_special_tokens, spaces_between_special_tokens), both true by default (as vLLM)."""
    skip = _typed(body, "skip_special_tokens", bool, "a boolean", True)
    spaces = _typed(body, "spaces_between_special_tokens", bool, "a boolean", True)
    return skip, spaces
