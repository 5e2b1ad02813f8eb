"""The scheduler's side of grammars that are not ready: a grammar that failed to compile ends its
request with the next step's outputs (or a void step's), and a step with nothing to run but
requests whose grammars compile waits for one instead of returning at once (no spin)."""

from __future__ import annotations

import dataclasses

from chunkserve.core.messages import ModelRunnerOutput
from chunkserve.core.request import Request
from chunkserve.sampling_params import StructuredOutputsParams
from tests.core.support import FakeRunner, make_request, make_scheduler


class StubGrammars:
    """What the scheduler asks of the structured-output manager: request ids in `failing` fail
    to compile, those in `compiling` never finish, the rest have no grammar of note."""

    def __init__(self, failing: set[str] = frozenset(), compiling: set[str] = frozenset()) -> None:
        self.failing, self.compiling = set(failing), set(compiling)
        self.added: set[str] = set()
        self.waits = 0

    def add(self, request_id: str, params, replay=()) -> None:
        self.added.add(request_id)

    def has(self, request_id: str) -> bool:
        return False

    def is_ready(self, request_id: str) -> bool:
        return request_id not in self.compiling

    def take_failures(self) -> dict[str, str]:
        failed = {i: "the grammar did not compile" for i in self.failing & self.added}
        self.added -= failed.keys()
        return failed

    def wait_for_compiles(self, timeout_s: float) -> None:
        self.waits += 1

    def remove(self, request_id: str) -> None:
        self.added.discard(request_id)

    def registry_sizes(self) -> dict[str, int]:
        return {}


def constrained(request_id: str) -> Request:
    request = make_request(request_id, 6, max_tokens=2)
    request.sampling_params = dataclasses.replace(request.sampling_params,
                                                  structured_outputs=StructuredOutputsParams(regex="[0-9]"))
    return request


def test_a_grammar_that_fails_to_compile_ends_its_request_with_the_steps_outputs():
    scheduler = make_scheduler(structured=StubGrammars(failing={"bad", "bad-too"}))
    runner = FakeRunner()
    scheduler.add_request(constrained("bad"))
    scheduler.add_request(make_request("ok", 6, max_tokens=2))
    output = scheduler.schedule()
    assert [s.request_id for s in output.scheduled] == ["ok"]  # the failed one ended before the step
    outputs = scheduler.update_from_output(output, runner.execute(output))
    assert [(o.request_id, o.finish_reason, o.error) for o in outputs][0] == ("bad", "abort",
                                                                             "the grammar did not compile")
    assert "bad" not in scheduler.requests

    scheduler.add_request(constrained("bad-too"))
    output = scheduler.schedule()
    scheduler.void_step(output)  # the step failed: its culprit's output follows the ended request's
    outputs = scheduler.fail_requests({"ok": "the step failed"})
    assert [(o.request_id, o.error) for o in outputs] == [("bad-too", "the grammar did not compile"),
                                                          ("ok", "the step failed")]
    assert scheduler.fail_requests({}) == [] and not scheduler.has_unfinished_requests()


def test_a_step_with_only_compiling_grammars_to_run_waits_for_one_unless_a_request_ended():
    grammars = StubGrammars(failing={"bad"}, compiling={"slow"})
    scheduler = make_scheduler(structured=grammars)
    scheduler.add_request(constrained("slow"))
    scheduler.add_request(constrained("bad"))
    output = scheduler.schedule()
    assert output.is_empty and grammars.waits == 0  # an output to report: no wait
    assert [o.request_id for o in scheduler.update_from_output(output, ModelRunnerOutput({}))] == ["bad"]
    assert scheduler.schedule().is_empty and grammars.waits == 1
