"""Checkpoint reading: safetensors files and per-rank sources, the HF config, the W4A8 / W8A8 converter, model build."""
