"""Structured outputs through the real server on the tiny model, with the official `openai`
client: every request form is accepted and obeyed (OpenAI's response_format, vLLM's
structured_outputs, SGLang's /generate fields), an invalid schema, regex or grammar is a 400
naming the field and the problem, and the outputs obey their constraint: a choice is one of the
choices, a regex's output fullmatches it, and 20 seeded samples of a json_schema request
validate against the schema. The constraint alone decides these outputs' shape, so random
weights check it as well as real ones (better: they push against every branch of the grammar).

The server runs with --structured-outputs-config disable_any_whitespace (compact JSON, vLLM's
remedy for small models that loop on whitespace inside flexible JSON), so that a bounded
schema's answer ends well within max_tokens. An unbounded json_object ends only when the model
chooses to close it: that one check runs on SmolLM2 (the session `server`)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.hostile_server import check_engine_clean
from tests.server_process import API_KEY, start_server, stop_server
from tests.tiny_model import TINY_SERVER_ENV, tiny_server_flags

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
CLOSED_PERSON = {**PERSON, "additionalProperties": False}  # what strict mode makes of PERSON
EMAIL = r"[a-z]{1,10}\.[a-z]{1,10}@[a-z]{1,10}\.com"
ASK_PERSON = [{"role": "user", "content": "Invent a person. Answer in JSON with their name and age."}]


@pytest.fixture(scope="module")
def structured_server(tmp_path_factory, tiny_gguf):
    started = start_server(tmp_path_factory, *tiny_server_flags(tiny_gguf, max_model_len=1024),
                           "--structured-outputs-config", '{"backend": "auto", "disable_any_whitespace": true}',
                           name="structured-outputs", env=TINY_SERVER_ENV)
    yield started
    stop_server(started)


@pytest.fixture(scope="module")
def client(structured_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{structured_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def http(structured_server):
    with structured_server.client() as http_client:
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


def check_obeys(constraint: dict, text: str, finished: bool) -> None:
    """`text` obeys `constraint` (one structured_outputs / SGLang field); `finished`: it ended
    by itself (a "stop"), so a JSON answer must be whole. Every bounded constraint (choice,
    grammar, regex, a closed schema) ends well within the tests' 64 tokens, so it must finish; an
    open one (json_object, "$$ANY$$", a schema allowing more properties) may be cut off, and then
    is checked to be a compact object's beginning."""
    (kind, value), = constraint.items()
    if kind == "choice":
        assert finished and text in value, text
    elif kind in ("grammar", "ebnf"):  # both are 'root ::= "yes" | "no"'
        assert finished and text in ("yes", "no"), text
    elif kind == "regex":
        assert finished and re.fullmatch(value, text), text
    elif kind in ("json", "json_schema") and value != "$$ANY$$":
        schema = json.loads(value) if isinstance(value, str) else value
        if schema.get("additionalProperties") is False or finished:
            assert finished, text
            jsonschema.validate(json.loads(text), schema)
        else:
            assert text.startswith("{"), text
    elif finished:  # any JSON value, or (json_object) any object
        parsed = json.loads(text)
        assert kind != "json_object" or isinstance(parsed, dict), text
    else:
        assert text and (kind != "json_object" or text.startswith("{")), text


def constraint_of(form: dict) -> dict:
    """The one structured_outputs-style field a chat form asks for."""
    if "response_format" in form:
        response_format = form["response_format"]
        if response_format["type"] == "json_object":
            return {"json_object": True}
        assert response_format["json_schema"]["strict"]
        return {"json": CLOSED_PERSON}  # what strict mode makes of PERSON
    if "json_schema" in form:
        return {"json": form["json_schema"]}
    return form["structured_outputs"]


@pytest.mark.parametrize("form", CHAT_FORMS, ids=[json.dumps(f)[:50] for f in CHAT_FORMS])
def test_each_form_is_accepted_and_obeyed_on_chat_and_completions(client, model, form):
    response_format = form.get("response_format")
    extra_body = {key: value for key, value in form.items() if key != "response_format"}
    options = {"response_format": response_format} if response_format else {}
    chat = client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=64, extra_body=extra_body,
                                          **options)
    completion = client.completions.create(model=model, prompt="Answer:", max_tokens=64,
                                           extra_body={**extra_body, **options})
    for choice, text in ((chat.choices[0], chat.choices[0].message.content), (completion.choices[0],
                                                                             completion.choices[0].text)):
        assert choice.finish_reason in ("stop", "length")
        check_obeys(constraint_of(form), text, choice.finish_reason == "stop")


@pytest.mark.parametrize("sampling", [{"json_schema": json.dumps(PERSON)}, {"json_schema": "$$ANY$$"},
                                      {"regex": EMAIL}, {"ebnf": 'root ::= "yes" | "no"'}])
def test_each_sglang_generate_form_is_accepted_and_obeyed(http, sampling):
    response = http.post("/generate", json={"text": "Answer:", "sampling_params": {"max_new_tokens": 64, **sampling}})
    assert response.status_code == 200, response.text
    result = response.json()
    finish = result["meta_info"]["finish_reason"]["type"]
    assert finish in ("stop", "length")
    check_obeys(sampling, result["text"], finish == "stop")


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
def test_invalid_structured_outputs_are_a_400_naming_the_problem(client, model, structured_server, kwargs, param,
                                                                  problem):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=4, **kwargs)
    assert problem in refused.value.message
    assert refused.value.param == param
    check_engine_clean(structured_server)


def test_an_invalid_sglang_schema_is_a_400_naming_json_schema(http, structured_server):
    response = http.post("/generate", json={"text": "hi", "sampling_params": {"json_schema": '{"type": 3}'}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "json_schema" and error["message"].startswith("json_schema is not valid")
    check_engine_clean(structured_server)


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


def test_json_object_output_ends_by_itself_and_parses_as_an_object(server):
    """On SmolLM2 (the session server): an object has no bound, so only a real model closes it.
    Compact JSON asked per request (this server has no --structured-outputs-config); the
    response_format form of json_object is checked on the tiny server above."""
    with server.client() as http:
        response = http.post("/v1/chat/completions", json={
            "temperature": 0, "max_tokens": 256,
            "messages": [{"role": "user", "content": "Describe Paris as a JSON object with the keys city and country."}],
            "structured_outputs": {"json_object": True, "disable_any_whitespace": True}})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_json_schema_outputs_validate_for_20_seeded_samples(client, model):
    answer = client.chat.completions.create(
        model=model, n=20, seed=1234, max_tokens=256, messages=ASK_PERSON,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert len(answer.choices) == 20
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), CLOSED_PERSON)


def test_sglang_json_schema_output_validates(http):
    """A closed schema: its answer is bounded, so it ends by itself even on random weights."""
    response = http.post("/generate", json={"text": "A person, as JSON: ", "sampling_params": {
        "json_schema": json.dumps(CLOSED_PERSON), "max_new_tokens": 256, "temperature": 0}})
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["meta_info"]["finish_reason"]["type"] == "stop", result["text"]
    jsonschema.validate(json.loads(result["text"]), CLOSED_PERSON)


def test_compile_and_mask_times_are_in_metrics(structured_server, client, model):
    client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=64, temperature=0,
                                   response_format={"type": "json_object"})
    metrics = structured_server.wait_until(lambda m: m.get("chunkserve:structured_output_mask_seconds_count{}", 0) > 0)
    assert metrics["chunkserve:structured_output_compile_seconds_count{}"] >= 1
    assert metrics["chunkserve:structured_output_compile_seconds_sum{}"] > 0
