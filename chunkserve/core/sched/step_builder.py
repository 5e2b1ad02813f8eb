"""The step being assembled: what the scheduler has handed out so far in one `schedule()`."""

from __future__ import annotations

from chunkserve.core.messages import ScheduledRequest
from chunkserve.core.request import Request
from chunkserve.core.spec_decode.policy import DecodeLoad
from chunkserve.core.step_predictor import StepShape


class StepBuilder:
    """The step being assembled: the remaining token budget and who got what."""

    def __init__(self, budget: int, now: float, encoder_budget: int = 0) -> None:
        self.budget = budget
        self.encoder_budget = encoder_budget  # encoder output rows the step may still compute
        self.num_encoder_inputs = 0
        self.num_encoder_embeds = 0
        self.encoder_cache_hits = 0  # images a request found in the encoder cache
        self.now = now
        self.num_rows = 0
        self.shape = StepShape()
        self.prefill_wait_guard = False  # the prefill-wait guard gave a prompt tokens past the TBT SLO
        self.scheduled: list[ScheduledRequest] = []
        self.preempted: set[str] = set()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.decode_load: DecodeLoad | None = None  # with a draft model: the running decodes, for its policy
        self._num_tokens: dict[str, int] = {}

    def count_prefix_query(self, num_tokens: int, num_cached: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_cached

    def charge_encoder(self, num_embeds: int) -> None:
        """An image is encoded in this step."""
        assert num_embeds <= self.encoder_budget, f"{num_embeds} encoder rows exceed the budget {self.encoder_budget}"
        self.encoder_budget -= num_embeds
        self.num_encoder_inputs += 1
        self.num_encoder_embeds += num_embeds
        self.shape = self.shape.plus_encoder(num_embeds)

    def is_taken(self, request_id: str) -> bool:
        """Already scheduled or preempted in this step."""
        return request_id in self._num_tokens or request_id in self.preempted

    def num_tokens_of(self, request_id: str) -> int:
        return self._num_tokens.get(request_id, 0)

    def add(self, request: Request, num_tokens: int, new_block_ids: list[int], resets_block_table: bool,
            drafts: list[int], num_draft_proposals: int = 0, encoder_inputs: list[int] = ()) -> None:
        assert 0 < num_tokens <= self.budget, f"{num_tokens} tokens exceed the step budget {self.budget}"
        self.budget -= num_tokens
        self.num_rows += num_tokens
        is_decode = request.is_decoding
        self.shape = self.shape.plus(request.num_computed_tokens, num_tokens, is_decode)
        self._num_tokens[request.request_id] = num_tokens
        self.scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                num_computed_tokens=request.num_computed_tokens,
                num_scheduled_tokens=num_tokens,
                new_block_ids=new_block_ids,
                resets_block_table=resets_block_table,
                sample=request.num_computed_tokens + num_tokens - len(drafts) == request.num_tokens,
                is_decode=is_decode,
                draft_token_ids=drafts,
                num_draft_proposals=num_draft_proposals,
                encoder_inputs=list(encoder_inputs),
            )
        )
