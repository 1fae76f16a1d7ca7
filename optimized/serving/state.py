"""The one application state every route reads (`http.app.state.server`): the driver, the tokenizer, the limits, and
the worker thread that tokenizing and detokenizing run on (never on the event loop)."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request as HttpRequest

from optimized.serving import protocol
from optimized.serving.protocol import ApiError

MAX_BODY_BYTES = 16 * 1024 * 1024  # the default request body limit
BODY_TIMEOUT_S = 60.0  # --body-timeout: from the last header line to the body's last byte (408 after it)


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token can stand for: the longest vocabulary entry (special tokens included). A
    byte-level BPE entry spells one byte per character, so this also bounds its decoded characters."""
    return max(map(len, tokenizer.hf.get_vocab()), default=1) if tokenizer is not None else 1


@dataclass
class ServerState:
    """max_prompt_tokens: the longest prompt accepted (data_config.input_max_len); longer ones get 413.
    max_body_bytes: the largest request body (413). max_choices: prompts x n of one request (400).
    vocab_size: the model's (logit_bias token ids are checked against it). body_timeout_s: the longest a body may
    take to arrive after its headers (408 and the connection closed: a client trickling bytes holds nothing longer)."""

    driver: object
    tokenizer: object
    model_name: str
    stop_ids: tuple = ()
    default_max_tokens: int = 16
    max_prompt_tokens: int | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_choices: int = protocol.MAX_CHOICES
    vocab_size: int | None = None
    body_timeout_s: float = BODY_TIMEOUT_S
    pd: object = None  # prefill-decode disaggregation: the instance's `pd.instance.PdInstance` (routes/pd.py)
    created: int = field(default_factory=lambda: int(time.time()))
    worker: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize"))

    def __post_init__(self):
        if self.vocab_size is None:
            runner = getattr(getattr(self.driver, "engine", None), "runner", None)
            self.vocab_size = getattr(runner, "vocab_size", None)
        per_token = max_chars_per_token(self.tokenizer)
        self.max_prompt_chars = self.max_prompt_tokens * per_token if self.max_prompt_tokens else None

    async def off_loop(self, fn, *args):
        """fn(*args) on the worker thread (the tokenizer is not shared between threads)."""
        return await asyncio.get_running_loop().run_in_executor(self.worker, functools.partial(fn, *args))

    async def body_of(self, http: HttpRequest) -> tuple[dict, int]:
        """The parsed body and n; 413 as soon as the body is longer than the limit (before reading the rest)."""
        limit = self.max_body_bytes
        length = http.headers.get("content-length")
        too_big = ApiError(413, f"the request body is larger than the server's limit of {limit} bytes")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in http.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_big
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(
                408, f"the request body did not arrive within {self.body_timeout_s:g} s (the server's --body-timeout)"
            ) from None
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        return body, protocol.check_common(body, self.model_name, self.vocab_size)

    def check_chars(self, n_chars: int, param: str) -> None:
        """413 for a text prompt that cannot fit even at the tokenizer's longest token (checked before tokenizing)."""
        if self.max_prompt_chars is not None and n_chars > self.max_prompt_chars:
            raise ApiError(
                413,
                f"the prompt has {n_chars} characters: more than data_config.input_max_len="
                f"{self.max_prompt_tokens} tokens can hold (at most {self.max_prompt_chars // self.max_prompt_tokens}"
                f" characters per token)",
                param,
            )

    def check_tokens(self, prompt: list[int], param: str) -> None:
        if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
            raise ApiError(
                413,
                f"the prompt has {len(prompt)} tokens, more than the server's limit "
                f"data_config.input_max_len={self.max_prompt_tokens}",
                param,
            )

    def token_text(self, t: int) -> str:
        """One token's text as logprobs show it (special tokens keep their text there)."""
        return self.tokenizer.decode([t]) if self.tokenizer is not None else ""


def state_of(http: HttpRequest) -> ServerState:
    return http.app.state.server
