"""What users touch: the `chunkserve` command line, the HTTP server and the offline `LLM`."""
