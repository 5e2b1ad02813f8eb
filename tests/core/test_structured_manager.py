"""The grammar manager with the default model's tokenizer: grammars compile off the caller's
thread and are cached by their text; a bitmask row allows exactly the tokens that keep the
output inside the grammar, one row per draft position, and leaves the matcher as it was; only
accepted tokens advance it; a bad grammar or an output outside it is reported, not raised
into the step loop."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from chunkserve.config.model import resolve_model
from chunkserve.core.structured.grammar import validate
from chunkserve.core.structured.manager import GrammarError, StructuredOutputManager
from chunkserve.engine.tokenizer import load_tokenizer
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import StructuredOutputsParams

VOCAB = 49152  # SmolLM2's


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture
def manager(tokenizer):
    created = StructuredOutputManager(lambda: tokenizer, VOCAB)
    yield created
    created.shutdown()


def ready(manager: StructuredOutputManager, request_id: str) -> None:
    for _ in range(500):
        if manager.is_ready(request_id):
            return
        manager.wait_for_compiles(0.05)
    raise AssertionError("the grammar never compiled")


def allowed(mask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(mask_row.astype("<i4").view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.flatnonzero(bits).tolist())


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_choice_allows_exactly_the_first_tokens_of_its_choices(manager, tokenizer):
    manager.add("r", StructuredOutputsParams(choice=["yes", "no"]))
    ready(manager, "r")
    first = allowed(manager.bitmask("r", [])[0])
    assert encode(tokenizer, "yes")[0] in first and encode(tokenizer, "no")[0] in first
    assert encode(tokenizer, "maybe")[0] not in first and tokenizer.eos_token_id not in first
    manager.accept("r", encode(tokenizer, "yes"))
    assert allowed(manager.bitmask("r", [])[0]) == {tokenizer.eos_token_id}  # complete: only EOS may follow
    assert manager.is_terminated("r")


def test_draft_rows_each_follow_the_drafts_before_them_and_leave_the_matcher_unmoved(manager, tokenizer):
    manager.add("r", StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"))
    ready(manager, "r")
    drafts = encode(tokenizer, "123-45")
    assert manager.num_valid_drafts("r", drafts + encode(tokenizer, "x")) == len(drafts)
    before = manager.bitmask("r", [])
    rows = manager.bitmask("r", drafts)
    assert rows.shape == (1 + len(drafts), (VOCAB + 31) // 32)
    assert np.array_equal(rows[0], before[0])  # nothing was consumed for good
    manager.accept("r", drafts[:2])
    assert np.array_equal(manager.bitmask("r", [])[0], rows[2])  # row j = after the first j drafts
    assert not manager.is_terminated("r")


def test_a_token_outside_the_grammar_is_a_grammar_error(manager, tokenizer):
    manager.add("r", StructuredOutputsParams(json={"type": "object"}))
    ready(manager, "r")
    with pytest.raises(GrammarError, match="left its grammar"):
        manager.accept("r", encode(tokenizer, "hello"))


def test_compiles_run_off_the_callers_thread_and_are_cached_by_grammar(manager):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    manager.add("first", StructuredOutputsParams(json=schema))
    ready(manager, "first")
    manager.add("second", StructuredOutputsParams(json=json.dumps(schema)))  # the same grammar as text
    ready(manager, "second")
    assert (manager.cache_misses, manager.cache_hits) == (1, 1)
    assert len(manager.take_compile_seconds()) == 1 and manager.take_compile_seconds() == []


def test_an_imported_requests_output_is_replayed_into_its_grammar(manager, tokenizer):
    manager.add("r", StructuredOutputsParams(choice=["yes please", "no thanks"]), replay=encode(tokenizer, "yes"))
    ready(manager, "r")
    assert encode(tokenizer, " please")[0] in allowed(manager.bitmask("r", [])[0])
    manager.add("bad", StructuredOutputsParams(choice=["yes"]), replay=encode(tokenizer, "no"))
    manager.wait_for_compiles(5)
    assert "outside its grammar" in manager.take_failures()["bad"]


@pytest.mark.parametrize("params, message", [
    (StructuredOutputsParams(regex="[a-"), "unclosed character class"),
    (StructuredOutputsParams(json="{not json"), "is not JSON"),
    (StructuredOutputsParams(json={"type": "nonsense"}), "nonsense"),
    (StructuredOutputsParams(grammar="start: missing_rule"), "missing_rule"),
    (StructuredOutputsParams(structural_tag=json.dumps({"structures": [], "triggers": []})), "no structures"),
])
def test_invalid_grammars_are_refused_by_name_before_the_engine(params, message):
    with pytest.raises(InvalidRequestError, match=message) as refused:
        validate(params)
    assert refused.value.param == "structured_outputs"


@pytest.mark.parametrize("fields", [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"regex": ""}])
def test_params_take_exactly_one_well_formed_constraint(fields):
    with pytest.raises(InvalidRequestError):
        StructuredOutputsParams(**fields)


def test_prepare_loads_the_vocabulary_once_before_the_first_grammar(tokenizer):
    """A server's engine core loads the vocabulary as soon as it is up, so its first grammar
    only compiles; the tokenizer is loaded once, on the compile thread."""
    import threading

    loads = []

    def factory():
        loads.append(threading.current_thread().name)
        return tokenizer

    manager = StructuredOutputManager(factory, VOCAB)
    try:
        manager.prepare()
        deadline = time.monotonic() + 60
        while not loads and time.monotonic() < deadline:  # before any grammar is asked for
            time.sleep(0.01)
        assert len(loads) == 1 and loads[0].startswith("chunkserve-grammar")
        manager.add("r", StructuredOutputsParams(choice=["yes", "no"]))
        ready(manager, "r")
        assert len(loads) == 1
    finally:
        manager.shutdown()
