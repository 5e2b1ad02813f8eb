"""A worker: one model replica with its KV cache (worker.py), the runner that keeps each request's
state across steps, the flat mixed batch and the sampler."""
