"""Generated ids -> text as it streams: incremental detokenizing and stop strings.

The whole completion is decoded again at every token (a byte-level BPE token can end mid-character, so the text
of a token alone is not the text it adds). Text is released only when it can no longer change: not ending in
an incomplete character (U+FFFD) and not ending in a prefix of a stop string. A stop string ends the request;
the text up to it (the stop string excluded) is the completion."""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0           # characters already released
        self.stopped = False

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids) if self.tokenizer is not None else ""

    def add(self, token: int, last: bool) -> str:
        """The new text this token releases; sets `stopped` when a stop string appeared."""
        self.ids.append(token)
        text = self._text()
        hits = [text.find(s, max(self.sent - len(s) + 1, 0)) for s in self.stops]
        hits = [h for h in hits if h >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        elif last:
            end = len(text)
        else:
            end = len(text)
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            for s in self.stops:          # hold back a tail that may grow into a stop string
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if text[:end].endswith(s[:k]):
                        end -= k
                        break
        new = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return new
