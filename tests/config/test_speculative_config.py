"""`--speculative-config`: vLLM's JSON shape and defaults, what is refused (each refusal names
the key or value at fault), and the engine flags it cannot be combined with."""

from __future__ import annotations

import json

import pytest

from chunkserve.config.engine import EngineArgs
from chunkserve.config.speculative import DEFAULT_PROMPT_LOOKUP, MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from chunkserve.errors import InvalidRequestError

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
DRAFT = {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3}


def test_json_text_and_dict_parse_alike():
    from_text = SpeculativeConfig.parse(json.dumps(NGRAM))
    from_dict = SpeculativeConfig.parse(dict(NGRAM))
    assert from_text == from_dict == SpeculativeConfig("ngram", 4, 2, 3, None, "auto")
    assert not from_text.drafts_in_worker
    draft = SpeculativeConfig.parse(json.dumps({**DRAFT, "policy": "always"}))
    assert (draft.method, draft.model, draft.num_speculative_tokens, draft.policy) == (
        "draft_model", "/models/draft", 3, "always")
    assert draft.drafts_in_worker


def test_none_and_a_parsed_config_pass_through():
    config = SpeculativeConfig.parse(NGRAM)
    assert SpeculativeConfig.parse(config) is config
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("given, expected", [
    ({}, (DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP)),
    ({"prompt_lookup_min": 3}, (3, 3)),
    ({"prompt_lookup_max": 7}, (7, 7)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4)),
], ids=["neither", "min only", "max only", "both"])
def test_prompt_lookup_bounds_default_as_vllm(given, expected):
    assert DEFAULT_PROMPT_LOOKUP == 5
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == expected


def test_largest_allowed_k_is_accepted():
    config = SpeculativeConfig.parse({**NGRAM, "num_speculative_tokens": MAX_SPECULATIVE_TOKENS})
    assert config.num_speculative_tokens == MAX_SPECULATIVE_TOKENS


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram", "num_speculative_tokens": 4', "not valid JSON"),
    ("[1, 2]", "must be a JSON object, got list"),
    ({**NGRAM, "num_lookahead": 2}, "num_lookahead"),
    ({**NGRAM, "method": "eagle"}, "'eagle'"),
    ({"num_speculative_tokens": 4}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({**NGRAM, "num_speculative_tokens": 0}, r"num_speculative_tokens.*got 0"),
    ({**NGRAM, "num_speculative_tokens": True}, r"num_speculative_tokens.*got True"),
    ({**NGRAM, "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1},
     rf"num_speculative_tokens.*got {MAX_SPECULATIVE_TOKENS + 1}"),
    ({**NGRAM, "num_speculative_tokens": 2.0}, r"num_speculative_tokens.*got 2.0"),
    ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 3}, r"prompt_lookup_min \(4\).*prompt_lookup_max \(3\)"),
    ({**NGRAM, "prompt_lookup_min": 0}, r"prompt_lookup_min must be a positive integer, got 0"),
    ({**NGRAM, "prompt_lookup_max": "3"}, r"prompt_lookup_max must be a positive integer, got '3'"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, r'"draft_model" needs "model"'),
    ({**DRAFT, "model": "  "}, r'"draft_model" needs "model"'),
    ({**NGRAM, "model": "/models/draft"}, r'"ngram" takes no "model"'),
    ({**NGRAM, "policy": "never"}, r"policy must be one of.*'never'"),
], ids=["bad json", "not an object", "unknown key", "unknown method", "no method", "k missing", "k zero", "k bool",
        "k too large", "k float", "min above max", "min zero", "max not int", "draft without model",
        "draft blank model", "ngram with model", "bad policy"])
def test_refusals_name_what_is_wrong(value, message):
    with pytest.raises(InvalidRequestError, match=message):
        SpeculativeConfig.parse(value)


def test_unknown_keys_are_all_listed():
    with pytest.raises(InvalidRequestError) as error:
        SpeculativeConfig.parse({**NGRAM, "zeta": 1, "alpha": 2})
    assert "['alpha', 'zeta']" in str(error.value)


def test_engine_args_check_the_json_and_hand_it_to_the_scheduler():
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        EngineArgs(speculative_config="{")
    args = EngineArgs(speculative_config=json.dumps(NGRAM))
    assert args.scheduler_config(2048).speculative == SpeculativeConfig.parse(NGRAM)
    assert EngineArgs().scheduler_config(2048).speculative is None


def test_speculation_with_pipeline_parallelism_is_refused():
    with pytest.raises(InvalidRequestError, match="pipeline parallelism"):
        EngineArgs(speculative_config=json.dumps(NGRAM), pipeline_parallel_size=2)
    EngineArgs(pipeline_parallel_size=2)  # without speculation it is fine


def test_draft_model_with_tensor_parallelism_is_refused_but_ngram_is_not():
    with pytest.raises(InvalidRequestError, match=r'"draft_model" is not supported with tensor parallelism'):
        EngineArgs(speculative_config=DRAFT, tensor_parallel_size=2)
    assert EngineArgs(speculative_config=NGRAM, tensor_parallel_size=2).speculative().method == "ngram"
