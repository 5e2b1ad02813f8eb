"""`chunkserve bench throughput`: the offline engine timed as `vllm bench throughput` times it."""

from __future__ import annotations

import json

from chunkserve.entrypoints import cli


def test_random_prompts_report_vllms_numbers(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    cli.main(["bench", "throughput", "--model", tiny_gguf, "--num-prompts", "5", "--input-len", "24",
              "--output-len", "6", "--output-json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert (result["num_requests"], result["total_prompt_tokens"], result["total_output_tokens"]) == (5, 120, 30)
    assert result["total_num_tokens"] == 150
    assert result["requests_per_second"] == 5 / result["elapsed_time"]
    assert result["tokens_per_second"] == 150 / result["elapsed_time"]
    assert f"Throughput: {result['requests_per_second']:.2f} requests/s" in printed
    assert "Total num output tokens:  30" in printed


def test_sharegpt_prompts_are_counted_by_the_models_tokenizer(tiny_gguf, tmp_path, capsys, default_tokenizer):
    chats = [{"conversations": [{"from": "human", "value": f"Tell me about the number {i} in a few words."},
                                {"from": "gpt", "value": f"The number {i} is a small whole number."}]} for i in range(4)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(chats))
    out = tmp_path / "throughput.json"
    cli.main(["bench", "throughput", "--model", tiny_gguf, "--dataset-name", "sharegpt", "--dataset-path", str(path),
              "--num-prompts", "4", "--output-json", str(out)])
    result = json.loads(out.read_text())
    prompts = [default_tokenizer(c["conversations"][0]["value"]).input_ids for c in chats]
    replies = [default_tokenizer(c["conversations"][1]["value"]).input_ids for c in chats]
    assert result["num_requests"] == 4
    assert result["total_prompt_tokens"] == sum(map(len, prompts))
    assert result["total_output_tokens"] == sum(map(len, replies))
