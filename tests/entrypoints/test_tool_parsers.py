"""Tool calling below the server: the parsers of each format on outputs shaped like their models'
(whole, and streamed in small pieces, which must add up to the same answer), the schemas that
constrain tool_choice "required" and a named function (vLLM's), the rules of tool_choice
(vLLM's defaults and messages), the streams' deltas, and the history's tool messages reaching a
chat template in the shape templates expect."""

from __future__ import annotations

import json

import jsonschema
import pytest

from chunkserve.entrypoints.server.openai_protocol import ChatCompletionRequest, ChatCompletionTool
from chunkserve.entrypoints.server.tool_calls import (
    AUTO_NEEDS_FLAGS,
    AutoCallStream,
    ChatToolCalls,
    NamedCallStream,
    RequiredCallStream,
    named_schema,
    required_schema,
    resolve_tool_choice,
)
from chunkserve.entrypoints.server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolParser,
    json_end,
)
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import SamplingParams, StructuredOutputsParams

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"timezone": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "ping"}}]
USER = [{"role": "user", "content": "Weather in Paris, and the time?"}]

# (parser, model output, expected content, expected calls as (name, arguments))
CASES = [
    # Qwen 2.5's form: a line of text, then one <tool_call> per call
    (HermesToolParser, 'I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}'
     '\n</tool_call>', "I will look both up.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]),
    (HermesToolParser, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', None, [("ping", {})]),
    # an unclosed last call is read to the end (vLLM's rule); braces and escapes inside strings
    (HermesToolParser, '<tool_call>{"name": "get_weather", "arguments": {"city": "São \\"Paulo\\" {x}"}}', None,
     [("get_weather", {"city": 'São "Paulo" {x}'})]),
    # malformed JSON stays content, as written; a valid call after it is still a call
    (HermesToolParser, 'Hmm <tool_call>{"name": get_weather}</tool_call> then <tool_call>{"name": "ping", '
     '"arguments": {}}</tool_call>', 'Hmm <tool_call>{"name": get_weather}</tool_call> then', [("ping", {})]),
    (HermesToolParser, "Paris is sunny today.\n\nEnjoy <your> day!  ", "Paris is sunny today.\n\nEnjoy <your> day!  ",
     []),
    (HermesToolParser, 'Use <tool_call>{"arguments": {}}</tool_call>', 'Use <tool_call>{"arguments": {}}</tool_call>',
     []),
    # Llama 3.1: the whole answer, with or without <|python_tag|>, several calls split by ";"
    (Llama3JsonToolParser, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"timezone": "UTC"}}', None,
     [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "UTC"})]),
    (Llama3JsonToolParser, '\n{"name": "ping", "arguments": {}}', None, [("ping", {})]),
    (Llama3JsonToolParser, 'The JSON you asked for: {"name": "x", "parameters": {}}',
     'The JSON you asked for: {"name": "x", "parameters": {}}', []),
    (Llama3JsonToolParser, '{"city": "Paris"}', '{"city": "Paris"}', []),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Par', '{"name": "get_weather", '
     '"parameters": {"city": "Par', []),
    # Mistral: an array after [TOOL_CALLS] (its Hugging Face tokenizers), or v11's name{arguments}
    (MistralToolParser, 'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "ping", "arguments": {}}]', "Let me check.", [("get_weather", {"city": "Paris"}), ("ping", {})]),
    (MistralToolParser, '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{"timezone": "UTC"}', None,
     [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "UTC"})]),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": ]', '[TOOL_CALLS] [{"name": '
     '"get_weather", "arguments": {"city": ]', []),
    (MistralToolParser, "[TOOL_CALLS] I cannot call tools", "[TOOL_CALLS] I cannot call tools", []),
    (MistralToolParser, "The [TOOL] tag is plain text", "The [TOOL] tag is plain text", []),
]


def calls_of(answer) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in answer.tool_calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_each_format_is_parsed_whole(parser, text, content, calls):
    answer = parser().parse(text)
    assert answer.content == content
    assert calls_of(answer) == calls
    assert all(call.id for call in answer.tool_calls)


@pytest.mark.parametrize("piece", [1, 2, 3, 7])
@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_a_stream_in_small_pieces_adds_up_to_the_whole_answer(parser, text, content, calls, piece):
    reader: ToolParser = parser()
    events = []
    for start in range(0, len(text), piece):
        events += reader.feed(text[start:start + piece])
    events += reader.finish()
    streamed = "".join(e for e in events if isinstance(e, str))
    assert (streamed or (None if calls else "")) == content
    assert [(e.name, json.loads(e.arguments)) for e in events if not isinstance(e, str)] == calls


