"""Parallel layers of the optimized model; each owns its weights and loads its own shard."""
