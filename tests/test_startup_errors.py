"""Start-up and library errors name what is wrong: an empty prompt batch, a recipe file that is not valid YAML."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fixtures.recipe_configs import RECIPE_DIR_ENV, recipe_files
from optimized.executor.model_runner import ModelRunner


def test_generate_names_an_empty_batch():
    runner = SimpleNamespace(vocab_size=10, max_positions=64)  # what the check reads before any work
    with pytest.raises(ValueError, match="empty batch"):
        ModelRunner.generate(runner, [], 4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        ModelRunner.generate(runner, [[1], []], 4)


def test_a_recipe_file_that_is_not_yaml_is_named(tmp_path, monkeypatch):
    (tmp_path / "good.yaml").write_text("model_config: {dtype: bfloat16}\n")
    bad = tmp_path / "sub" / "bad.yaml"
    bad.parent.mkdir()
    bad.write_text("model_config:\n  dtype: [bfloat16\n")
    monkeypatch.setenv(RECIPE_DIR_ENV, str(tmp_path))
    with pytest.raises(ValueError) as e:
        recipe_files()
    assert str(bad) in str(e.value) and RECIPE_DIR_ENV in str(e.value)
    assert "<unicode string>" not in str(e.value)
