"""The endpoint side: an OpenAI-compatible `/v1` over HTTP (httpx), what it can return, and one greedy request.

Capabilities are detected, not assumed (`probe`):
- `echo`: completions with `echo` and `logprobs` return the logprob of every prompt token (and of each generated one);
- `prompt_logprobs`: the completions extension that returns them as `choices[0].prompt_logprobs`;
- `greedy`: neither; only the greedy continuation is compared (as text when the server takes no token-id prompt).
Token ids come from the choice's `token_ids` where a server returns them, else from `token_id:N` logprob tokens,
else from the text (the check then finds the reference tokens that spell it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import httpx


class EndpointError(ValueError):
    """Bad input: the message is one line naming what to change (exit status 2)."""


@dataclass
class Capabilities:
    model: str
    mode: str  # "echo", "prompt_logprobs" or "greedy"
    ids_prompt: bool  # takes a token-id list as the prompt
    token_ids: bool  # choices carry `token_ids`
    extra: dict = field(default_factory=dict)  # accepted extension fields sent with every request (ignore_eos)


@dataclass
class Reply:
    """One completion: the generated tokens (ids, or None with only the text), the text, and logprobs by position
    of the full sequence (prompt + generated; None where the endpoint gives none), each with its top-k."""

    prompt: list[int]
    tokens: list[int] | None
    text: str
    logprobs: list[float | None]
    top: list[dict | None]  # token text (or "id:N") -> logprob
    finish_reason: str | None
    completion_tokens: int | None = None


TOKEN_ID = re.compile(r"^token_id:(\d+)$")


class Endpoint:
    def __init__(self, url: str, timeout_s: float = 120.0):
        self.url = url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise EndpointError(f"--url {url!r} is not an http(s) URL; give the server's base like http://HOST:PORT/v1")
        self.http = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, route: str, body: dict | None = None) -> httpx.Response:
        try:
            return self.http.request(method, self.url + route, json=body)
        except httpx.TransportError as e:
            raise EndpointError(f"cannot reach {self.url}{route}: {type(e).__name__}: {e}") from None

    def models(self) -> list[str]:
        r = self._request("GET", "/models")
        if r.status_code != 200:
            raise EndpointError(f"{self.url}/models answered HTTP {r.status_code}: is --url the server's /v1 base?")
        try:
            return [m["id"] for m in r.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise EndpointError(f"{self.url}/models did not answer an OpenAI model list: {r.text[:200]!r}") from None

    def completion(self, caps: Capabilities | None, body: dict) -> httpx.Response:
        extra = caps.extra if caps else {}
        return self._request("POST", "/completions", {**extra, **body})

    # ------------------------------------------------------------------------------------------- probing

    def probe(self, served_model: str | None, prompt_ids: list[int], prompt_text: str, top_k: int) -> Capabilities:
        names = self.models()
        if served_model is None:
            if len(names) != 1:
                raise EndpointError(f"{self.url} serves {len(names)} models {names}; name one with --served-model")
            served_model = names[0]
        elif served_model not in names:
            raise EndpointError(f"{self.url} serves {names}, not {served_model!r}; give one of them to --served-model")
        base = {"model": served_model, "max_tokens": 1, "temperature": 0}
        extra = {"ignore_eos": True}
        r = self.completion(None, {**base, **extra, "prompt": prompt_ids})
        if r.status_code >= 400:
            extra = {}
            r = self.completion(None, {**base, "prompt": prompt_ids})
        ids_prompt = r.status_code < 400
        caps = Capabilities(served_model, "greedy", ids_prompt, False, extra)
        prompt = prompt_ids if ids_prompt else prompt_text
        if ids_prompt:
            caps.token_ids = "token_ids" in (r.json()["choices"][0] or {})
            r = self.completion(caps, {**base, "prompt": prompt, "echo": True, "logprobs": top_k})
            lp = _logprobs(r)
            if (
                lp
                and len(lp.get("token_logprobs") or []) >= len(prompt_ids)
                and any(v is not None for v in lp["token_logprobs"][1 : len(prompt_ids)])
            ):
                caps.mode = "echo"
                return caps
            r = self.completion(caps, {**base, "prompt": prompt, "prompt_logprobs": top_k})
            if r.status_code < 400 and isinstance(r.json()["choices"][0].get("prompt_logprobs"), list):
                caps.mode = "prompt_logprobs"
        else:
            r = self.completion(caps, {**base, "prompt": prompt})
            if r.status_code >= 400:
                raise EndpointError(
                    f"{self.url}/completions refused a greedy request for {served_model!r}: HTTP "
                    f"{r.status_code} {r.text[:200]!r}"
                )
        return caps

    # ---------------------------------------------------------------------------------------- one request

    def greedy(self, caps: Capabilities, prompt_ids: list[int], prompt_text: str, max_tokens: int, top_k: int) -> Reply:
        body = {
            "model": caps.model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "prompt": prompt_ids if caps.ids_prompt else prompt_text,
        }
        if caps.mode == "echo":
            body.update(echo=True, logprobs=top_k)
        elif caps.mode == "prompt_logprobs":
            body.update(prompt_logprobs=top_k, logprobs=top_k)
        r = self.completion(caps, body)
        if r.status_code >= 400:
            raise EndpointError(f"{self.url}/completions answered HTTP {r.status_code}: {r.text[:300]!r}")
        choice = r.json()["choices"][0]
        n = len(prompt_ids)
        lp = choice.get("logprobs") or {}
        values = list(lp.get("token_logprobs") or [])
        tops = list(lp.get("top_logprobs") or [])
        text = choice.get("text") or ""
        tokens = None
        if caps.token_ids and choice.get("token_ids") is not None:
            tokens = [int(t) for t in choice["token_ids"]]
            if caps.mode == "echo":
                if tokens[:n] != prompt_ids:
                    raise EndpointError(
                        f"the endpoint echoed prompt ids {tokens[:n]} for {prompt_ids}: it tokenizes "
                        "differently from the checkpoint (tokenizer mismatch)"
                    )
                tokens = tokens[n:]
        elif lp.get("tokens") and all(TOKEN_ID.match(str(t)) for t in lp["tokens"]):
            tokens = [int(TOKEN_ID.match(t).group(1)) for t in lp["tokens"]][n if caps.mode == "echo" else 0 :]
        if caps.mode == "echo":
            text = text[len(prompt_text) :] if text.startswith(prompt_text) else text
            logprobs, top = values, tops
        elif caps.mode == "prompt_logprobs":
            logprobs, top = [None], [None]
            for j, entry in enumerate(choice["prompt_logprobs"][1:n], start=1):
                logprobs.append(_chosen(entry, prompt_ids[j]))
                top.append({k: (v["logprob"] if isinstance(v, dict) else v) for k, v in (entry or {}).items()})
            logprobs += values
            top += tops
        else:
            logprobs, top = [None] * n, [None] * n
        usage = r.json().get("usage") or {}
        return Reply(
            prompt_ids, tokens, text, logprobs, top, choice.get("finish_reason"), usage.get("completion_tokens")
        )


def _logprobs(r: httpx.Response) -> dict | None:
    if r.status_code >= 400:
        return None
    try:
        return r.json()["choices"][0].get("logprobs")
    except (ValueError, KeyError, IndexError, AttributeError):
        return None


def _chosen(entry: dict | None, token: int) -> float | None:
    """The prompt token's own logprob in a prompt_logprobs entry ({token id: {logprob, ...}}, the actual token
    included beside the top-k)."""
    v = (entry or {}).get(str(token))
    return None if v is None else float(v["logprob"] if isinstance(v, dict) else v)
