"""Vision-language models: our Llama decoder fed by transformers' own vision towers."""
