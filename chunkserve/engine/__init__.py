"""The frontend (input and output processors, `LLMEngine`, `AsyncLLM`) and the token-only engine core
(`EngineCore`, its loop, its messages and the clients that reach it)."""
