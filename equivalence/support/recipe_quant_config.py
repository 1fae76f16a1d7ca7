"""The recipe converter's config.json quantization_config as text (a template and its Linear group), for the
loaders' proofs on the tiny model."""

from __future__ import annotations

# The recipe converter's config.json quantization_config for w4a8c16 (spec mx_quant.md §8.3), as text, for the
# 2-layer tiny model: group_1 is group_0 with weights.num_bits 4 and targets ["MoEGMM"].
_ARGS = (
    '"actorder": null, "block_structure": null, "dynamic": %s, "group_size": 32, "num_bits": %d, '
    '"observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": true, "type": "float"'
)

_GROUP = (
    '{"input_activations": {%s}, "activation_use_clip": false, "output_activations": null, '
    '"targets": ["%s"], "weights": {%s}}'
)

RECIPE_QUANTIZATION_TEMPLATE = """{
  "config_groups": {%s},
  "format": "float-quantized",
  "global_compression_ratio": "null",
  "ignore": ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
             "model.layers.0.mlp.gate", "model.layers.0.self_attn.k_norm", "model.layers.0.self_attn.q_norm",
             "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm",
             "model.layers.1.mlp.gate", "model.layers.1.self_attn.k_norm", "model.layers.1.self_attn.q_norm",
             "lm_head", "model.embed_tokens", "model.norm"],
  "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "token", "group_size": -1,
                      "dynamic": "true", "symmetric": "true"},
  "quant_method": "compressed-tensors",
  "quantization_status": "compressed",
  "weight_block_size": [1, 32]
}"""  # %s: the config_groups entries

RECIPE_LINEAR_GROUP = _GROUP % (_ARGS % ("true", 8), "Linear", _ARGS % ("false", 8))
