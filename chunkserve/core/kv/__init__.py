"""KV blocks: the pool with its LRU of cached blocks, and per-request block tables with the
prefix cache's hash chain on top."""
