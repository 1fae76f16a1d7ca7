"""The checkpoint's own tokenizer for the CLIs (`transformers.AutoTokenizer` from the checkpoint directory:
tokenizer.json / tokenizer_config.json), the chat template, EOS ids, and the `--prompt-ids` parser.

Modes (`tokenizer_mode` in the optimized YAML, `--chat` on both CLIs): `default` encodes the prompt text
as it is; `chat` wraps it as one user message with the tokenizer's chat template and the assistant's
generation prompt. A checkpoint without tokenizer files still runs with `--prompt-ids` (raw token ids).
Every problem a user can fix raises PromptError with the reason and the fix.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_MODES = ("default", "chat")


class PromptError(ValueError):
    """A prompt that cannot be tokenized (the message names it and the fix)."""


def load_tokenizer(model_dir):
    """The checkpoint's tokenizer, or None when the directory ships none."""
    model_dir = Path(model_dir)
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # transformers raises many kinds (OSError, ValueError, JSON errors) for broken files
        raise PromptError(
            f"cannot load the tokenizer of {model_dir} ({type(e).__name__}: {e}); fix or remove "
            f"{' / '.join(TOKENIZER_FILES)}, or pass --prompt-ids"
        ) from None


def check_utf8(text: str, what: str) -> None:
    """Command-line bytes that are not UTF-8 reach Python as lone surrogates: refuse them, naming the byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = text[e.start]
        byte = f"0x{ord(raw) - 0xDC00:02x}" if 0xDC80 <= ord(raw) <= 0xDCFF else repr(raw)
        raise PromptError(
            f"{what} is not valid UTF-8 (byte {byte} at character {e.start}); pass UTF-8 text "
            f"or token ids with --prompt-ids"
        ) from None


def encode(tokenizer, text: str, mode: str = "default", what: str = "the prompt") -> list[int]:
    """Token ids of `text` (mode 'chat': as one user message through the chat template)."""
    check_utf8(text, what)
    if tokenizer is None:
        raise PromptError(
            f"{what} is text but the checkpoint has no tokenizer ({' / '.join(TOKENIZER_FILES)}); "
            f"pass token ids with --prompt-ids"
        )
    if mode == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError(
                "chat mode needs a chat template, and the checkpoint's tokenizer has none "
                "(tokenizer_config.json 'chat_template'); use tokenizer_mode default"
            )
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer.encode(text, add_special_tokens=False)
    if mode != "default":
        raise PromptError(f"tokenizer mode {mode!r}; allowed: {', '.join(TOKENIZER_MODES)}")
    return tokenizer.encode(text)


def decode(tokenizer, ids) -> str | None:
    """Text of `ids` (special tokens shown), or None without a tokenizer."""
    return None if tokenizer is None else tokenizer.decode([int(i) for i in ids])


def eos_token_ids(model_dir) -> list[int]:
    """EOS ids: generation_config.json's `eos_token_id`, else config.json's; [] when neither names one."""
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((Path(model_dir) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if eos is not None:
            return [eos] if isinstance(eos, int) else [int(i) for i in eos]
    return []


def parse_prompt_ids(text: str) -> list[int]:
    """argparse type for `--prompt-ids 1,2,3`."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,3; got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0; got {text!r}")
    return ids
