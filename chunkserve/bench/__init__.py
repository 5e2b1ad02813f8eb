"""Benchmark clients that measure a running server from the outside, over HTTP."""
