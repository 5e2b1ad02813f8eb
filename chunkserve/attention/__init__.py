"""Attention over the paged KV cache for a flat mixed batch: its metadata and backends
(torch SDPA over gathered keys, or the C++ ops reading the cache in place)."""
