"""Speculative decoding's scheduler side: who proposes draft tokens (n-gram lookup here, a
draft model in the worker) and whether a request's drafts pay for the step time they add."""
