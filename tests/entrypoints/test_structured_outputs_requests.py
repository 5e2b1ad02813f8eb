"""Every request form that asks for structured outputs becomes the same StructuredOutputsParams:
OpenAI's response_format, vLLM's structured_outputs, SGLang's json_schema / regex / ebnf /
structural_tag (in /generate's sampling_params and on its OpenAI bodies), and the offline
SamplingParams. Two forms in one request, vLLM's removed guided_* fields and an invalid schema,
regex or grammar are refused naming the body's own field; --structured-outputs-config parses in
vLLM's shape, refuses backends other than llguidance, and its defaults reach the input processor."""

from __future__ import annotations

import json
import logging
import re

import pytest

from chunkserve.config.engine import EngineArgs
from chunkserve.config.limits import RequestLimits
from chunkserve.config.model import resolve_model
from chunkserve.config.structured_outputs import StructuredOutputsConfig
from chunkserve.core.disagg.protocol import TransferParams
from chunkserve.engine.input_processor import InputProcessor
from chunkserve.engine.messages import EngineInfo
from chunkserve.entrypoints.cli import _serve_args, build_parser
from chunkserve.entrypoints.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from chunkserve.entrypoints.server.protocol import rename_error
from chunkserve.entrypoints.server.sglang_protocol import GenerateRequest, GenerateSamplingParams
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TAG = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
       "triggers": ["<f"]}
P = StructuredOutputsParams
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def openai_params(body: dict, chat: bool = True) -> StructuredOutputsParams | None:
    request = ChatCompletionRequest.model_validate({**CHAT, **body}) if chat else \
        CompletionRequest.model_validate({"prompt": "hi", **body})
    request.check_fields()
    params = request.chat_sampling_params() if chat else request.sampling_params(16, None)
    return params.structured_outputs


def generate_params(sampling: dict) -> StructuredOutputsParams | None:
    given = GenerateSamplingParams.model_validate(sampling)
    given.check_fields()
    return given.to_sampling_params(stream=False).structured_outputs


OPENAI_FORMS = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, P(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}, P(json=SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}},
     P(json=SCHEMA, disable_additional_properties=True)),  # OpenAI's strict mode: objects closed
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": False}}},
     P(json=SCHEMA)),
    ({"response_format": TAG}, P(structural_tag=json.dumps(TAG))),
    ({"structured_outputs": {"json": SCHEMA}}, P(json=SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, P(json=json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[a-z]+"}}, P(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, P(choice=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, P(grammar='root ::= "a" | "b"')),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     P(json_object=True, disable_any_whitespace=True)),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG)}}, P(structural_tag=json.dumps(TAG))),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     P(json=SCHEMA, disable_additional_properties=True)),
    # SGLang's OpenAI extras
    ({"json_schema": json.dumps(SCHEMA)}, P(json=json.dumps(SCHEMA))),
    ({"regex": "[0-9]+"}, P(regex="[0-9]+")),
    ({"ebnf": 'root ::= "x"'}, P(grammar='root ::= "x"')),
    ({}, None),
]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("body,expected", OPENAI_FORMS, ids=[json.dumps(b)[:60] for b, _ in OPENAI_FORMS])
def test_each_openai_form_becomes_structured_outputs_params(body, expected, chat):
    assert openai_params(body, chat) == expected


GENERATE_FORMS = [
    ({"json_schema": json.dumps(SCHEMA)}, P(json=json.dumps(SCHEMA))),
    ({"json_schema": "$$ANY$$"}, P(json="{}")),  # SGLang's any-JSON sentinel
    ({"regex": "[0-9]+"}, P(regex="[0-9]+")),
    ({"ebnf": 'root ::= "a" | "b"'}, P(grammar='root ::= "a" | "b"')),
    ({"structural_tag": json.dumps(TAG)}, P(structural_tag=json.dumps(TAG))),
    ({}, None),
]


@pytest.mark.parametrize("sampling,expected", GENERATE_FORMS, ids=[json.dumps(s)[:40] for s, _ in GENERATE_FORMS])
def test_each_sglang_generate_form_becomes_structured_outputs_params(sampling, expected):
    assert generate_params({"max_new_tokens": 8, **sampling}) == expected


REFUSED = [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "response_format and structured_outputs"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "give one of"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice must be a non-empty list"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "disable_any_whitespace"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs json_schema"),
    ({"regex": ""}, "regex", "regex must be a non-empty string"),
    ({"guided_json": SCHEMA}, "guided_json", 'structured_outputs {"json"'),
    ({"guided_regex": "a+"}, "guided_regex", 'structured_outputs {"regex"'),
    ({"guided_choice": ["a"]}, "guided_choice", 'structured_outputs {"choice"'),
    ({"guided_grammar": "start: x"}, "guided_grammar", 'structured_outputs {"grammar"'),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "structured_outputs"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "disable_any_whitespace"),
    ({"structural_tag": json.dumps(TAG)}, "structural_tag", "structured_outputs"),
    ({"use_beam_search": True, "n": 2, "regex": "a"}, "use_beam_search", "structured outputs"),
]


