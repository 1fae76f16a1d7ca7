"""`model_config.model_path` resolved to a checkpoint directory: a directory as it is, `preset:NAME` (a released
model's config.json from the product's presets, random weights), `fixture:NAME` (a tiny test checkpoint).

`fixture:` reaches the repository's `fixtures/` package: this module is the product's only door to test data, and
it says plainly, when the package is not importable (an installed wheel), that it needs a source checkout.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from optimized import envs
from optimized.errors import UsageError
from optimized.model_loader.presets import PRESETS, preset_key

PRESET_CACHE_ENV = envs.PRESET_CACHE  # where preset:NAME writes its config.json (default ~/.cache)


def fixtures_module(module: str, what: str):
    """`fixtures.<module>` of the repository checkout, or a UsageError saying `what` needs one."""
    try:
        return importlib.import_module(f"fixtures.{module}")
    except ImportError:
        raise UsageError(
            f"{what} uses the repository's test fixtures (the `fixtures/` package), which are not "
            f"installed with the product: run from a source checkout's root (or put it on "
            f"PYTHONPATH), or give a checkpoint directory"
        ) from None


def fixture_config(name: str, what: str):
    """The Qwen3MoeConfig of tiny fixture `name`."""
    tiny = fixtures_module("tiny", what)
    if name not in tiny.FIXTURE_CONFIGS:
        raise UsageError(f"unknown fixture {name!r}; known fixtures: {', '.join(sorted(tiny.FIXTURE_CONFIGS))}")
    return tiny.tiny_config(name)


def preset_dir(name: str) -> Path:
    """A directory holding the config.json of preset `name` (written once; concurrent ranks write the same bytes)."""
    try:
        key = preset_key(name)
    except KeyError as e:
        raise UsageError(f"unknown preset {name!r}: {e.args[0]}") from None
    root = envs.preset_cache()
    final = root / key
    if not (final / "config.json").is_file():
        final.mkdir(parents=True, exist_ok=True)
        tmp = final / f".config.json.{os.getpid()}"
        tmp.write_text(json.dumps(PRESETS[key], indent=2, sort_keys=True) + "\n")
        os.replace(tmp, final / "config.json")  # atomic
    return final


def resolve_model_path(model_path: str, scheme: str | None, name: str) -> Path:
    if scheme == "fixture":
        fixture_config(name, f"model_path 'fixture:{name}'")  # the name checked first, clearly
        return fixtures_module("checkpoints", f"model_path 'fixture:{name}'").checkpoint(name)
    if scheme == "preset":
        return preset_dir(name)
    path = Path(model_path)
    if not path.exists():
        raise UsageError(
            f"model_path {model_path!r} does not exist; give a checkpoint directory (config.json, "
            f"safetensors, tokenizer), fixture:NAME or preset:NAME"
        )
    if not (path / "config.json").is_file():
        raise UsageError(
            f"model_path {model_path!r} is not a directory with a config.json (or use fixture:NAME / preset:NAME)"
        )
    return path
