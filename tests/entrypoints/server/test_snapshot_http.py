"""A request moved between two real server processes on the tiny model: streamed on one,
exported there (/export_request, pause), continued on the other (/import_request): the text and
tokens equal one uninterrupted run, and both servers end idle with every KV block back.

The exporting server runs with the test step delay, so a 256-token request decodes for
256 x STEP_DELAY_MS (10 s): the export, sent after its first tokens, finds it running by
construction (and the test asserts it stopped short of 256). The importing server has no delay."""

from __future__ import annotations

import json

import pytest

from chunkserve.engine.core import TEST_STEP_DELAY_ENV
from tests.server_process import start_server, stop_server, wait_until_up
from tests.tiny_model import STEP_DELAY_MS, TINY_SERVER_ENV, tiny_server_flags

BODY = {"text": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "sampling_params": {"max_new_tokens": 256, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory, tiny_gguf):
    flags = [*tiny_server_flags(tiny_gguf), "--max-num-batched-tokens", "64"]
    first = start_server(tmp_path_factory, *flags, name="export-a",
                         env={**TINY_SERVER_ENV, TEST_STEP_DELAY_ENV: str(STEP_DELAY_MS)}, wait=False)
    second = start_server(tmp_path_factory, *flags, name="import-b", env=TINY_SERVER_ENV, wait=False)
    wait_until_up(first)  # both start at once
    wait_until_up(second)
    yield first, second
    stop_server(first)
    stop_server(second)


def events(response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_request_exported_from_one_server_finishes_on_another(two_servers):
    first, second = two_servers
    with second.client() as http:
        reference = http.post("/generate", json=BODY).json()
    with first.client() as http, first.admin_client() as admin:
        with http.stream("POST", "/generate", json={**BODY, "rid": "moving", "stream": True}) as stream:
            lines = stream.iter_lines()
            seen = []
            for line in lines:  # a few tokens in, the request moves
                if line.startswith("data: "):
                    seen.append(json.loads(line[len("data: "):]))
                if seen:  # the request runs: it moves now, long before its 256th token
                    break
            exported = admin.post("/export_request", params={"rid": "moving", "mode": "pause"})
            assert exported.status_code == 200, exported.text
            rest = [json.loads(line[len("data: "):]) for line in lines
                    if line.startswith("data: ") and line != "data: [DONE]"]
        last_here = (seen + rest)[-1]
        assert last_here["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(last_here["output_ids"]) < 256
    with second.admin_client() as admin:
        imported = admin.post("/import_request", content=exported.content)
        assert imported.status_code == 200, imported.text
        result = imported.json()
    assert result["output_ids"] == reference["output_ids"]
    assert result["text"] == reference["text"]
    assert result["meta_info"]["id"] == "moving"
    assert reference["text"].startswith(last_here["text"])
    for server in (first, second):
        assert server.check()["ok"], server.check()


def test_streamed_import_continues_the_text(two_servers):
    first, second = two_servers
    with second.client() as http:
        reference = http.post("/generate", json=BODY).json()
    with first.client() as http, first.admin_client() as admin:
        with http.stream("POST", "/generate", json={**BODY, "rid": "moving-2", "stream": True}) as stream:
            lines = stream.iter_lines()  # held: a closed iterator would close the stream, aborting the request
            for line in lines:
                if line.startswith("data: "):
                    break
            exported = admin.post("/export_request", params={"rid": "moving-2", "mode": "copy"})
            assert exported.status_code == 200, exported.text  # it was running: a finished one is not exported
            after = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])
            # copy: it goes on here (until the client leaves, which aborts it)
            assert after["meta_info"]["finish_reason"] is None and len(after["output_ids"]) < 256
    with second.admin_client() as admin, admin.stream("POST", "/import_request", params={"stream": "true"},
                                                      content=exported.content) as imported:
        assert imported.status_code == 200
        final = events(imported)[-1]
    assert (final["text"], final["output_ids"]) == (reference["text"], reference["output_ids"])
    for server in (first, second):
        assert server.check()["ok"], server.check()


def test_snapshot_errors_are_client_errors(two_servers):
    first, _ = two_servers
    with first.admin_client() as admin:
        missing = admin.post("/export_request", params={"rid": "nobody"})
        assert missing.status_code == 400 and "no unfinished request 'nobody'" in missing.json()["error"]["message"]
        bad_hash = admin.post("/export_request", params={"rid": "nobody"}, json={"skip_block_hashes": ["zz"]})
        assert bad_hash.status_code == 400 and "skip_block_hashes" in bad_hash.json()["error"]["message"]
        garbage = admin.post("/import_request", content=b"garbage")
        assert garbage.status_code == 400 and "bad magic" in garbage.json()["error"]["message"]
    with first.client() as http:  # the API key does not open admin endpoints
        assert http.post("/export_request", params={"rid": "x"}).status_code in (401, 404)