@pytest.mark.parametrize("body,param,message", REFUSED, ids=[json.dumps(b)[:60] for b, _, _ in REFUSED])
def test_conflicting_removed_or_malformed_forms_are_refused_naming_the_field(body, param, message):
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(")) as refused:
        openai_params(body)
    assert refused.value.param == param


def test_an_unknown_structured_outputs_key_is_refused_by_name():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="structured_outputs.frobnicate"):
        ChatCompletionRequest.model_validate({**CHAT, "structured_outputs": {"regex": "a", "frobnicate": 1}})


def test_sglang_forms_outside_sampling_params_are_refused_not_dropped():
    body = GenerateRequest.model_validate({"text": "hi", "json_schema": json.dumps(SCHEMA)})
    with pytest.raises(InvalidRequestError, match="json_schema is not supported: it goes in sampling_params"):
        body.check_fields()


def test_two_sglang_forms_in_generate_are_refused():
    with pytest.raises(InvalidRequestError, match="regex and ebnf") as refused:
        generate_params({"regex": "a", "ebnf": 'root ::= "a"'})
    assert refused.value.param == "ebnf"


# ----- validation in the input processor: every path (server, /generate, offline) ---------------

def processor(tokenizer, **kwargs) -> InputProcessor:
    limits = RequestLimits(max_prompt_chars=4096, max_stop_sequences=4, max_stop_sequence_chars=64,
                           max_stop_token_ids=4, max_logit_bias=4)
    return InputProcessor(tokenizer, resolve_model(None), EngineInfo("m", 2048, len(tokenizer)), limits, **kwargs)


@pytest.fixture(scope="module")
def inputs(default_tokenizer) -> InputProcessor:
    return processor(default_tokenizer)


def server_error(inputs: InputProcessor, request, params: SamplingParams) -> InvalidRequestError:
    """What the server answers: the input processor's error, renamed as Serving._add_all does."""
    with pytest.raises(InvalidRequestError) as refused:
        inputs.process("r", "hi", params)
    return rename_error(refused.value, request.structured_outputs_names())


INVALID = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "response_format.json_schema.schema is not valid: Invalid type: nonsense"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "structured_outputs.regex is not valid"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "structured_outputs.json is not JSON"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs",
     'structured_outputs.grammar is not valid: .*unknown name: "undefined_rule"'),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
     "structured_outputs.structural_tag is not a valid structural tag"),
    ({"json_schema": '{"type": "nonsense"}'}, "json_schema", "^json_schema is not valid: Invalid type: nonsense"),
    ({"regex": "a(b"}, "regex", "^regex is not valid: .*unclosed group"),
    ({"ebnf": "root ::= undefined"}, "ebnf", "^ebnf is not a valid grammar: .*'undefined' not found"),
]


