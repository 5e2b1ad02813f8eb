"""vLLM's and SGLang's launch commands, as their docs and examples write them, go through our
parser: each parses with its meaning, or is accepted with a logged note where it means
nothing on CPU, or fails with a message naming what to use instead."""

from __future__ import annotations

import argparse
import logging
import shlex

import pytest

from chunkserve.config import cpu
from chunkserve.config.engine import EngineArgs, human_readable_int
from chunkserve.entrypoints.args import ServerArgs
from chunkserve.entrypoints.cli import _serve_args, build_parser, expand_config_file, main
from chunkserve.errors import InvalidRequestError


def serve_args(command: str) -> tuple[EngineArgs, ServerArgs]:
    """`vllm serve ...` / `python -m sglang.launch_server ...` as `chunkserve serve ...`."""
    argv = shlex.split(command)
    argv = ["serve", *argv[argv.index("serve") + 1:]] if "serve" in argv else ["serve", *argv[3:]]  # python -m X
    return _serve_args(build_parser().parse_args(expand_config_file(argv)))


# (command, what it must mean here) — from vLLM's quickstart, serving and CPU docs, and SGLang's
# server-arguments docs
ACCEPTED = [
    ("vllm serve Qwen/Qwen2.5-1.5B-Instruct", {"model": "Qwen/Qwen2.5-1.5B-Instruct"}),
    ("vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123",
     {"dtype": cpu.auto_dtype(), "api_key": "token-abc123"}),
    ("vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 2 --max-model-len 32k",
     {"tensor_parallel_size": 2, "max_model_len": 32000}),
    ("vllm serve m --max-model-len 32K --gpu-memory-utilization 0.9 --enforce-eager --trust-remote-code",
     {"max_model_len": 32768}),
    ("vllm serve m --dtype float --disable-log-requests --disable-log-stats --swap-space 4",
     {"dtype": "float32", "disable_log_stats": True}),
    ("vllm serve m --dtype bfloat16 --max-num-seqs 64 --max-num-batched-tokens 8192 --enable-chunked-prefill",
     {"dtype": "bfloat16", "max_num_seqs": 64, "max_num_batched_tokens": 8192, "enable_chunked_prefill": True}),
    ("vllm serve m --served-model-name gpt-4o my-model --port 8080 --host 0.0.0.0",
     {"served_model_name": ["gpt-4o", "my-model"], "port": 8080, "host": "0.0.0.0"}),
    ("vllm serve m --chat-template ./template.jinja --generation-config vllm --tokenizer ./tok",
     {"chat_template": "./template.jinja", "generation_config": "vllm", "tokenizer": "./tok"}),
    ("vllm serve m --max-logprobs 50 --kv-cache-memory-bytes 4G --block-size 32 --seed 1",
     {"max_logprobs": 50, "kv_cache_memory_bytes": 4 * 2**30, "block_size": 32, "seed": 1}),
    ("vllm serve m --allowed-origins '[\"https://a.example\"]' --root-path /llm --uvicorn-log-level warning "
     "--disable-uvicorn-access-log --enable-log-requests --max-log-len 100",
     {"allowed_origins": ["https://a.example"], "root_path": "/llm", "uvicorn_log_level": "warning",
      "disable_uvicorn_access_log": True, "enable_log_requests": True, "max_log_len": 100}),
    ("vllm serve m --enable-prefix-caching --no-enable-prefix-caching", {"enable_prefix_caching": False}),
    ("vllm serve m --device cpu --load-format auto --kv-cache-dtype auto --tokenizer-mode auto -dp 1 "
     "--distributed-executor-backend mp -tp 2 -pp 1 --num-gpu-blocks-override 512 -O3 --async-scheduling",
     {"tensor_parallel_size": 2, "num_kv_blocks": 512, "distributed_executor_backend": "mp"}),
    ("vllm serve m --speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'",
     {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 4}'}),
    ("vllm serve m --structured-outputs-config '{\"backend\": \"auto\", \"disable_any_whitespace\": true}'",
     {"structured_outputs_config": '{"backend": "auto", "disable_any_whitespace": true}'}),
    ("vllm serve m --guided-decoding-backend guidance", {"model": "m"}),
    ("vllm serve Qwen/Qwen2.5-7B-Instruct --enable-auto-tool-choice --tool-call-parser hermes",
     {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}),
    ("vllm serve m --enable-auto-tool-choice --tool-call-parser llama4_json --exclude-tools-when-tool-choice-none",
     {"tool_call_parser": "llama4_json", "exclude_tools_when_tool_choice_none": True}),
    ("vllm serve --model m --scheduling-policy priority --ssl-keyfile k.pem --ssl-certfile c.pem",
     {"model": "m", "scheduling_policy": "priority", "ssl_keyfile": "k.pem", "ssl_certfile": "c.pem"}),
    # SGLang's spellings
    ("python -m sglang.launch_server --model-path Qwen/Qwen2-7B --context-length 4096 --tp 2 "
     "--chunked-prefill-size 2048 --mem-fraction-static 0.8 --max-running-requests 32 --page-size 32 "
     "--schedule-policy fcfs --random-seed 7 --disable-radix-cache --host 0.0.0.0 --port 30000",
     {"model": "Qwen/Qwen2-7B", "max_model_len": 4096, "tensor_parallel_size": 2, "max_num_batched_tokens": 2048,
      "max_num_seqs": 32, "block_size": 32, "seed": 7, "enable_prefix_caching": False, "port": 30000}),
    ("python -m sglang.launch_server --model-path m --tp-size 2 --disable-cuda-graph --trust-remote-code "
     "--log-level warning --enable-metrics", {"tensor_parallel_size": 2, "log_level": "warning"}),
]


@pytest.mark.parametrize("command,expected", ACCEPTED, ids=[c for c, _ in ACCEPTED])
def test_vllm_and_sglang_commands_parse_with_their_meaning(command, expected):
    engine, server = serve_args(command)
    for name, value in expected.items():
        owner = engine if hasattr(engine, name) else server
        assert getattr(owner, name) == value, name


REFUSED = [
    ("vllm serve m --dtype half", "bfloat16"),
    ("vllm serve m --dtype float16", "bfloat16"),
    ("vllm serve m --quantization awq", ".gguf"),
    ("vllm serve m --enable-lora --lora-modules a=b", "LoRA"),
    ("vllm serve m --data-parallel-size 2", "load balancer"),
    ("vllm serve m --device cuda", "CPU"),
    ("vllm serve m --kv-cache-dtype fp8", "--dtype"),
    ("vllm serve m --kv-transfer-config '{}'", "--disaggregation-mode"),
    ("vllm serve m --enable-auto-tool-choice", "--tool-call-parser, one of hermes"),
    ("vllm serve m --enable-auto-tool-choice --tool-call-parser hermes --tool-parser-plugin p.py",
     "built-in hermes"),
    ("vllm serve m --speculative-model draft", "--speculative-config"),
    ("vllm serve m --structured-outputs-config '{\"backend\": \"xgrammar\"}'", "llguidance"),
    ("vllm serve m --guided-decoding-backend outlines", "--structured-outputs-config"),
    ("python -m sglang.launch_server --model-path m --grammar-backend xgrammar", "llguidance"),
    ("vllm serve m --otlp-traces-endpoint http://x", "--trace-steps"),
    ("python -m sglang.launch_server --model-path m --chunked-prefill-size -1", "--no-enable-chunked-prefill"),
    ("python -m sglang.launch_server --model-path m --dp 2", "load balancer"),
    ("vllm serve a --model b", "given twice"),
]


@pytest.mark.parametrize("command,alternative", REFUSED, ids=[c for c, _ in REFUSED])
def test_refused_flags_name_the_alternative(command, alternative):
    with pytest.raises(InvalidRequestError, match=alternative.replace(".", r"\.")):
        serve_args(command)


def test_flags_with_no_meaning_here_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="chunkserve.entrypoints.foreign_flags"):
        serve_args("vllm serve m --gpu-memory-utilization 0.95 --enforce-eager")
    assert "--gpu-memory-utilization 0.95: the KV pool is not a fraction of device memory" in caplog.text
    assert "--kv-cache-memory-gb" in caplog.text and "--enforce-eager: there are no CUDA graphs" in caplog.text


