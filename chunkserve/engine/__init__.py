"""The engine loop and what surrounds it: tokenizer, detokenizer, outputs, the LLM API."""
