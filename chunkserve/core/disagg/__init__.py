"""Prefill/decode disaggregation, the scheduler's side: which request's KV goes where, when,
and what happens when it cannot (timeouts, aborts, failures). No torch and no sockets: the
worker's side (chunkserve/worker/disagg/) moves the bytes."""