def test_a_marker_split_across_pieces_is_never_sent_as_content():
    reader = HermesToolParser()
    sent = reader.feed("Sure.\n<tool") + reader.feed("_call>\n{\"name\": \"ping\", ") + reader.feed('"arguments": {}}')
    assert sent == ["Sure."]  # the half marker and the unfinished call are held back
    assert [e.name for e in reader.feed("</tool_call>")] == ["ping"]


def test_mistral_keeps_special_tokens_and_gives_nine_character_ids():
    """[TOOL_CALLS] is a special token of Mistral's tokenizers (vLLM turns skip_special_tokens off)."""
    assert MistralToolParser.keeps_special_tokens and not HermesToolParser.keeps_special_tokens
    call = MistralToolParser().parse('[TOOL_CALLS][{"name": "ping", "arguments": {}}]').tool_calls[0]
    assert len(call.id) == 9 and call.id.isalnum()
    assert HermesToolParser().parse('<tool_call>{"name": "ping", "arguments": {}}</tool_call>').tool_calls[0].id \
        .startswith("chatcmpl-tool-")


def test_the_parser_names_are_vllms():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "llama4_json", "mistral"}
    assert TOOL_PARSERS["llama4_json"] is Llama3JsonToolParser


@pytest.mark.parametrize("text,end", [('{"a": "}"} tail', 10), ('[1, [2], {"b": "]"}]', 20), ('{"a": [1, 2', None)])
def test_json_end_counts_brackets_outside_strings(text, end):
    assert json_end(text) == end


# ----- the constraint of tool_choice "required" and of a named function -------------------------


def tools(given=TOOLS) -> list[ChatCompletionTool]:
    return [ChatCompletionTool.model_validate(tool) for tool in given]


def test_the_required_schema_is_vllms_array_of_any_tool():
    schema = required_schema(tools())
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    first = schema["items"]["anyOf"][0]
    assert first == {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]},
                                                      "parameters": WEATHER},
                     "required": ["name", "parameters"]}
    assert schema["items"]["anyOf"][2]["properties"]["parameters"] == {"type": "object", "properties": {}}
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "ping", "parameters": {}}],
                        schema)
    for wrong in ([], [{"name": "get_weather", "parameters": {"unit": "celsius"}}],  # no city
                  [{"name": "nope", "parameters": {}}], [{"name": "ping"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    assert required_schema(tools(), parallel=False)["maxItems"] == 1


def test_the_tools_defs_move_to_the_root_and_a_conflict_is_refused():
    with_defs = {"type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}},
                 "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    given = [{"type": "function", "function": {"name": "go", "parameters": with_defs}}]
    schema = required_schema(tools(given))
    assert schema["$defs"] == with_defs["$defs"] and "$defs" not in schema["items"]["anyOf"][0]["properties"][
        "parameters"]
    assert "$defs" in given[0]["function"]["parameters"]  # the request's own schema is left as it was
    jsonschema.validate([{"name": "go", "parameters": {"place": {"city": "Paris"}}}], schema)
    other = {**with_defs, "$defs": {"Place": {"type": "string"}}}
    with pytest.raises(InvalidRequestError, match="Tool definition 'Place' has multiple schemas"):
        required_schema(tools([*given, {"type": "function", "function": {"name": "b", "parameters": other}}]))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                    {"type": "function", "function": {"name": "ping"}}])
def test_the_tools_constraint_compiles_with_closed_objects(choice):
    """llguidance closes each object on its own properties: with vLLM's literal items ({"type":
    "object", "anyOf": [...]}) the outer object would close on none, and no call could be written."""
    from chunkserve.core.structured import grammar

    calls = ChatToolCalls(request(tools=TOOLS, tool_choice=choice), None)
    grammar.validate(calls.sampling_params(SamplingParams()).structured_outputs)


def test_a_named_function_is_constrained_to_its_parameters():
    assert named_schema(tools(), "get_weather") == WEATHER
    assert named_schema(tools(), "ping") == {"type": "object", "properties": {}}


# ----- tool_choice -----------------------------------------------------------------------------


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps({"messages": USER, **fields}))


def test_tool_choice_defaults_and_checks_are_vllms():
    assert resolve_tool_choice(request()) == "none"
    assert resolve_tool_choice(request(tools=TOOLS)) == "auto"
    assert resolve_tool_choice(request(tools=[])) == "none"
    assert resolve_tool_choice(request(tools=[], tool_choice="required")) == "none"
    assert resolve_tool_choice(request(tools=TOOLS, tool_choice="none")) == "none"
    with pytest.raises(InvalidRequestError, match="When using `tool_choice`, `tools` must be set."):
        resolve_tool_choice(request(tool_choice="required"))
    with pytest.raises(InvalidRequestError, match="does not match any of the specified `tools`"):
        resolve_tool_choice(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}))


