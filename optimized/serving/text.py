"""Generated ids -> text as it streams: incremental detokenizing and stop strings.

`TextStream(tokenizer, stops)`: `add(token, last) -> str` the text this token releases (sets `stopped` when a stop
string appeared; the completion is the text before it), `finish() -> str` what was held back when the request ends
on a token whose text is not shown (EOS). Text is released only when it can no longer change: not an incomplete
character and not a prefix of a stop string.

`Detokenizer` decodes only a short window of ids per token, never the whole completion: the window keeps a little
released context (a tokenizer's decode may depend on the token before), holds text ending in U+FFFD (a character
split over byte-level tokens) until later tokens complete it, and after `MAX_PENDING` held tokens is cut at the
newest boundary no open UTF-8 sequence crosses; a chain with no such boundary is released as it is after
`MAX_WINDOW` tokens. So a token costs a few decodes of at most `MAX_WINDOW` + 1 ids, and the streamed text equals
the whole completion's decode except in that last case.
"""

from __future__ import annotations

MAX_PENDING = 8
MAX_WINDOW = 64
REPLACEMENT = "\ufffd"


class Detokenizer:
    """ids -> stable text, incrementally (see the module docstring). `add(token)` returns the new stable text;
    `flush()` the rest (a final incomplete character as U+FFFD). `decoded` counts the ids decoded so far."""

    def __init__(self, decode):
        self._decode = decode
        self.ids: list[int] = []
        self.prefix = self.read = 0  # the window is ids[prefix:]; ids[prefix:read] is released context
        self.released = 0  # characters of decode(ids[prefix:]) released, the context's included
        self.decoded = 0

    def decode(self, ids) -> str:
        self.decoded += len(ids)
        return self._decode(ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._step(final=False)

    def flush(self) -> str:
        return self._step(final=True) if self.read < len(self.ids) else ""

    def _take(self, text: str, end: int) -> str:
        new = text[self.released : end] if end > self.released else ""
        self.released = max(self.released, end)
        return new

    def _step(self, final: bool) -> str:
        text = self.decode(self.ids[self.prefix :])
        pending = len(self.ids) - self.read
        if final or not text.endswith(REPLACEMENT) or pending >= MAX_WINDOW:
            new = self._take(text, len(text))  # all of it is final: slide
            self.prefix, self.read = self.read, len(self.ids)
            self.released = len(self.decode(self.ids[self.prefix : self.read]))
            return new
        new = self._take(text, len(text.rstrip(REPLACEMENT)))
        if pending >= MAX_PENDING:
            for k in range(len(self.ids) - 1, self.read, -1):  # the newest boundary no open sequence crosses
                head = self.decode(self.ids[self.prefix : k])
                if head + self.decode(self.ids[k:]) == text:
                    new += self._take(text, len(head))  # what is before k is final
                    self.released -= len(head)  # the window restarts at k, with no context
                    self.prefix = self.read = k
                    break
        return new


def special_ids(hf) -> frozenset[int]:
    """The ids of the tokenizer's special tokens: added tokens marked special, and the named ones (EOS, pad...)."""
    decoder = getattr(hf, "added_tokens_decoder", {}) or {}
    return frozenset(i for i, t in decoder.items() if getattr(t, "special", False)) | frozenset(hf.all_special_ids)


def text_decoder(tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
    """ids -> text as a request asked for it, through `tokenizer.decode`. skip_special_tokens: special tokens have no
    text (their ids are left out, as HF's decode with skip_special_tokens=True does). Kept, with
    spaces_between_special_tokens each special token's text is set apart by a space from the text on either side
    (HF's slow-tokenizer rule); without, their text is joined as the tokenizer decodes it."""
    specials = special_ids(tokenizer.hf)
    if skip_special_tokens:
        return lambda ids: tokenizer.decode([t for t in map(int, ids) if t not in specials])
    if not spaces_between_special_tokens:
        return tokenizer.decode

    def decode(ids) -> str:
        parts, run = [], []
        for t in map(int, ids):
            if t in specials:
                parts += [tokenizer.decode(run)] if run else []
                parts.append(tokenizer.decode([t]))
                run = []
            else:
                run.append(t)
        return " ".join(parts + ([tokenizer.decode(run)] if run else []))

    return decode


class TextStream:
    def __init__(self, tokenizer, stops: list[str], decode=None):
        """decode: ids -> text (`text_decoder`); None: the tokenizer's own decode."""
        self.stops = stops
        self.detok = Detokenizer(decode or tokenizer.decode) if tokenizer is not None else None
        self.text = ""  # stable text so far (held-back stop prefixes included)
        self.sent = 0  # characters released to the client
        self.stopped = False

    @property
    def offset(self) -> int:
        """Characters of stable text so far: where the next token's text begins (logprobs' text_offset)."""
        return len(self.text)

    def add(self, token: int, last: bool) -> str:
        """The new text this token releases; sets `stopped` when a stop string appeared."""
        if self.detok is None:
            return ""
        self.text += self.detok.add(token)
        if last:
            self.text += self.detok.flush()
        return self._release(last)

    def finish(self) -> str:
        """The text held back, released at the end of the request (on a token whose text is not shown)."""
        if self.detok is None or self.stopped:
            return ""
        self.text += self.detok.flush()
        return self._release(True)

    def _release(self, last: bool) -> str:
        text = self.text
        hits = [text.find(s, max(self.sent - len(s) + 1, 0)) for s in self.stops]
        hits = [h for h in hits if h >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        else:
            end = len(text)
            if not last:
                for s in self.stops:  # hold back a tail that may grow into a stop string
                    for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                        if text.endswith(s[:k], 0, end):
                            end -= k
                            break
        new = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return new
