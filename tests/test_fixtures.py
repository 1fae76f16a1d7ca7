"""Fixture checkpoints are deterministic and cached; configs keep the real models' structure; presets are
the released facts; the fixtures ship a real tokenizer (AutoTokenizer, chat template, EOS ids)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fixtures import checkpoints
from reference.tokenizer import decode, encode, eos_token_ids, load_tokenizer
from fixtures.presets import PRESETS, preset_config
from fixtures.tiny import TINY_CONFIGS, tiny_config
from reference.model import head_dim_of, is_sparse_layer


def _files(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_builder_is_deterministic(tmp_path, monkeypatch):
    """Two builds in two fresh cache roots give the same directory name and the same bytes."""
    built = []
    for root in ("a", "b"):
        monkeypatch.setenv("QWEN3_MOE_FIXTURE_CACHE", str(tmp_path / root))
        built.append(checkpoints.checkpoint("tiny-dense"))
    assert built[0].name == built[1].name
    assert built[0].parent != built[1].parent
    assert _files(built[0]) == _files(built[1])
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".building")]


def test_cache_hit_is_fast_and_returns_the_same_directory():
    first = checkpoints.checkpoint("tiny")
    start = time.perf_counter()
    again = checkpoints.checkpoint("tiny")
    assert again == first
    assert time.perf_counter() - start < 0.5


def test_hash_depends_on_config():
    hashes = {name: checkpoints.fixture_hash(name) for name in TINY_CONFIGS}
    assert len(set(hashes.values())) == len(hashes)
    assert checkpoints.fixture_hash("tiny") == checkpoints.fixture_hash("tiny")


def test_checkpoints_use_per_expert_names_and_shard():
    import json

    single, sharded = checkpoints.checkpoint("tiny"), checkpoints.checkpoint("tiny", sharded=True)
    assert (single / "model.safetensors").is_file() and not (single / "model.safetensors.index.json").exists()
    names = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.15.down_proj.weight" in names
    assert not [n for n in names if n.endswith("gate_up_proj")]
    assert len(set(names.values())) > 1


def test_fixture_weights_are_nontrivial():
    model = checkpoints.build_model("tiny")
    norm = model.model.layers[0].input_layernorm.weight
    assert (norm - 1).abs().max() > 0.1  # norms are exercised
    assert 0.05 < model.model.layers[0].mlp.gate.weight.std() < 0.2


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_tiny_configs_keep_the_real_structure(name):
    c = tiny_config(name)
    assert head_dim_of(c) != c.hidden_size // c.num_attention_heads  # head_dim is its own setting
    assert c.num_key_value_heads < c.num_attention_heads and c.num_attention_heads % c.num_key_value_heads == 0
    assert c.num_key_value_heads < 4  # fewer KV heads than attention-TP ranks 4 and 8: KV heads replicate
    assert 2 < c.num_experts_per_tok < 8 < c.num_experts  # top-k above EP degree 2, below EP degree 8
    assert not c.tie_word_embeddings
    assert c.rope_parameters["rope_type"] == "default"
    if name == "tiny-nonorm":
        assert c.rope_parameters["rope_theta"] == 10000.0 and c.norm_topk_prob is False
    else:
        assert c.rope_parameters["rope_theta"] == 1e6 and c.norm_topk_prob is True


def test_tiny_dense_has_a_dense_layer_from_each_mechanism_alone():
    c = tiny_config("tiny-dense")
    assert [is_sparse_layer(c, i) for i in range(c.num_hidden_layers)] == [False, False, False, True]
    assert c.mlp_only_layers == [1] and (1 + 1) % c.decoder_sparse_step == 0  # layer 1: mlp_only_layers only
    for i in (0, 2):  # decoder_sparse_step only
        assert i not in c.mlp_only_layers and (i + 1) % c.decoder_sparse_step != 0


def _params(c, active: bool) -> float:
    """Parameter count from the config (embedding + lm_head + attention + norms + router + experts)."""
    H, D = c.hidden_size, head_dim_of(c)
    attn = H * c.num_attention_heads * D * 2 + H * c.num_key_value_heads * D * 2 + 2 * D
    experts = (c.num_experts_per_tok if active else c.num_experts) * 3 * H * c.moe_intermediate_size
    layer = attn + experts + c.num_experts * H + 2 * H
    return 2 * c.vocab_size * H + c.num_hidden_layers * layer + H


@pytest.mark.parametrize("name, total, active", [("Qwen3-30B-A3B", 30.5e9, 3.3e9), ("Qwen3-235B-A22B", 235e9, 22e9)])
def test_presets_are_the_released_models(name, total, active):
    """The released parameter counts (model cards: 30.5B / 3.3B activated, 235B / 22B activated)."""
    c = preset_config(name)
    assert abs(_params(c, active=False) / total - 1) < 0.01
    assert abs(_params(c, active=True) / active - 1) < 0.03
    assert (c.vocab_size, head_dim_of(c), c.num_experts, c.num_experts_per_tok) == (151936, 128, 128, 8)
    assert (c.max_position_embeddings, c.rope_parameters["rope_theta"], c.rms_norm_eps) == (40960, 1e6, 1e-6)
    assert c.norm_topk_prob and not c.tie_word_embeddings and c.num_key_value_heads == 4
    assert c.mlp_only_layers == [] and c.decoder_sparse_step == 1


def test_preset_layer_cut():
    assert preset_config("Qwen3-235B-A22B", num_hidden_layers=2).num_hidden_layers == 2
    with pytest.raises(ValueError, match="num_hidden_layers=0"):
        preset_config("Qwen3-30B-A3B", num_hidden_layers=0)
    with pytest.raises(KeyError, match="no preset named"):
        preset_config("Qwen3-1T")
    assert set(PRESETS) == {"Qwen3-30B-A3B", "Qwen3-235B-A22B"}


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return load_tokenizer(checkpoints.checkpoint("tiny"))


def test_fixture_tokenizer_loads_like_a_released_checkpoint(tiny_tokenizer):
    path = checkpoints.checkpoint("tiny")
    assert (path / "tokenizer.json").is_file() and "chat_template" in (path / "tokenizer_config.json").read_text()
    assert len(tiny_tokenizer) == tiny_config("tiny").vocab_size  # every id a tiny model emits decodes
    text = "The capital of France is"
    ids = encode(tiny_tokenizer, text)
    assert len(ids) < len(text) // 2 and decode(tiny_tokenizer, ids) == text  # BPE merges, exact round trip
    chat = encode(tiny_tokenizer, "hi", "chat")
    assert decode(tiny_tokenizer, chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    special = tiny_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert eos_token_ids(path) == special and max(special) < len(tiny_tokenizer)


@given(st.text(max_size=40))
def test_fixture_tokenizer_round_trip(tiny_tokenizer, text):
    ids = encode(tiny_tokenizer, text)
    assert all(0 <= i < len(tiny_tokenizer) for i in ids)
    assert decode(tiny_tokenizer, ids) == text