@pytest.mark.parametrize("body,param,message", INVALID, ids=[json.dumps(b)[:60] for b, _, _ in INVALID])
def test_an_invalid_schema_regex_or_grammar_is_refused_naming_the_body_field_and_the_problem(inputs, body, param,
                                                                                               message):
    request = ChatCompletionRequest.model_validate({**CHAT, **body})
    error = server_error(inputs, request, request.chat_sampling_params())
    assert error.param == param
    assert re.search(message, str(error), re.S), str(error)


@pytest.mark.parametrize("sampling,param,message", [
    ({"json_schema": '{"type": "object", "properties": 5}'}, "json_schema", "^json_schema is not valid"),
    ({"json_schema": "{oops"}, "json_schema", "^json_schema is not JSON"),
    ({"regex": "(("}, "regex", "^regex is not valid"),
    ({"ebnf": "root ::= missing"}, "ebnf", "^ebnf is not a valid grammar"),
    ({"structural_tag": '{"structures": []}'}, "structural_tag", "^structural_tag is not a valid structural tag"),
])
def test_an_invalid_generate_form_is_refused_naming_sglangs_field(inputs, sampling, param, message):
    given = GenerateSamplingParams.model_validate({"max_new_tokens": 4, **sampling})
    error = server_error(inputs, given, given.to_sampling_params(stream=False))
    assert error.param == param
    assert re.search(message, str(error), re.S), str(error)


def test_valid_forms_pass_the_input_processor_unchanged(inputs):
    for _, expected in OPENAI_FORMS + GENERATE_FORMS:
        if expected is not None:
            request, _ = inputs.process("r", "hi", SamplingParams(structured_outputs=expected))
            assert request.sampling_params.structured_outputs == expected


def test_offline_structured_outputs_are_exported_and_validated(inputs):
    from chunkserve import StructuredOutputsParams as Exported

    assert Exported is StructuredOutputsParams
    request, _ = inputs.process("r", "hi", SamplingParams(structured_outputs=Exported(choice=["a", "b"])))
    assert request.sampling_params.structured_outputs.choice == ["a", "b"]
    with pytest.raises(InvalidRequestError, match="structured_outputs.regex is not valid") as refused:
        inputs.process("r", "hi", SamplingParams(structured_outputs=Exported(regex="[z-a]")))
    assert refused.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Exported(regex="a", choice=["a"])


def test_the_servers_defaults_reach_every_request(default_tokenizer):
    compact = processor(default_tokenizer, structured_outputs=StructuredOutputsConfig(
        disable_any_whitespace=True, disable_additional_properties=True))
    request, _ = compact.process("r", "hi", SamplingParams(structured_outputs=P(json=SCHEMA)))
    assert request.sampling_params.structured_outputs == P(json=SCHEMA, disable_any_whitespace=True,
                                                           disable_additional_properties=True)
    plain, _ = compact.process("r", "hi", SamplingParams())
    assert plain.sampling_params.structured_outputs is None
    default, _ = processor(default_tokenizer).process("r", "hi", SamplingParams(structured_outputs=P(json=SCHEMA)))
    assert default.sampling_params.structured_outputs == P(json=SCHEMA)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_disaggregation_refuses_structured_outputs(default_tokenizer, mode):
    instance = processor(default_tokenizer, disaggregation_mode=mode)
    pairing = TransferParams(1, "127.0.0.1", 8998)
    instance.process("r", "hi", SamplingParams(), kv_transfer_params=pairing)  # unconstrained: as before
    with pytest.raises(InvalidRequestError, match="not supported with prefill/decode disaggregation") as refused:
        instance.process("r", "hi", SamplingParams(structured_outputs=P(regex="a")), kv_transfer_params=pairing)
    assert refused.value.param == "structured_outputs"
    request = ChatCompletionRequest.model_validate({**CHAT, "response_format": {"type": "json_object"}})
    renamed = rename_error(refused.value, request.structured_outputs_names())
    assert renamed.param == "response_format" and str(renamed).startswith("response_format is not supported")


