"""What the worker has been sent: the scheduler's half of the diff protocol.

The worker keeps each request's state (token history, block table, generator) between steps,
so a step carries only what changed: a request the worker does not have travels whole
(`NewRequestData`), a block table as the blocks added since the worker last saw it, the
tokens it lacks (with `tokens_from_steps`: ranks that take tokens from the steps), and the ids
of requests finished since the last step, whose state the worker then drops. A step that
fails may or may not have reached the worker, so what it carried is sent again.

With pipeline parallelism the scheduler also remembers the steps in flight: which requests
each one scheduled (a result applies only to the same request, not preempted since, since an
id may be reused) and which requests wait for the token of a step in flight.

It lives apart from the scheduler's loop so that this bookkeeping has one owner and one
`forget` (a request that finishes) instead of a line per dict in the scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping

from chunkserve.core.messages import NewRequestData, ScheduledRequest, SchedulerOutput
from chunkserve.core.request import Request


class SentToWorker:
    """The worker's view of every request, as the steps sent so far built it."""

    def __init__(self, tokens_from_steps: bool, pipelined: bool) -> None:
        self.tokens_from_steps = tokens_from_steps
        self.pipelined = pipelined
        self._blocks_sent: dict[str, int] = {}  # blocks of each request's table the worker has
        self._known_to_worker: set[str] = set()
        self._resend_as_new: set[str] = set()  # new in a step that failed: the worker may not have them
        self._finished_since_last_step: set[str] = set()
        self._tokens_sent: dict[str, int] = {}  # with tokens_from_steps: tokens of each request the workers have
        # steps in flight (pipelined): each one's requests, as (the Request, its preemption count) when it was
        # scheduled: a result applies only to the same request (an id may be reused) not preempted since
        self._in_flight: dict[int, dict[str, tuple[Request, int]]] = {}
        self._awaiting_token: set[str] = set()  # pipelined: their sampling step is in flight

    def has_state(self, request_id: str) -> bool:
        """Whether the worker holds the request's state (token history, generator) as it stands."""
        return request_id in self._known_to_worker and request_id not in self._resend_as_new

    # ----- building a step --------------------------------------------------------------

    def block_diff(self, request_id: str, table: list[int]) -> tuple[list[int], bool]:
        """The blocks of `table` the worker lacks, and whether its table starts anew with them."""
        sent = self._blocks_sent.get(request_id)
        self._blocks_sent[request_id] = len(table)
        return table[sent or 0:], sent is None

    def new_requests(self, scheduled: list[ScheduledRequest], requests: Mapping[str, Request]) -> list[NewRequestData]:
        """The scheduled requests the worker must be sent whole; with `tokens_from_steps`, the
        others get the tokens the workers lack."""
        new_requests = [_new_request_data(requests[s.request_id]) for s in scheduled
                        if s.request_id not in self._known_to_worker or s.request_id in self._resend_as_new]
        self._known_to_worker.update(r.request_id for r in new_requests)
        self._resend_as_new.difference_update(r.request_id for r in new_requests)
        if self.tokens_from_steps:
            self._attach_new_tokens(scheduled, requests, {r.request_id for r in new_requests})
        return new_requests

    def _attach_new_tokens(self, scheduled: list[ScheduledRequest], requests: Mapping[str, Request],
                           new_ids: set[str]) -> None:
        """Each scheduled request's tokens the workers have not been sent yet (its latest sampled ones)."""
        for s in scheduled:
            request = requests[s.request_id]
            sent = self._tokens_sent.get(s.request_id)
            if s.request_id not in new_ids and sent is not None and sent < request.num_tokens:
                s.token_ids_from = sent
                s.new_token_ids = request.output_token_ids[sent - request.num_prompt_tokens:]
            self._tokens_sent[s.request_id] = request.num_tokens

    def take_finished(self) -> set[str]:
        """The requests finished since the last step, which the worker forgets with this one."""
        finished, self._finished_since_last_step = self._finished_since_last_step, set()
        return finished

    # ----- steps in flight (pipelined) ----------------------------------------------------

    def await_token(self, request_id: str) -> None:
        """Pipelined: the request's sampling step is in flight; it waits for the token."""
        self._awaiting_token.add(request_id)

    def is_awaiting_token(self, request_id: str) -> bool:
        return request_id in self._awaiting_token

    @property
    def has_steps_in_flight(self) -> bool:
        """Pipelined: a step that scheduled requests is still out (its tokens are to come)."""
        return bool(self._in_flight)

    def step_sent(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """Pipelined: remember who `output` scheduled, as they are now."""
        if self.pipelined and output.scheduled:
            self._in_flight[id(output)] = {s.request_id: (requests[s.request_id],
                                                          requests[s.request_id].num_preemptions)
                                           for s in output.scheduled}

    def result_applies(self, output: SchedulerOutput, request: Request, scheduled: ScheduledRequest) -> bool:
        """Pipelined: whether `output`'s result for `request` applies (it was not preempted or
        replaced since); if so, its token is no longer awaited."""
        if not self._still_scheduled_as(output, request):
            return False
        if scheduled.sample:
            self._awaiting_token.discard(request.request_id)
        return True

    def step_done(self, output: SchedulerOutput) -> None:
        self._in_flight.pop(id(output), None)

    def prefer_idle(self, candidates: list[Request]) -> list[Request]:
        """Pipelined: the preemption candidates that lose the least: those with no step in
        flight, else those whose step in flight does not sample, else all."""
        if not self._in_flight:
            return candidates
        busy = {request_id for step in self._in_flight.values() for request_id in step}
        return ([r for r in candidates if r.request_id not in busy]
                or [r for r in candidates if r.request_id not in self._awaiting_token] or candidates)

    def _still_scheduled_as(self, output: SchedulerOutput, request: Request) -> bool:
        """Pipelined: whether `request` is as `output` scheduled it (not preempted since)."""
        scheduled_as = self._in_flight.get(id(output), {}).get(request.request_id)
        return scheduled_as is not None and scheduled_as[0] is request and scheduled_as[1] == request.num_preemptions

    # ----- a void step, a preemption, a finished request ----------------------------------

    def void(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """The step failed: what it carried is sent again (new requests as new, block tables
        whole, finished requests again), and a request whose count went ahead when it was
        scheduled (pipelined) goes back."""
        self._resend_as_new.update(new.request_id for new in output.new_requests)
        for scheduled in output.scheduled:
            self._blocks_sent.pop(scheduled.request_id, None)
            if scheduled.new_token_ids and scheduled.request_id in self._tokens_sent:
                self._tokens_sent[scheduled.request_id] = scheduled.token_ids_from
            request = requests.get(scheduled.request_id)
            if request is not None and self._still_scheduled_as(output, request):  # its count went ahead: back
                request.num_computed_tokens -= scheduled.num_scheduled_tokens
                if scheduled.sample:
                    self._awaiting_token.discard(request.request_id)
        self._in_flight.pop(id(output), None)
        self._finished_since_last_step |= output.finished_request_ids

    def preempted(self, request_id: str) -> None:
        """Its blocks are gone: its table is sent whole when it runs again; no token is awaited."""
        self._blocks_sent.pop(request_id, None)
        self._awaiting_token.discard(request_id)

    def forget(self, request_id: str) -> None:
        """The request finished: the worker, if it has it, drops it with the next step."""
        self._blocks_sent.pop(request_id, None)
        self._tokens_sent.pop(request_id, None)
        self._awaiting_token.discard(request_id)
        self._resend_as_new.discard(request_id)
        if request_id in self._known_to_worker:
            self._known_to_worker.discard(request_id)
            self._finished_since_last_step.add(request_id)

    def registry_sizes(self) -> dict[str, int]:
        """Entries per registry. `finished_since_last_step` is the next step's message, not
        a request's state: it stays non-empty until a step is scheduled."""
        return {"blocks_sent": len(self._blocks_sent), "known_to_worker": len(self._known_to_worker),
                "resend_as_new": len(self._resend_as_new), "tokens_sent": len(self._tokens_sent),
                "finished_since_last_step": len(self._finished_since_last_step),
                "steps_in_flight": len(self._in_flight), "awaiting_token": len(self._awaiting_token)}


def _new_request_data(request: Request) -> NewRequestData:
    return NewRequestData(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=request.sampling_params,
        eos_token_id=request.eos_token_id,
        output_token_ids=list(request.output_token_ids),
        generator_state=request.generator_state,
        mm_features=request.mm_features,
    )
