"""The synchronous engine: the frontend's input and output processors around an engine core
in this process (what the offline `LLM` drives). `step()` = core step -> outputs."""

from __future__ import annotations

import time
from typing import Any

from chunkserve.config.engine import EngineArgs
from chunkserve.config.model import resolve_model
from chunkserve.core.kv.snapshot import RequestSnapshot
from chunkserve.core.messages import EngineCoreOutput
from chunkserve.core.stats import SchedulerStats
from chunkserve.engine.core import EngineCore
from chunkserve.engine.frontend import Frontend
from chunkserve.engine.input_processor import Prompt
from chunkserve.engine.messages import imported_core_request
from chunkserve.engine.outputs import RequestOutput, StepRecord
from chunkserve.engine.tokenizer import load_tokenizer
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        source = resolve_model(args.model)
        self.engine_core = EngineCore(args)
        self.info = self.engine_core.info(source.name)
        self.tokenizer: Any = load_tokenizer(source, args.tokenizer, args.chat_template)
        self.engine_core.structured.use_tokenizer(self.tokenizer)
        self.input_processor, self.output_processor, self.generation_defaults = Frontend.from_args(
            args, self.tokenizer, source, self.info)
        self.last_step_record: StepRecord | None = None  # of the last step(); None if it ran nothing
        self._shut_down = False

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def step_records(self):
        return self.engine_core.step_records

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Validate and queue a request. Raises InvalidRequestError; the engine is unchanged then."""
        if self.output_processor.has_request(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        request, text = self.input_processor.process(request_id, prompt, params, priority, arrival_time)
        self.output_processor.add_request(request, text)
        try:
            self.engine_core.add_request(request)
        except BaseException:
            self.output_processor.remove_request(request_id)
            raise

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests at any point; their blocks return to the pool at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return self._process(self.engine_core.abort_requests(ids), time.time())

    def export_request(self, request_id: str, mode: str = "copy",
                       skip_block_hashes: frozenset[bytes] = frozenset()) -> RequestSnapshot:
        """The request's snapshot as of the last step, with this frontend's state (see
        EngineCore.export_request); `pause` ends it here without another output."""
        if not self.output_processor.has_request(request_id):
            raise InvalidRequestError(f"no unfinished request {request_id!r} to export")
        snapshot = self.engine_core.export_request(request_id, mode, frozenset(skip_block_hashes))
        snapshot.frontend_state = self.output_processor.export_state(request_id)
        if mode == "pause":
            self.output_processor.pause_for_export(request_id, time.time())
        return snapshot

    def import_request(self, snapshot: RequestSnapshot, request_id: str | None = None) -> None:
        """Continue an exported request here (under `request_id`, or the id it was exported
        with); its outputs continue where the exporter's stopped. Raises InvalidRequestError
        (nothing taken) if the snapshot does not fit this engine."""
        request = imported_core_request(snapshot, request_id)
        if self.output_processor.has_request(request.request_id):
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.output_processor.add_imported(request, snapshot.output_token_ids, snapshot.frontend_state,
                                           request.request_id)
        try:
            self.engine_core.import_request(snapshot, request.request_id)
        except BaseException:
            self.output_processor.remove_request(request.request_id)
            raise

    def shutdown(self) -> None:
        """Stop the engine core (a disk KV tier is settled first: see EngineCore.shutdown); the
        engine is unusable afterwards. Safe to call more than once."""
        if not self._shut_down:
            self._shut_down = True
            self.engine_core.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after changing weights); refused (False) while
        any request is unfinished."""
        return self.engine_core.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        step = self.engine_core.step()
        self.last_step_record = None if step is None else step.record
        return [] if step is None else self._process(step.outputs, step.timestamp)

    def _process(self, outputs: list[EngineCoreOutput], timestamp: float) -> list[RequestOutput]:
        processed = self.output_processor.process_outputs(outputs, timestamp)
        if processed.requests_to_abort:  # stop strings (and failures): the core forgets them before the next step
            self.engine_core.abort_requests(processed.requests_to_abort)
        if processed.failed:
            raise RuntimeError("; ".join(f"request {i!r}: {why}" for i, why in processed.failed.items()))
        return processed.request_outputs
