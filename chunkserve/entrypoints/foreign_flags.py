"""vLLM's and SGLang's launch flags that chunkserve has no flag of its own for.

A vLLM or SGLang launch script should start chunkserve unchanged, or fail saying what to do
instead. Flags whose meaning chunkserve has are its own flags or their aliases (config/engine.py,
entrypoints/args.py: `--model-path`, `--context-length`, `--tp`, ...). The rest are listed here:
each is accepted with a logged note where it means nothing here (GPU memory, CUDA graphs, remote
code), or refused with a message naming chunkserve's way where using it would silently change
what the user asked for (LoRA, quantization methods, data parallelism). Some values of a refused
flag are harmless (`--device cpu`, `--data-parallel-size 1`): those are accepted.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from chunkserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForeignFlag:
    names: tuple[str, ...]
    takes_value: bool
    note: str | None = None  # accepted: logged when given
    refusal: str | None = None  # refused, unless its value is one of `harmless`
    harmless: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return "foreign_" + self.names[0].lstrip("-").replace("-", "_")


_NO_CUDA_GRAPHS = "there are no CUDA graphs on CPU: every step runs eagerly"
_KV_POOL_SIZE = ("the KV pool is not a fraction of device memory here: it is --kv-cache-memory-gb (default 2 GiB), "
                 "--kv-cache-memory-bytes or --num-kv-blocks")
_NO_DOWNLOAD = "no model is downloaded: pass a local folder, a .gguf file or a model id already in the local Hugging " \
               "Face cache"
_LLGUIDANCE = ("structured outputs are constrained with llguidance, the one backend here (docs/STRUCTURED_OUTPUTS.md); "
               "--structured-outputs-config '{\"backend\": \"auto\"}' is vLLM's current flag")

FOREIGN_FLAGS: tuple[ForeignFlag, ...] = (
    # accepted: they mean nothing on this engine
    ForeignFlag(("--gpu-memory-utilization", "--mem-fraction-static"), True, _KV_POOL_SIZE),
    ForeignFlag(("--swap-space",), True, "preempted requests are recomputed, never swapped: --swap-space has no "
                                         "effect"),
    ForeignFlag(("--enforce-eager", "--disable-cuda-graph"), False, _NO_CUDA_GRAPHS),
    ForeignFlag(("--max-seq-len-to-capture", "--cuda-graph-sizes", "--cuda-graph-max-bs"), True, _NO_CUDA_GRAPHS),
    ForeignFlag(("--compilation-config", "-O"), True, "nothing is compiled with torch.compile here: the C++ ops "
                                                      "(--op-backend) are built once at install"),
    ForeignFlag(("--enable-torch-compile",), False, "nothing is compiled with torch.compile here"),
    ForeignFlag(("--disable-custom-all-reduce",), False, "tensor parallelism all-reduces with torch.distributed "
                                                         "(gloo) in any case"),
    ForeignFlag(("--trust-remote-code",), False, "no model code is fetched or run: the supported architectures "
                                                 "(llama, mistral, qwen2, qwen3) are built in"),
    ForeignFlag(("--disable-log-requests",), False, "requests are not logged unless --enable-log-requests"),
    ForeignFlag(("--revision", "--tokenizer-revision", "--code-revision"), True, _NO_DOWNLOAD),
    ForeignFlag(("--download-dir",), True, _NO_DOWNLOAD),
    ForeignFlag(("--max-parallel-loading-workers",), True, "weights load in one pass (memory-mapped)"),
    ForeignFlag(("--async-scheduling", "--disable-overlap-schedule"), False,
                "the engine core schedules in its own process while the server's process handles HTTP"),
    ForeignFlag(("--enable-server-load-tracking",), False, "/load is always served"),
    ForeignFlag(("--enable-metrics",), False, "/metrics is always served"),
    ForeignFlag(("--disable-sliding-window",), False, "none of the supported models uses a sliding window"),
    ForeignFlag(("--prefix-caching-hash-algo",), True, "prefix-cache blocks are keyed by SHA-256 of their tokens"),
    ForeignFlag(("--calculate-kv-scales",), False, "the KV cache is kept in the model's dtype: there are no scales"),
    ForeignFlag(("--attention-backend",), True, "attention runs on the op backend (--op-backend cpp|torch)"),
    ForeignFlag(("--max-total-tokens",), True, "size the KV pool with --num-kv-blocks (blocks of --block-size "
                                               "tokens) or --kv-cache-memory-gb"),
    ForeignFlag(("--schedule-conservativeness", "--stream-interval"), True, "it has no equivalent here"),
    # accepted for their harmless values only
    ForeignFlag(("--device",), True, refusal="chunkserve runs on CPU only", harmless=("cpu", "auto")),
    ForeignFlag(("--load-format",), True, refusal="weights load from safetensors (a folder) or GGUF (a .gguf file)",
                harmless=("auto", "safetensors", "gguf")),
    ForeignFlag(("--tokenizer-mode",), True, refusal="the tokenizer is the model's Hugging Face (fast) tokenizer",
                harmless=("auto", "hf")),
    ForeignFlag(("--kv-cache-dtype",), True, refusal="the KV cache is kept in the model's dtype (--dtype)",
                harmless=("auto",)),
    ForeignFlag(("--quantization", "-q"), True,
                refusal="quantized weights load from GGUF files (Q4_0, Q4_1 and Q8_0 kept as they are, the others "
                        "dequantized): pass the .gguf file as the model", harmless=("gguf",)),
    ForeignFlag(("--data-parallel-size", "-dp", "--dp", "--dp-size"), True,
                refusal="one server runs one engine: start one chunkserve per replica behind a load balancer",
                harmless=("1",)),
    ForeignFlag(("--cpu-offload-gb",), True, refusal="the weights are in CPU memory already", harmless=("0",)),
    ForeignFlag(("--chat-template-content-format",), True,
                refusal="message contents reach the chat template as strings (a list of text parts is joined), "
                        "or, where they have images, as parts with {\"type\": \"image\"} in the images' places",
                harmless=("auto", "string")),
    # refused: chunkserve cannot do what they ask
    ForeignFlag(("--enable-lora",), False, refusal="LoRA adapters are not supported"),
    ForeignFlag(("--lora-modules", "--max-loras", "--max-lora-rank", "--lora-paths"), True,
                refusal="LoRA adapters are not supported"),
    ForeignFlag(("--enable-expert-parallel",), False, refusal="no mixture-of-experts model is supported"),
    ForeignFlag(("--kv-transfer-config",), True,
                refusal="prefill/decode disaggregation uses SGLang's flags: --disaggregation-mode prefill|decode on "
                        "each server and `chunkserve router` in front (README, 'Prefill/decode disaggregation')"),
    ForeignFlag(("--hf-overrides",), True, refusal="edit the model folder's config.json instead"),
    ForeignFlag(("--tool-parser-plugin",), True,
                refusal="no parser plugins are loaded: --tool-call-parser takes the built-in hermes (Hermes, Qwen), "
                        "llama3_json (Llama 3.1+) and mistral"),
    ForeignFlag(("--reasoning-parser",), True,
                refusal="there are no reasoning parsers: a model's reasoning stays in the content"),
    # vLLM's older flag and SGLang's: the backend that is here is accepted, the others refused
    ForeignFlag(("--guided-decoding-backend",), True, _LLGUIDANCE, refusal=_LLGUIDANCE,
                harmless=("auto", "guidance", "llguidance")),
    ForeignFlag(("--grammar-backend",), True, _LLGUIDANCE, refusal=_LLGUIDANCE, harmless=("llguidance",)),
    ForeignFlag(("--otlp-traces-endpoint",), True,
                refusal="there is no OpenTelemetry export: --trace-steps FILE writes one JSON line per engine step, "
                        "and /metrics serves Prometheus"),
    ForeignFlag(("--enable-sleep-mode",), False, refusal="sleep mode is not supported"),
    ForeignFlag(("--skip-tokenizer-init",), False, refusal="the server needs the tokenizer (stop strings, chat "
                                                           "templates, detokenized text)"),
    ForeignFlag(("--speculative-model", "--num-speculative-tokens", "--ngram-prompt-lookup-max"), True,
                refusal="speculative decoding is configured with --speculative-config JSON, as in current vLLM: "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'"),
    ForeignFlag(("--middleware",), True, refusal="custom ASGI middleware is not supported"),
)


def add_foreign_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM / SGLang flags with no meaning here (accepted with a note, or refused "
                                      "naming the alternative)")
    for flag in FOREIGN_FLAGS:
        text = flag.note or f"refused: {flag.refusal}" + (f" (accepted: {', '.join(flag.harmless)})"
                                                            if flag.harmless else "")
        if flag.takes_value:
            group.add_argument(*flag.names, dest=flag.dest, default=None, metavar="VALUE", help=text)
        else:
            group.add_argument(*flag.names, dest=flag.dest, action="store_true", default=None, help=text)


def check_foreign_flags(namespace: argparse.Namespace) -> None:
    """Log a note for each accepted flag given; raise for a refused one, naming what to use."""
    for flag in FOREIGN_FLAGS:
        value = getattr(namespace, flag.dest, None)
        if value is None:
            continue
        shown = flag.names[0] + ("" if value is True else f" {value}")
        if flag.refusal is not None and str(value).lower() not in flag.harmless:
            raise InvalidRequestError(f"{shown} is not supported: {flag.refusal}")
        if flag.note is not None:
            logger.info("%s: %s", shown, flag.note)
