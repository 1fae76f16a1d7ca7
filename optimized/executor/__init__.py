"""Running the model: the runner (prefill / decode loop), paged KV cache, sampling, graph mode, compile cache."""
