"""Whether a request's drafts pay, and the running counts /metrics shows.

Verifying k drafts adds k rows to the step; every request in the step waits for them. A
request whose drafts are accepted at rate a gains E(k) = a + a^2 + ... + a^k tokens per step
(the run stops at the first rejection), each saving it one step. What a saved step is worth
to the batch depends on what happens to the slot it frees, which the engine cannot see:

- refilled at once (a queue of requests, a client that sends its next one): the batch keeps B
  decodes and makes its tokens sooner, worth T / B, the step's time per token;
- not refilled (the last requests draining, equal-length requests finishing together): the
  batch finishes no sooner, only its last steps lose the request's row, worth r, the cost of
  one decode row.

The policy values a saved step at the mean, (T / B + r) / 2, and drafting for one request
pays when

    E(k) * (T / B + r) / 2  >  dT(k)

where T, r and dT (the draft rows' extra time) come from the step-time model (rows, draft rows
and attention work; it learns from the engine's own steps, drafts included). Valued at T / B
alone, a saved step is overrated whenever the batch drains, and `auto` drafted where the
drafts cost more than they bought (see docs/benchmarks-log.md, "Speculative decoding
(2026-11-26, commit 2667759)"). `auto` gives each request the k that gains most, or none;
under load (large B) drafting turns itself off, and it comes back when the load falls.

Acceptance is counted the way drafts fail: position i of a run is tried only if every draft
before it was accepted, so a rate is accepted / tried. A request's rate starts from the global
one and follows its recent drafts (older counts decay), since a request that quotes a passage
and then writes freely changes its rate. A request not drafting still needs a rate: an n-gram
proposal costs nothing to make, so it is made anyway and its first token checked against what
the model then produced (a shadow draft); a draft model's proposals cost a forward, so a
request it stopped drafting for is probed with real drafts every `PROBE_EVERY` steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkserve.config.speculative import SpeculativeConfig
from chunkserve.core.stats import SpecDecodeStats
from chunkserve.core.step_predictor import StepShape, StepTimePredictor

DECAY = 0.8  # weight of a request's older acceptance counts at each new observation
PRIOR_TRIES = 2.0  # the global rate counts as this many tries of a request's own
PROBE_EVERY = 32  # steps a draft-model request goes without drafts before it is probed


@dataclass(frozen=True)
class DecodeLoad:
    """The decodes of the next step, one row each (computed once per step, read per request)."""

    shape: StepShape
    num_decodes: int

    @classmethod
    def of(cls, contexts: list[int]) -> DecodeLoad:
        shape = StepShape()
        for context in contexts:
            shape = shape.plus(context, 1, is_decode=True)
        return cls(shape, len(contexts))


@dataclass
class _Acceptance:
    accepted: float = 0.0
    tried: float = 0.0
    steps_without_drafts: int = 0
    shadow: int | None = None  # the first token of an n-gram proposal it did not get


class DraftPolicy:
    def __init__(self, config: SpeculativeConfig, predictor: StepTimePredictor | None) -> None:
        self.config = config
        self.predictor = predictor
        self._requests: dict[str, _Acceptance] = {}
        self._accepted = 0.0  # global counts (no decay): the prior of a request without its own
        self._tried = 0.0
        self._num_drafts = 0
        self._num_draft_tokens = 0
        self._num_accepted = 0
        self._per_pos = [0] * config.num_speculative_tokens

    # ----- decisions ------------------------------------------------------------------------

    def num_drafts(self, request_id: str, available: int, load: DecodeLoad, context: int) -> int:
        """How many of `available` drafts the request, at context length `context`, should
        verify in the next step, whose decodes are `load` (the request among them)."""
        if available <= 0:
            return 0
        if self.config.policy == "always":
            return available
        state = self._requests.setdefault(request_id, _Acceptance())
        best = self._best_k(self.rate(request_id), available, load, context)
        if best == 0 and self.config.drafts_in_worker and state.steps_without_drafts >= PROBE_EVERY:
            best = available
        state.steps_without_drafts = 0 if best else state.steps_without_drafts + 1
        return best

    def _best_k(self, rate: float, available: int, load: DecodeLoad, context: int) -> int:
        step_time = self.predictor.predict(load.shape) if self.predictor is not None else None
        if not step_time:  # no step-time model yet: the first steps (and their drafts) teach it
            return available
        base = load.shape  # (the request's row among them)
        without = self.predictor.predict(base.plus(context, 1, is_decode=True))  # (base and one more row)
        row_time = without - step_time
        saved_per_token = (step_time / max(load.num_decodes, 1) + row_time) / 2
        best, best_gain, expected = 0, 0.0, 0.0
        for k in range(1, available + 1):
            expected += rate**k
            extra = self.predictor.predict(_with_drafts(base, context, k)) - without
            gain = expected * saved_per_token - extra
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def rate(self, request_id: str) -> float:
        """The request's running acceptance rate per tried draft position."""
        prior = (self._accepted + 1.0) / (self._tried + 2.0)
        state = self._requests.get(request_id)
        if state is None:
            return prior
        return (state.accepted + PRIOR_TRIES * prior) / (state.tried + PRIOR_TRIES)

    # ----- observations -----------------------------------------------------------------------

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """A verified run: `num_accepted` of its `num_drafted` drafts (a prefix of them) held."""
        if num_drafted <= 0:
            return
        tried = num_accepted + (num_accepted < num_drafted)
        self._count(request_id, num_accepted, tried)
        self._num_drafts += 1
        self._num_draft_tokens += num_drafted
        self._num_accepted += num_accepted
        for position in range(num_accepted):
            self._per_pos[position] += 1

    def set_shadow(self, request_id: str, first_draft: int | None) -> None:
        """An n-gram proposal the request did not get: its first token is checked against the next token."""
        if self.config.policy == "auto":
            self._requests.setdefault(request_id, _Acceptance()).shadow = first_draft

    def observe_next_token(self, request_id: str, token_id: int) -> None:
        state = self._requests.get(request_id)
        if state is not None and state.shadow is not None:
            self._count(request_id, float(token_id == state.shadow), 1.0)
            state.shadow = None

    def _count(self, request_id: str, accepted: float, tried: float) -> None:
        self._accepted += accepted
        self._tried += tried
        if self.config.policy == "auto":
            state = self._requests.setdefault(request_id, _Acceptance())
            state.accepted = state.accepted * DECAY + accepted
            state.tried = state.tried * DECAY + tried

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def registry_sizes(self) -> dict[str, int]:
        return {"acceptance": len(self._requests)}

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self._num_drafts, self._num_draft_tokens, self._num_accepted, tuple(self._per_pos))


def _with_drafts(shape: StepShape, context: int, num_drafts: int) -> StepShape:
    return shape.plus(context, 1 + num_drafts, is_decode=True)
