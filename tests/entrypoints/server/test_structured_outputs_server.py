"""Structured outputs through the real server on the default SmolLM2 model, with the official
`openai` client: every request form is accepted (OpenAI's response_format, vLLM's
structured_outputs, SGLang's /generate fields), an invalid schema, regex or grammar is a 400
naming the field and the problem, and the outputs obey their constraint: a choice is one of the
choices, a regex's output fullmatches it, json_object's output parses to an object, and 20 seeded
samples of a json_schema request validate against the schema.

The server runs with --structured-outputs-config disable_any_whitespace (compact JSON, vLLM's
remedy for small models that loop on whitespace inside flexible JSON), so that JSON answers end
well within max_tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.hostile_server import check_engine_clean
from tests.server_process import API_KEY, start_server, stop_server

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
CLOSED_PERSON = {**PERSON, "additionalProperties": False}  # what strict mode makes of PERSON
EMAIL = r"[a-z]{1,10}\.[a-z]{1,10}@[a-z]{1,10}\.com"
ASK_PERSON = [{"role": "user", "content": "Invent a person. Answer in JSON with their name and age."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = start_server(tmp_path_factory, "--max-model-len", "1024", "--kv-cache-memory-gb", "1",
                           "--structured-outputs-config", '{"backend": "auto", "disable_any_whitespace": true}',
                           name="structured-outputs")
    yield started
    stop_server(started)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def http(server):
    with server.client() as http_client:
        yield http_client


# ----- every form is accepted ---------------------------------------------------------------------

CHAT_FORMS = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"choice": ["yes", "no"]}},
    {"structured_outputs": {"regex": EMAIL}},
    {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
    {"json_schema": json.dumps(PERSON)},  # SGLang's OpenAI extra
]


@pytest.mark.parametrize("form", CHAT_FORMS, ids=[json.dumps(f)[:50] for f in CHAT_FORMS])
def test_each_form_is_accepted_on_chat_and_completions(client, model, form):
    response_format = form.get("response_format")
    extra_body = {key: value for key, value in form.items() if key != "response_format"}
    options = {"response_format": response_format} if response_format else {}
    chat = client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=4, extra_body=extra_body,
                                          **options)
    assert chat.choices[0].finish_reason in ("stop", "length")
    completion = client.completions.create(model=model, prompt="Answer:", max_tokens=4,
                                           extra_body={**extra_body, **options})
    assert completion.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("sampling", [{"json_schema": json.dumps(PERSON)}, {"json_schema": "$$ANY$$"},
                                      {"regex": EMAIL}, {"ebnf": 'root ::= "yes" | "no"'}])
def test_each_sglang_generate_form_is_accepted(http, sampling):
    response = http.post("/generate", json={"text": "Answer:", "sampling_params": {"max_new_tokens": 4, **sampling}})
    assert response.status_code == 200, response.text


# ----- invalid input is a 400 naming the field and the problem ------------------------------------

@pytest.mark.parametrize("kwargs,param,problem", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "response_format.json_schema.schema is not valid: Invalid type: nonsense"),
    ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs", "unclosed group"),
    ({"extra_body": {"structured_outputs": {"json": "{not json"}}}, "structured_outputs",
     "structured_outputs.json is not JSON"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: nowhere"}}}, "structured_outputs",
     'unknown name: "nowhere"'),
    ({"extra_body": {"guided_json": PERSON}}, "guided_json", 'send structured_outputs {"json": SCHEMA}'),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     "structured_outputs", "response_format and structured_outputs both ask"),
])
def test_invalid_structured_outputs_are_a_400_naming_the_problem(client, model, server, kwargs, param, problem):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=4, **kwargs)
    assert problem in refused.value.message
    assert refused.value.param == param
    check_engine_clean(server)


def test_an_invalid_sglang_schema_is_a_400_naming_json_schema(http, server):
    response = http.post("/generate", json={"text": "hi", "sampling_params": {"json_schema": '{"type": 3}'}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "json_schema" and error["message"].startswith("json_schema is not valid")
    check_engine_clean(server)


# ----- outputs obey their constraint (needs the engine's grammar bitmask) ---------------------------

def test_choice_returns_one_of_the_choices(client, model):
    choices = ["positive", "negative", "neutral"]
    answer = client.chat.completions.create(
        model=model, n=8, seed=3, max_tokens=16,
        messages=[{"role": "user", "content": "Classify the sentiment: 'I love this film!'"}],
        extra_body={"structured_outputs": {"choice": choices}})
    assert all(choice.message.content in choices for choice in answer.choices), \
        [choice.message.content for choice in answer.choices]


def test_regex_output_fullmatches(client, model):
    answer = client.completions.create(model=model, n=8, seed=5, max_tokens=64,
                                       prompt="The email address of Alan Turing at Enigma is",
                                       extra_body={"structured_outputs": {"regex": EMAIL}})
    texts = [choice.text for choice in answer.choices]
    assert all(re.fullmatch(EMAIL, text) for text in texts), texts


def test_json_object_output_parses_as_an_object(client, model):
    answer = client.chat.completions.create(
        model=model, temperature=0, max_tokens=256,
        messages=[{"role": "user", "content": "Describe Paris as a JSON object with the keys city and country."}],
        response_format={"type": "json_object"})
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_json_schema_outputs_validate_for_20_seeded_samples(client, model):
    answer = client.chat.completions.create(
        model=model, n=20, seed=1234, max_tokens=256, messages=ASK_PERSON,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert len(answer.choices) == 20
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), CLOSED_PERSON)


def test_sglang_json_schema_output_validates(http):
    response = http.post("/generate", json={"text": "A person, as JSON: ", "sampling_params": {
        "json_schema": json.dumps(PERSON), "max_new_tokens": 256, "temperature": 0}})
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["meta_info"]["finish_reason"]["type"] == "stop", result["text"]
    jsonschema.validate(json.loads(result["text"]), PERSON)


def test_compile_and_mask_times_are_in_metrics(server, client, model):
    client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=64, temperature=0,
                                   response_format={"type": "json_object"})
    metrics = server.wait_until(lambda m: m.get("chunkserve:structured_output_mask_seconds_count{}", 0) > 0)
    assert metrics["chunkserve:structured_output_compile_seconds_count{}"] >= 1
    assert metrics["chunkserve:structured_output_compile_seconds_sum{}"] > 0