def test_auto_needs_the_servers_flags():
    """vLLM's 400 for "auto" (also the default with tools) on a server without
    --enable-auto-tool-choice; "required" and a named function need no parser."""
    for body in (request(tools=TOOLS), request(tools=TOOLS, tool_choice="auto")):
        with pytest.raises(InvalidRequestError) as refused:
            ChatToolCalls(body, None)
        assert str(refused.value) == AUTO_NEEDS_FLAGS and refused.value.param == "tool_choice"
        assert AUTO_NEEDS_FLAGS == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to ' \
                                   'be set'
    assert ChatToolCalls(request(tools=TOOLS, tool_choice="required"), None).constrained
    assert not ChatToolCalls(request(tools=TOOLS, tool_choice="none"), None).active


def test_the_constraint_goes_into_the_sampling_params():
    named = ChatToolCalls(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                          None)
    assert named.sampling_params(SamplingParams()).structured_outputs == StructuredOutputsParams(
        json=WEATHER, disable_additional_properties=True)  # closed objects, as vLLM's default backend (xgrammar)
    required = ChatToolCalls(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None)
    assert required.sampling_params(SamplingParams()).structured_outputs == StructuredOutputsParams(
        json=required_schema(tools(), False), disable_additional_properties=True)
    with pytest.raises(InvalidRequestError, match="cannot be combined with response_format"):
        required.sampling_params(SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)))
    auto = ChatToolCalls(request(tools=TOOLS), MistralToolParser)
    assert auto.sampling_params(SamplingParams()).skip_special_tokens is False
    assert ChatToolCalls(request(tools=TOOLS), HermesToolParser).sampling_params(SamplingParams()) == SamplingParams()
    with pytest.raises(InvalidRequestError, match="use_beam_search"):
        ChatToolCalls(request(tools=TOOLS, tool_choice="required", use_beam_search=True), None)


# ----- answers and streams ----------------------------------------------------------------------


