"""The prompt sources of `data_config.dataset` that read files: `default` (a default_prompt.json) and `LongBench`.

Nothing is downloaded: both read a local directory (`data_config.dataset_path`), and a missing one is an error
that names the key and what the directory must hold.

- `default`: `<dataset_path>/default_prompt.json`, a JSON array of prompt strings or an object {"text": "..."}
  (the two forms the recipe's default prompt file has had). Without dataset_path: `data_config.prompts`.
- `LongBench`: the `context` field of every line of `<subset>.jsonl` (or `data/<subset>.jsonl`, the layout of the
  released archive) for the recipe's subsets, in its order. Each context becomes one summarisation request
  (`longbench_prompt`): the context's tokens cut so that instruction and context together fit
  `input_truncated_len` tokens, the recipe's rule, wrapped in an instruction and sent through the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from optimized.errors import UsageError

DEFAULT_PROMPT_FILE = "default_prompt.json"
# The recipe's LongBench subsets, in the order it reads them (the "_e" ones are LongBench-E).
LONGBENCH_SUBSETS = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "multifieldqa_zh",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "dureader",
    "gov_report",
    "qmsum",
    "multi_news",
    "vcsum",
    "trec",
    "triviaqa",
    "samsum",
    "lsht",
    "passage_count",
    "passage_retrieval_en",
    "passage_retrieval_zh",
    "lcc",
    "repobench-p",
) + tuple(
    f"{name}_e"
    for name in (
        "qasper",
        "multifieldqa_en",
        "hotpotqa",
        "2wikimqa",
        "gov_report",
        "multi_news",
        "trec",
        "triviaqa",
        "samsum",
        "passage_count",
        "passage_retrieval_en",
        "lcc",
        "repobench-p",
    )
)
# The instruction around each LongBench context (our wording; the recipe asks for a summary the same way).
LONGBENCH_HEAD = "Read the following passage, then summarise it.\n[passage]\n"
LONGBENCH_TAIL = "\n[end of passage]\n\nSummarise the passage above in at most {words} words.\n"


class DatasetError(UsageError, ValueError):
    """A dataset directory or file that cannot be read (the message names the key, the path and the fix)."""


def _directory(path: str, dataset: str) -> Path:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise DatasetError(f"data_config.dataset_path {path!r} (dataset {dataset}) is not a directory")
    return root


def load_default_prompts(path: str) -> list[str]:
    """The prompts of `<path>/default_prompt.json`."""
    file = _directory(path, "default") / DEFAULT_PROMPT_FILE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DatasetError(
            f"data_config.dataset_path {path!r}: no {DEFAULT_PROMPT_FILE} in it (dataset default "
            f"reads its prompts from that file)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{file}: cannot read it as JSON ({e})") from None
    prompts = [data["text"]] if isinstance(data, dict) and "text" in data else data
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise DatasetError(f'{file} must hold a non-empty JSON array of strings or an object {{"text": ...}}')
    return prompts


def load_longbench(path: str, log=print) -> list[str]:
    """Every context of the LongBench subsets found under `path`, in the recipe's order."""
    root = _directory(path, "LongBench")
    contexts, found = [], []
    for name in LONGBENCH_SUBSETS:
        file = next((f for f in (root / f"{name}.jsonl", root / "data" / f"{name}.jsonl") if f.is_file()), None)
        if file is None:
            continue
        found.append(name)
        with open(file, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    context = row["context"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise DatasetError(
                        f"{file} line {number}: not a JSON object with a 'context' field (LongBench format)"
                    ) from None
                if not isinstance(context, str):
                    raise DatasetError(f"{file} line {number}: 'context' must be a string")
                contexts.append(context)
    if not found:
        raise DatasetError(
            f"data_config.dataset_path {path!r}: no LongBench subset in it (expected files such as "
            f"{LONGBENCH_SUBSETS[0]}.jsonl or data/{LONGBENCH_SUBSETS[0]}.jsonl)"
        )
    if not contexts:
        raise DatasetError(f"data_config.dataset_path {path!r}: the LongBench files hold no contexts")
    log(f"LongBench: {len(contexts)} context(s) from {len(found)} of {len(LONGBENCH_SUBSETS)} subsets in {root}")
    return contexts


def longbench_prompt(tokenizer, context: str, truncated_len: int, max_new_tokens: int) -> list[int]:
    """One LongBench request as token ids: instruction + the context cut to fit + instruction tail, through the chat
    template when the tokenizer has one. The context keeps its first tokens, as many as `truncated_len` leaves
    once the instruction is counted (the recipe's rule); an instruction that alone exceeds it is an error."""
    mode = "chat" if getattr(tokenizer.hf, "chat_template", None) else "default"
    tail = LONGBENCH_TAIL.format(words=max_new_tokens)
    overhead = len(tokenizer.encode(LONGBENCH_HEAD + tail, mode, "the LongBench instruction"))
    room = truncated_len - overhead
    if room < 1:
        raise DatasetError(
            f"data_config.input_truncated_len ({truncated_len}) leaves no room for a LongBench "
            f"context: the instruction alone is {overhead} tokens"
        )
    ids = tokenizer.hf.encode(context, add_special_tokens=False)[:room]
    text = LONGBENCH_HEAD + tokenizer.hf.decode(ids, skip_special_tokens=True) + tail
    return tokenizer.encode(text, mode, "a LongBench prompt")


def truncate(prompts: list[list[int]], length: int) -> tuple[list[list[int]], int]:
    """Each prompt cut to its first `length` tokens (data_config.input_truncated_len), and how many were cut."""
    cut = sum(len(p) > length for p in prompts)
    return [p[:length] for p in prompts], cut
