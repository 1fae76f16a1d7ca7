"""The checkpoint's own tokenizer and stop ids, as the product uses them (independent of `reference.tokenizer`,
which the oracle keeps for itself: a tokenizer bug must not be shared by both sides of a comparison).

`CheckpointTokenizer.load(dir)` wraps `transformers.AutoTokenizer` (tokenizer.json / tokenizer_config.json);
None when the checkpoint ships no tokenizer (raw ids still work). Modes: `default` encodes the text as it is,
`chat` wraps it as one user message through the tokenizer's chat template with the generation prompt.
Every problem a user can fix raises PromptError naming the prompt, the file or the key, and the fix.
"""

from __future__ import annotations

from pathlib import Path

from optimized.model_loader.checkpoint_files import read_json
from optimized.errors import UsageError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_MODES = ("default", "chat")
EOS_SOURCES = ("generation_config.json", "config.json")  # the first that names eos_token_id wins


class PromptError(UsageError, ValueError):
    """A prompt or tokenizer file that cannot be used (the message names it and the fix)."""


def _require_utf8(text: str, what: str) -> None:
    # Non-UTF-8 command-line bytes reach Python as lone surrogates (U+DC80..U+DCFF).
    bad = next((i for i, ch in enumerate(text) if 0xD800 <= ord(ch) <= 0xDFFF), None)
    if bad is not None:
        code = ord(text[bad])
        byte = f"0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else repr(text[bad])
        raise PromptError(
            f"{what} is not valid UTF-8 (byte {byte} at character {bad}); pass UTF-8 text "
            f"or token ids with --prompt-ids"
        )


class CheckpointTokenizer:
    def __init__(self, hf_tokenizer, model_dir: Path):
        self.hf, self.model_dir = hf_tokenizer, model_dir

    @classmethod
    def load(cls, model_dir) -> "CheckpointTokenizer | None":
        model_dir = Path(model_dir)
        if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(model_dir), model_dir)
        except Exception as e:  # transformers raises OSError, ValueError, JSON errors ... for broken files
            raise PromptError(
                f"cannot load the tokenizer of {model_dir} ({type(e).__name__}: {e}); fix or remove "
                f"{' / '.join(TOKENIZER_FILES)}, or pass --prompt-ids"
            ) from None

    def encode(self, text: str, mode: str = "default", what: str = "the prompt") -> list[int]:
        _require_utf8(text, what)
        if mode not in TOKENIZER_MODES:
            raise PromptError(f"tokenizer mode {mode!r}; allowed: {', '.join(TOKENIZER_MODES)}")
        if mode == "default":
            return self.hf.encode(text)
        return self.encode_messages([{"role": "user", "content": text}], what)

    def encode_messages(self, messages: list[dict], what: str = "the messages") -> list[int]:
        """A conversation ([{role, content}]) through the chat template, with the generation prompt."""
        if not getattr(self.hf, "chat_template", None):
            raise PromptError(
                f"chat mode needs a chat template, and the tokenizer of {self.model_dir} has none "
                f"(tokenizer_config.json 'chat_template'); use tokenizer_mode default"
            )
        for i, m in enumerate(messages):
            _require_utf8(m["content"], f"{what}[{i}].content")
        wrapped = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.hf.encode(wrapped, add_special_tokens=False)  # the template already holds the specials

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids])


def encode_prompt(tokenizer: CheckpointTokenizer | None, text: str, mode: str, what: str) -> list[int]:
    """`tokenizer.encode`, with the error a text prompt gets when the checkpoint has no tokenizer."""
    if tokenizer is None:
        _require_utf8(text, what)
        raise PromptError(
            f"{what} is text but the checkpoint has no tokenizer ({' / '.join(TOKENIZER_FILES)}); "
            f"pass token ids with --prompt-ids"
        )
    return tokenizer.encode(text, mode, what)


def eos_token_ids(model_dir) -> list[int]:
    """The stop ids: generation_config.json's `eos_token_id`, else config.json's; [] when neither names one.

    A file that exists but cannot be read, or an id that is not a non-negative integer, is a PromptError naming
    the file: a silently ignored generation_config.json would let every request run to max_new_tokens.
    """
    for name in EOS_SOURCES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        data = read_json(path, PromptError, "fix or remove it, or pass --ignore-eos")
        eos = data.get("eos_token_id") if isinstance(data, dict) else None
        if eos is None:
            continue
        ids = eos if isinstance(eos, list) else [eos]
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise PromptError(f"{path}: eos_token_id must be a non-negative integer or a list of them; got {eos!r}")
        return list(ids)
    return []
