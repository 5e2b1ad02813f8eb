"""The scheduler's side of structured outputs: what the step loop asks of a request's grammar.

The grammars themselves (compiling them off the step loop, bitmasks, matchers) belong to
the structured-output manager (core/structured/manager.py), which an engine may not have.
This gate answers the loop's questions the same way either way (no manager: no request has
a grammar, and one that asks for structured outputs is refused), so the loop holds no `if`
per feature, and it turns what the manager says into the request's fate: a token outside
the grammar aborts the request, a grammar that took its EOS stops it.
"""

from __future__ import annotations

import time

from chunkserve.core.messages import ScheduledRequest
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.structured.manager import GrammarError, StructuredOutputManager
from chunkserve.errors import InvalidRequestError

# while nothing can run but requests whose grammars are compiling, a step waits this long for one
GRAMMAR_IDLE_WAIT_S = 0.01


class Grammars:
    """The requests' grammars, as the scheduler sees them (`manager` None: no structured outputs)."""

    def __init__(self, manager: StructuredOutputManager | None) -> None:
        self.manager = manager

    def start(self, request: Request) -> None:
        """Start compiling the request's grammar, if it has one (refused without a manager)."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        if self.manager is None:
            raise InvalidRequestError("structured outputs are not available in this engine", "structured_outputs")
        self.manager.add(request.request_id, params, request.output_token_ids)

    def has(self, request_id: str) -> bool:
        return self.manager is not None and self.manager.has(request_id)

    def is_ready(self, request_id: str) -> bool:
        """No grammar, or compiled: the request may run."""
        return self.manager is None or self.manager.is_ready(request_id)

    def num_valid_drafts(self, request_id: str, drafts: list[int]) -> int:
        """How many of the drafts, from the first, the request's grammar allows (it has one)."""
        return self.manager.num_valid_drafts(request_id, drafts)

    def fill_bitmasks(self, scheduled: list[ScheduledRequest]) -> float:
        """Each sampling row's bitmask, on its scheduled request; returns the seconds it took
        (0 when no row has a grammar: a step without grammars reads no clock)."""
        rows = [s for s in scheduled if s.sample and self.manager is not None and self.manager.has(s.request_id)]
        if not rows:
            return 0.0
        start = time.perf_counter()
        for s in rows:
            s.grammar_bitmask = self.manager.bitmask(s.request_id, s.draft_token_ids)
        return time.perf_counter() - start

    def advance(self, request: Request, accepted: list[int]) -> tuple[RequestStatus | None, str | None]:
        """The grammar takes the step's accepted tokens. FINISHED_ABORTED (with the reason, for
        the output) if a token is outside it, which the bitmask should make impossible;
        FINISHED_STOPPED if it took an EOS that did not stop the request (ignore_eos): nothing
        may follow. A grammar that is complete otherwise allows only EOS next, so the request
        ends on its EOS like any other (vLLM's way), and its text is the grammar's."""
        try:
            self.manager.accept(request.request_id, accepted)
        except GrammarError as error:
            return RequestStatus.FINISHED_ABORTED, str(error)
        if accepted[-1] == request.eos_token_id and self.manager.is_terminated(request.request_id):
            return RequestStatus.FINISHED_STOPPED, None
        return None, None

    def wait_for_compiles(self) -> None:
        """Wait until a grammar being compiled is done, at most GRAMMAR_IDLE_WAIT_S."""
        if self.manager is not None:
            self.manager.wait_for_compiles(GRAMMAR_IDLE_WAIT_S)

    def take_failures(self) -> dict[str, str]:
        """Requests whose grammar did not compile -> why."""
        return {} if self.manager is None else self.manager.take_failures()

    def forget(self, request_id: str) -> None:
        if self.manager is not None:
            self.manager.remove(request_id)

    def registry_sizes(self) -> dict[str, int]:
        return {} if self.manager is None else self.manager.registry_sizes()
