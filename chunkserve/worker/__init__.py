"""Where tensors live: the KV cache, the flat batch, attention, the sampler, the runner."""
