"""The tiny model of the behaviour tier: a random-weight Llama shaped like a small SmolLM2
(grouped-query attention 3:1, a tied head, SmolLM2's 49,152-token vocabulary), written as a GGUF
with Q4_1 matrices and SmolLM2's own tokenizer metadata and chat template. Prompts, stop strings,
chat templates and the GGUF loader's block-quantized linears behave as on the real model; a step
takes about a millisecond instead of tens.

Special tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, ids 0-2) have all-zero embedding
rows, so their logit is exactly 0 through the tied head while the others spread about +-6: a
random model never ends a generation by chance, so a test's `max_tokens` decides its length.
Tests that need real text (answers, EOS, acceptance on natural text) stay on SmolLM2.

`conftest.py`'s `tiny_gguf` fixture builds it once per session; use `tiny_server_flags` to start
a server on it (tests/server_process.py).
"""

from __future__ import annotations

import os

TINY_GGUF_NAME = "tiny-smollm2.Q4_1.gguf"
TINY_MAX_POSITIONS = 4096
SPECIAL_TOKEN_IDS = (0, 1, 2)
# Every step that runs requests sleeps this long in a server started with TEST_STEP_DELAY_ENV set to it:
# long enough that a test acts while a request is prefilling or decoding, short enough to keep tests fast.
STEP_DELAY_MS = 40
# A tiny model's server gains nothing from more intra-op threads, and on a 2-core machine shared with
# the test client (and other tests) torch's spinning threads made every step about 8x slower.
TINY_SERVER_ENV = {"OMP_NUM_THREADS": "1"}


def tiny_llama_config(vocab_size: int, eos_token_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=TINY_MAX_POSITIONS,
                       initializer_range=0.15, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                       tie_word_embeddings=True, vocab_size=vocab_size, eos_token_id=eos_token_id)


def build_tiny_gguf(folder: str) -> str:
    """The tiny model's GGUF in `folder` (its Hugging Face source folder beside it, for a
    transformers oracle); returns the GGUF's path."""
    import torch
    from transformers import AutoModelForCausalLM

    from chunkserve.config.model import default_model_path, resolve_model
    from chunkserve.engine.tokenizer import load_tokenizer
    from tests.model.gguf_files import write_gguf

    tokenizer = load_tokenizer(resolve_model(None))
    config = tiny_llama_config(len(tokenizer), tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[list(SPECIAL_TOKEN_IDS)] = 0.0
    hf_folder = os.path.join(folder, "hf")
    model.save_pretrained(hf_folder)
    tokenizer.save_pretrained(hf_folder)
    return write_gguf(hf_folder, os.path.join(folder, TINY_GGUF_NAME), "Q4_1", tokenizer_from=default_model_path(),
                      with_lm_head=False)


def tiny_server_flags(gguf_path: str, max_model_len: int = TINY_MAX_POSITIONS) -> list[str]:
    """The flags of a server on the tiny model (start_server's *flags)."""
    return ["--model", gguf_path, "--max-model-len", str(max_model_len)]