def test_an_unknown_flag_is_still_an_error(capsys):
    with pytest.raises(SystemExit):
        serve_args("vllm serve m --no-such-flag 1")
    assert "--no-such-flag" in capsys.readouterr().err


def test_a_yaml_config_gives_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("model: m\nport: 6379\ntensor-parallel-size: 2\nenable_prefix_caching: false\n"
                      "served-model-name: [a, b]\nenforce-eager: false\ngpu-memory-utilization: 0.9\n")
    engine, server = serve_args(f"vllm serve --config {config} --port 9000")
    assert (engine.model, server.port, engine.tensor_parallel_size) == ("m", 9000, 2)
    assert engine.enable_prefix_caching is False and server.served_model_name == ["a", "b"]


def test_a_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidRequestError, match="could not be read"):
        serve_args(f"vllm serve m --config {tmp_path / 'nope.yaml'}")


@pytest.mark.parametrize("text,value", [("4096", 4096), ("32k", 32_000), ("32K", 32_768), ("1.5m", 1_500_000),
                                        ("2G", 2 * 2**30)])
def test_human_readable_sizes(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["1.5K", "lots", "3x"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("chunkserve ")


def test_offline_dtype_spellings(monkeypatch):
    """auto is vLLM's rule: bfloat16 where the CPU computes it natively (AVX512_BF16 or AMX), else
    float32; it is resolved when the settings are made, so the server reports what runs."""
    for flags, expected in (({"avx2", "avx512f"}, "float32"), ({"avx512f", "avx512_bf16"}, "bfloat16"),
                            ({"amx_tile", "amx_bf16"}, "bfloat16"), (set(), "float32")):
        monkeypatch.setattr(cpu, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert EngineArgs(dtype="auto").dtype == expected
        assert EngineArgs().dtype == expected  # the default
    assert EngineArgs(dtype="float").dtype == "float32"
    with pytest.raises(InvalidRequestError, match="bfloat16"):
        EngineArgs(dtype="float16")
