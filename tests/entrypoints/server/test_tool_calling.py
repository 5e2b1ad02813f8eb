"""Tool calling on /v1/chat/completions with the official openai client, against a server started
as vLLM's docs start one for tools (`--enable-auto-tool-choice --tool-call-parser hermes`) on
the tiny model (SmolLM2's tokenizer and chat template, random weights: what is checked is the
protocol and the constraint, never the model's judgement; compact JSON, so that a random model's
constrained arguments end instead of looping on whitespace): tool_choice "required" and a named function give calls whose
arguments parse and validate against the tool's parameters (their decoding is constrained by
the tool's schema), streamed and not; a conversation with an assistant's tool_calls and a tool
result reaches the chat template; vLLM's refusals by name."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server_process import API_KEY, start_server, stop_server
from tests.tiny_model import TINY_SERVER_ENV, tiny_server_flags

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                           "parameters": TIME}}]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# a small model loops on calls unless asked for one: parallel_tool_calls false lets the grammar stop it
ONE_CALL = {"max_tokens": 96, "temperature": 0, "parallel_tool_calls": False}


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, tiny_gguf):
    server = start_server(tmp_path_factory, *tiny_server_flags(tiny_gguf, max_model_len=2048),
                          "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--served-model-name", "m",
                          "--structured-outputs-config", '{"disable_any_whitespace": true}',
                          name="tool_calling", env=TINY_SERVER_ENV)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=f"{tool_server.base_url}/v1", api_key=API_KEY, timeout=300)


def check_call(name: str, arguments: str) -> None:
    """The call names one of the tools and its arguments are JSON valid for that tool."""
    assert name in PARAMETERS
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """A chat stream's calls (OpenAI's shape checked), its finish_reason and its content."""
    calls: dict[int, dict] = {}
    finish_reason, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.index not in calls:  # the first delta: id, type and name, empty arguments
                assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
                assert call.function.name and call.function.arguments == ""
                calls[call.index] = {"name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments
        finish_reason = choice.finish_reason or finish_reason
    return [calls[i] for i in sorted(calls)], finish_reason, content


def test_required_gives_a_call_valid_for_its_tool(client):
    answer = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", **ONE_CALL)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    check_call(call.function.name, call.function.arguments)


def test_required_streams_the_call_and_its_arguments(client):
    stream = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                            stream=True, **ONE_CALL)
    calls, finish_reason, content = streamed_calls(stream)
    assert finish_reason == "tool_calls" and content == "" and len(calls) == 1
    check_call(calls[0]["name"], calls[0]["arguments"])


def test_a_named_function_gives_its_call(client):
    answer = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=NAMED, **ONE_CALL)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's (and vLLM's) reason for a named call
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_call(call.function.name, call.function.arguments)


def test_a_named_function_streams_its_arguments_in_fragments(client):
    stream = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=NAMED, stream=True,
                                            stream_options={"include_usage": True}, **ONE_CALL)
    calls, finish_reason, _ = streamed_calls(stream)
    assert finish_reason == "stop" and [c["name"] for c in calls] == ["get_weather"]
    check_call("get_weather", calls[0]["arguments"])


def test_auto_answers_with_content_or_parsed_calls(client):
    answer = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=24, temperature=0)
    choice = answer.choices[0]
    if choice.message.tool_calls:  # whatever the model wrote as <tool_call> JSON
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert choice.message.content
    stream = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=24, temperature=0,
                                            stream=True)
    calls, finish_reason, content = streamed_calls(stream)
    assert content == (choice.message.content or "") and finish_reason == choice.finish_reason
    assert [c["name"] for c in calls] == [c.function.name for c in choice.message.tool_calls or []]


HISTORY = [*ASK,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "chatcmpl-tool-1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
           {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "22 degrees and sunny"}]


def test_a_tool_conversation_reaches_the_template(client, tool_server):
    with tool_server.client() as http:
        rendered = http.post("/tokenize", json={"messages": HISTORY, "tools": TOOLS}).json()
        text = http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert "22 degrees and sunny" in text and "<|im_start|>tool" in text
    answer = client.chat.completions.create(model="m", messages=HISTORY, tools=TOOLS, max_tokens=8, temperature=0)
    shorter = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    assert answer.usage.prompt_tokens == rendered["count"] > shorter.usage.prompt_tokens
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("fields,param,message", [
    ({"tool_choice": "required"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "does not match any of the specified `tools`"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with response_format"),
    ({"functions": [{"name": "f"}]}, "functions", "send tools and tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools", "tools' parameters is not valid"),
])
def test_vllms_refusals_name_the_field(tool_server, fields, param, message):
    with tool_server.client() as http:
        response = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_tools_on_completions_are_refused_naming_chat(tool_server):
    response = httpx.post(f"{tool_server.base_url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"prompt": "hi", "max_tokens": 1, "tools": TOOLS})
    assert response.status_code == 400 and "/v1/chat/completions" in response.json()["error"]["message"]
