"""A request's StructuredOutputsParams -> the grammar llguidance compiles (the backend chosen by
measurement: benchmarks/engine/grammar_backends.py, docs/STRUCTURED_OUTPUTS.md), and its validation.

Every form becomes llguidance's grammar text the way vLLM's guidance backend builds it: a JSON
schema through llguidance's JSON compiler (whitespace flexible unless `disable_any_whitespace`),
`json_object` as the schema `{"type": "object"}`, regex, choice and Lark/GBNF through
`grammar_from`, structural tags as llguidance's StructTag grammar. The text is also the key of
the compiled-grammar cache."""

from __future__ import annotations

import json
from typing import Any

from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import StructuredOutputsParams

COMBINATORS = frozenset({"anyOf", "oneOf", "allOf"})


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for `params`. Raises InvalidRequestError for input that is not even
    well-formed (a schema that is not JSON, a structural tag without structures); whether the
    grammar compiles is `validate`'s question."""
    import llguidance

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = _schema(params.json) if kind == "json" else {"type": "object"}
        if params.disable_additional_properties:
            schema = _without_additional_properties(schema)
        options = {"whitespace_flexible": not params.disable_any_whitespace, "coerce_one_of": True}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        except ValueError as error:
            raise InvalidRequestError(f"structured_outputs.json is not a valid JSON schema: {error}",
                                      "structured_outputs") from None
    if kind == "regex":
        return llguidance.grammar_from("regex", params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    if kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", params.grammar)
        except Exception as error:  # a GBNF grammar llguidance cannot convert to Lark
            raise InvalidRequestError(f"structured_outputs.grammar is not a valid grammar: {error}",
                                      "structured_outputs") from None
    return _structural_tag_grammar(params.structural_tag)


def validate(params: StructuredOutputsParams) -> None:
    """Compile-check the grammar (no tokenizer needed, a few ms): InvalidRequestError naming
    the problem, so a bad schema or regex is a 400 before the request reaches the engine."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_text(params))
    if error:
        raise InvalidRequestError(f"structured_outputs.{params.kind} is not valid: {error}", "structured_outputs")


def _schema(value: dict | str) -> dict:
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as error:
        raise InvalidRequestError(f"structured_outputs.json is not JSON: {error}", "structured_outputs") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError("structured_outputs.json must be a JSON schema (an object)", "structured_outputs")
    return schema


def _without_additional_properties(schema: Any) -> Any:
    """Every object schema that does not say otherwise takes only the properties it names
    (vLLM's rule), except one whose properties are in its anyOf/oneOf/allOf branches: closing
    it would refuse every branch's properties."""
    if isinstance(schema, list):
        return [_without_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: _without_additional_properties(value) for key, value in schema.items()}
    if (result.get("type") == "object" or "properties" in result) and not COMBINATORS & result.keys():
        result.setdefault("additionalProperties", False)
    return result


def _structural_tag_grammar(text: str) -> str:
    """vLLM's structural tag: {"type": "structural_tag", "structures": [{"begin", "schema",
    "end"}], "triggers": [...]}: free text, in which each structure (entered when its begin,
    which starts with one of the triggers, is written) follows its schema up to its end."""
    import llguidance

    try:
        tag = json.loads(text)
        triggers = tag["triggers"]
        tags = []
        for structure in tag["structures"]:
            trigger = next((t for t in triggers if structure["begin"].startswith(t)), None)
            if trigger is None:
                raise ValueError(f"the begin {structure['begin']!r} starts with none of the triggers {triggers}")
            tags.append(llguidance.StructTag(trigger=trigger, begin=structure["begin"], grammar=structure["schema"],
                                             end=structure["end"]))
        if not tags:
            raise ValueError("it has no structures")
        return llguidance.StructTag.to_grammar(tags)
    except (ValueError, KeyError, TypeError, AssertionError) as error:
        raise InvalidRequestError(f"structured_outputs.structural_tag is not a valid structural tag: {error!s}",
                                  "structured_outputs") from None