def test_renaming_touches_only_whole_names():
    error = InvalidRequestError("structured_outputs.json is not valid (structured_outputs.json_object, "
                                "my_structured_outputs)", "structured_outputs")
    renamed = rename_error(error, {"structured_outputs": "json_schema", "structured_outputs.json": "json_schema"})
    assert str(renamed) == "json_schema is not valid (json_schema.json_object, my_structured_outputs)"
    assert rename_error(error, {"max_tokens": "max_new_tokens"}) is error


# ----- --structured-outputs-config ----------------------------------------------------------------

def serve(*flags: str):
    return _serve_args(build_parser().parse_args(["serve", "m", *flags]))


@pytest.mark.parametrize("value,expected", [
    (None, StructuredOutputsConfig()),
    ('{"backend": "auto"}', StructuredOutputsConfig()),
    ('{"backend": "guidance", "disable_any_whitespace": true}', StructuredOutputsConfig("guidance", True)),
    ('{"backend": "llguidance", "disable_additional_properties": true, "disable_fallback": true}',
     StructuredOutputsConfig("llguidance", False, True)),
    ({"disable_any_whitespace": True}, StructuredOutputsConfig("auto", True)),  # the Python API's dict
    ('{"reasoning_parser": "", "enable_in_reasoning": false}', StructuredOutputsConfig()),  # vLLM's defaults
])
def test_the_config_parses_in_vllms_shape(value, expected):
    assert EngineArgs(structured_outputs_config=value).structured_outputs() == expected


@pytest.mark.parametrize("value,message", [
    ('{"backend": "xgrammar"}', "measured .*llguidance .*docs/STRUCTURED_OUTPUTS.md"),
    ('{"backend": "outlines"}', "llguidance"),
    ('{"backend": "lm-format-enforcer"}', "llguidance"),
    ('{"backend": "magic"}', "must be one of"),
    ('{"backend": "auto", "frobnicate": 1}', r"unknown key\(s\) \['frobnicate'\]"),
    ('{"disable_any_whitespace": "yes"}', "disable_any_whitespace must be true or false"),
    ('{"reasoning_parser": "deepseek_r1"}', "reasoning_parser is not supported"),
    ("{oops", "not valid JSON"),
    ("[1]", "must be a JSON object"),
])
def test_the_config_refuses_what_it_cannot_honour(value, message):
    with pytest.raises(InvalidRequestError, match=message):
        EngineArgs(structured_outputs_config=value)


def test_the_launch_flag_reaches_the_engine_args():
    engine, _ = serve("--structured-outputs-config", '{"backend": "auto", "disable_any_whitespace": true}')
    assert engine.structured_outputs() == StructuredOutputsConfig("auto", True)
    with pytest.raises(InvalidRequestError, match="llguidance"):
        serve("--structured-outputs-config", '{"backend": "xgrammar"}')


def test_older_and_sglang_backend_flags_accept_llguidance_and_refuse_the_rest(caplog):
    with caplog.at_level(logging.INFO, logger="chunkserve.entrypoints.foreign_flags"):
        serve("--guided-decoding-backend", "guidance")
        serve("--grammar-backend", "llguidance")
    assert "--guided-decoding-backend guidance: structured outputs are constrained with llguidance" in caplog.text
    with pytest.raises(InvalidRequestError, match="--guided-decoding-backend xgrammar is not supported.*"
                                                  "--structured-outputs-config"):
        serve("--guided-decoding-backend", "xgrammar")
    with pytest.raises(InvalidRequestError, match="--grammar-backend outlines is not supported.*llguidance"):
        serve("--grammar-backend", "outlines")