def test_the_messages_and_finish_reasons_are_vllms():
    named = ChatToolCalls(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                          None)
    message, reason = named.message('{"city": "Paris"}', "stop")
    assert reason == "stop" and message["content"] == ""  # a named call keeps "stop" (OpenAI's rule)
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert message["tool_calls"][0]["type"] == "function" and message["tool_calls"][0]["id"].startswith("chatcmpl-tool-")

    required = ChatToolCalls(request(tools=TOOLS, tool_choice="required"), None)
    message, reason = required.message('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                                       '{"name": "ping", "parameters": {}}]', "stop")
    assert reason == "tool_calls" and [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "ping"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    cut = '[{"name": "get_weather", "parameters": {"ci'
    assert required.message(cut, "length") == ({"content": cut}, "length")
    single = ChatToolCalls(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None)
    assert len(single.message('[{"name": "ping", "parameters": {}}, {"name": "ping", "parameters": {}}]',
                              "stop")[0]["tool_calls"]) == 1

    auto = ChatToolCalls(request(tools=TOOLS), HermesToolParser)
    message, reason = auto.message('Checking.<tool_call>{"name": "ping", "arguments": {}}</tool_call>', "stop")
    assert reason == "tool_calls" and message["content"] == "Checking." and len(message["tool_calls"]) == 1
    assert auto.message("It is sunny.", "stop") == ({"content": "It is sunny."}, "stop")
    none = ChatToolCalls(request(tools=TOOLS, tool_choice="none"), HermesToolParser)
    text = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    assert none.message(text, "stop") == ({"content": text}, "stop")


def arguments_by_index(deltas) -> dict[int, str]:
    """Each call's streamed arguments, after checking OpenAI's shape: a call's first delta has
    its id, type and name and empty arguments; later ones only arguments."""
    found: dict[int, str] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            if call["index"] not in found:
                assert call["id"] and call["type"] == "function" and call["function"]["arguments"] == ""
                assert call["function"]["name"]
                found[call["index"]] = ""
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                found[call["index"]] += call["function"]["arguments"]
    return found


REQUIRED_ANSWER = ('[{\n    "name": "get_weather"\n\n,"parameters": {\n    "city": "Par\\"is",\n "n": [1, {"x": "}]"}]'
                   '\n}\n}\n\n, {"parameters": {"timezone": "UTC"}, "name": "get_time"}, {"name": "ping", "parameters": '
                   '{}}]')


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_required_calls_stream_their_arguments_as_they_come(piece):
    """Announced once the name is complete, arguments as the model writes them (held until the
    name is known when the model writes parameters first)."""
    reader = RequiredCallStream(parallel=True)
    deltas = []
    for start in range(0, len(REQUIRED_ANSWER), piece):
        deltas += reader.feed(REQUIRED_ANSWER[start:start + piece])
    rest, reason = reader.finish("stop")
    arguments = arguments_by_index(deltas + rest)
    expected = [item["parameters"] for item in json.loads(REQUIRED_ANSWER)]
    assert [json.loads(arguments[i]) for i in range(3)] == expected and reason == "tool_calls"
    names = [c["function"]["name"] for d in deltas for c in d["tool_calls"] if "name" in c["function"]]
    assert names == ["get_weather", "get_time", "ping"]
    if piece == 1:  # arguments arrive in many fragments, not at the end
        assert sum("name" not in c["function"] for d in deltas for c in d["tool_calls"]) > 10


def test_a_single_required_call_and_a_cut_stream():
    reader = RequiredCallStream(parallel=False)
    deltas = reader.feed('[{"name": "ping", "parameters": {}}, {"name": "get_time", "parameters": {}}]')
    assert list(arguments_by_index(deltas)) == [0]
    reader = RequiredCallStream(parallel=True)
    deltas = reader.feed('[{"name": "get_weather", "parameters": {"city": "Pa')
    assert arguments_by_index(deltas) == {0: '{"city": "Pa'}
    assert reader.finish("length") == ([], "length")


def test_a_named_call_streams_the_whole_answer_as_its_arguments():
    reader = NamedCallStream("get_weather")
    deltas = [d for piece in ("", '{"city"', ': "Paris"}') for d in reader.feed(piece)]
    assert arguments_by_index(deltas) == {0: '{"city": "Paris"}'}
    assert reader.finish("stop") == ([], "stop")


def test_auto_streams_content_then_whole_calls():
    reader = AutoCallStream(HermesToolParser(), parallel=True)
    text = 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    deltas = [d for i in range(0, len(text), 4) for d in reader.feed(text[i:i + 4])]
    rest, reason = reader.finish("stop")
    deltas += rest
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    assert arguments_by_index(deltas) == {0: '{"timezone": "UTC"}'} and reason == "tool_calls"
    plain = AutoCallStream(HermesToolParser(), parallel=True)
    assert plain.feed("Hello ") == [{"content": "Hello"}] and plain.finish("length") == ([{"content": " "}], "length")


# ----- the history reaches the template ------------------------------------------------------------

# renders the tools, each call's arguments as a mapping (as tool-use templates read them) and tool results
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
            "{% for m in messages %}[{{ m.role }}]{% for c in m.tool_calls or [] %}<call {{ c.id }} "
            "{{ c.function.name }} city={{ c.function.arguments.city }}>{% endfor %}"
            "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{{ m.content }}{% endfor %}")
HISTORY = [*USER,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"}]


def test_tool_messages_reach_the_template_in_its_shape(default_tokenizer):
    from tests.engine.support import processor

    body = ChatCompletionRequest.model_validate_json(json.dumps({"messages": HISTORY, "tools": TOOLS}))
    messages = [m.as_template_message() for m in body.messages]
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": HISTORY[1]["tool_calls"]}
    assert messages[2] == {"role": "tool", "content": "22 degrees and sunny", "tool_call_id": "call_1"}
    chat = processor(default_tokenizer)
    options = {**body.template_options(False), "chat_template": TEMPLATE, "add_generation_prompt": False}
    text = default_tokenizer.decode(chat.apply_chat_template(messages, **options))
    assert text == ("<tools>get_weather;get_time;ping;</tools>[user]Weather in Paris, and the time?[assistant]"
                    "<call call_1 get_weather city=Paris>[tool](call_1)22 degrees and sunny")
    # the offline form (vLLM's LLM.chat messages): the same dicts, arguments given as a dict or as bad JSON
    offline = [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        {"id": "d", "function": {"name": "get_weather", "arguments": "not json"}}]}]
    text = default_tokenizer.decode(chat.apply_chat_template(offline, False, chat_template=TEMPLATE))
    assert "<call c get_weather city=Rome><call d get_weather city=>" in text


def test_offline_chat_takes_tools_and_leaves_the_answer_unparsed(default_llm):
    """vLLM's LLM.chat(..., tools=...): the tools reach the template; the answer is text."""
    prompt = default_llm.apply_chat_template(HISTORY, False, chat_template=TEMPLATE, tools=TOOLS)
    assert default_llm.get_tokenizer().decode(prompt).startswith("<tools>get_weather;get_time;ping;</tools>[user]")
    (output,) = default_llm.chat(USER, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False, tools=TOOLS)
    assert output.outputs[0].text and not hasattr(output.outputs[0], "tool_calls")
