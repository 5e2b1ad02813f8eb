"""Speculative decoding's scheduler side: who proposes draft tokens (n-gram lookup here, a
draft model in the worker), whether a request's drafts pay for the step time they add, and
how many fit the step's token budget and the KV pool (drafts.py)."""
