"""Prefill/decode disaggregation, the worker's side: KV blocks out of one instance's pool,
over pyzmq, into another's (the scheduler's side is chunkserve/core/disagg/)."""
