"""Model execution: the runner (batches, KV cache, buffers) and the sampler."""
