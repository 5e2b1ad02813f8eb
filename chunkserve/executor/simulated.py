"""An executor with no model: every sampled row gets a made-up token at once.

It runs the engine core's real scheduling, KV accounting and messaging at no model cost: for
measuring what the core itself costs (benchmarks/engine/step_message_bytes.py), for tests of the
core without weights, and, given a `StepTimer` and the core's `VirtualClock`, for `chunkserve
sim`, where each step advances the virtual clock by the time the timer says it would take on
the profiled hardware. Its tokens are a fixed function of the request's position, or, to
verify speculative drafts, a `SyntheticText` of the request's own, so a run is reproducible;
they never include the model's EOS unless the vocabulary is that small."""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

from chunkserve.core.clock import VirtualClock
from chunkserve.core.messages import ModelRunnerOutput, SchedulerOutput
from chunkserve.core.step_predictor import StepShape
from chunkserve.executor.base import Executor
from chunkserve.model.config import ModelConfig


class StepTimer(Protocol):
    """How long simulated steps take (chunkserve/sim/timing.py has the profile's and a replay's)."""

    def step_seconds(self, scheduler_output: SchedulerOutput) -> float:
        """The next step's seconds, called once per step that runs requests, in step order."""

    def profile_seconds(self, shape: StepShape) -> float:
        """A synthetic start-up profile step's seconds (the SLO budgets' first fit)."""


class SimulatedConnector(Protocol):
    """A KV connector's worker side without tensors (chunkserve/sim/disagg.py's, over a simulated
    link): told the step's connector metadata before the step and what it sampled after; each
    answers the seconds it took the engine thread (its copies of blocks), which the step lasts longer."""

    def before_step(self, metadata: Any, now: float) -> float: ...

    def after_step(self, sampled: dict[str, list[int]], now: float) -> float: ...

    def take_output(self) -> tuple[Any, set[str], set[str]]:
        """(the connector output for its scheduler side, finished sending, finished receiving)."""

    def next_arrival(self) -> float | None:
        """When the next message for it arrives (None: none is on its way): an idle engine wakes then."""


def lowest_ordinary_token(vocab_size: int) -> int:
    """The first token id the simulated outputs use: tokenizers keep their special tokens low."""
    return min(1000, vocab_size // 2)


COPY_PERIOD = 48  # SyntheticText repeats the token this far back (longer than any n-gram the proposer matches)


class SyntheticText:
    """Output tokens whose n-gram drafts hold at a chosen rate, for simulating speculative
    decoding. Token p repeats token p - COPY_PERIOD (the output quotes its prompt, then itself,
    as copying and editing work does) with probability `repeat`, else it is a fresh token; a
    hash of (seed, request, position) decides, so a run is reproducible. The engine's own
    n-gram proposer finds the repeats, and each token it drafts from them holds with
    probability `repeat`: the draft acceptance rate of the text (a profile's, measured on a real run)."""

    def __init__(self, repeat: float, vocab_size: int, seed: int = 0) -> None:
        if not 0.0 <= repeat <= 1.0:
            raise ValueError(f"a repeat probability is in [0, 1], got {repeat}")
        self.repeat = repeat
        self.low = lowest_ordinary_token(vocab_size)
        self.vocab_size = vocab_size
        self.seed = seed

    def continuation(self, request_id: str, history: list[int], count: int) -> list[int]:
        """The `count` tokens that follow `history` (a request's prompt and output so far)."""
        tokens = []
        for offset in range(count):
            position = len(history) + offset
            digest = hashlib.blake2b(f"{self.seed}:{request_id}:{position}".encode(), digest_size=16).digest()
            draw, fresh = int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")
            source = position - COPY_PERIOD
            if source >= 0 and draw / 2**64 < self.repeat:
                tokens.append(history[source] if source < len(history) else tokens[source - len(history)])
            else:
                tokens.append(self.low + fresh % (self.vocab_size - self.low))
        return tokens


class SimulatedExecutor(Executor):
    def __init__(self, model_config: ModelConfig, num_blocks: int, timer: StepTimer | None = None,
                 clock: VirtualClock | None = None, connector: SimulatedConnector | None = None,
                 text: SyntheticText | None = None) -> None:
        """With `timer`, each step that runs requests moves `clock` (the engine core's) on by
        the timer's seconds; without, steps take no simulated time. `connector`: the worker
        side of the engine's KV connector (simulated prefill/decode instances). `text`: the
        requests' outputs come from it and their drafts are verified against it (speculative
        decoding); without, a token is a fixed function of its position and every draft fails."""
        if (timer is None) != (clock is None):
            raise ValueError("a step timer needs the virtual clock it moves, and a clock a timer")
        if connector is not None and clock is None:
            raise ValueError("a simulated connector runs on the virtual clock")
        self.model_config = model_config
        self.num_blocks = num_blocks
        self.timer = timer
        self.clock = clock
        self.connector = connector
        self.text = text
        self._num_tokens: dict[str, int] = {}  # each request's history length, as a worker keeps it
        self._histories: dict[str, list[int]] = {}  # with `text`: each request's tokens, as a worker keeps them

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        if method == "determine_num_kv_blocks":
            return [self.num_blocks]
        if method in ("load_model", "initialize_kv_cache"):
            return [None]
        raise NotImplementedError(f"the simulated executor has no {method!r} (it runs no model)")

    def profile(self, rows: list[tuple[int, int]], seed: int = 0) -> float:
        if self.timer is None:
            raise NotImplementedError("the simulated executor times steps only with a step timer (chunkserve sim)")
        return self.timer.profile_seconds(StepShape.of_rows(rows))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self._num_tokens.pop(request_id, None)
            self._histories.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self._num_tokens[new.request_id] = len(new.prompt_token_ids)
            if self.text is not None:  # (a resumed request keeps the outputs it had)
                self._histories.setdefault(new.request_id, list(new.prompt_token_ids))
        if self.connector is not None:
            self.clock.advance(self.connector.before_step(scheduler_output.kv_connector_metadata, self.clock.now))
        sampled = {}
        for s in scheduler_output.scheduled:
            if not s.sample:
                continue
            if self.text is not None:
                sampled[s.request_id] = self._verify(s.request_id, s.draft_token_ids)
                continue
            length = self._num_tokens[s.request_id]
            sampled[s.request_id] = [self.token_at(length)]
            self._num_tokens[s.request_id] = length + 1
        if self.timer is not None and not scheduler_output.is_empty:
            self.clock.advance(self.timer.step_seconds(scheduler_output))
        if self.connector is None:
            return ModelRunnerOutput(sampled)
        self.clock.advance(self.connector.after_step(sampled, self.clock.now))
        connector_output, sent, received = self.connector.take_output()
        return ModelRunnerOutput(sampled, finished_sending=sent, finished_recving=received,
                                 kv_connector_output=connector_output)

    def _verify(self, request_id: str, drafts: list[int]) -> list[int]:
        """The tokens a step accepts for a request: the drafts that match its text's next tokens
        (a prefix of them), then the text's token after them, as a target model's verification."""
        history = self._histories[request_id]
        truth = self.text.continuation(request_id, history, len(drafts) + 1)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == truth[accepted]:
            accepted += 1
        tokens = truth[:accepted + 1]
        history.extend(tokens)
        return tokens

    def token_at(self, position: int) -> int:
        """The token a request samples at `position`: in [1, vocab), skipping the low ids
        where tokenizers keep their special tokens."""
        vocab = self.model_config.vocab_size
        low = lowest_ordinary_token(vocab)
        return low + (position * 7919) % (vocab - low)
