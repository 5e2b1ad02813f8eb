"""The OpenAI- and SGLang-compatible HTTP server over `AsyncLLM`."""
