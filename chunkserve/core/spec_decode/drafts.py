"""Draft budgeting: how many draft tokens each request verifies in a step, under the step's
token budget and the KV pool, as the draft policy (policy.py) says pay.

Drafts come from the n-gram proposer (ngram.py: proposed here after each step, for the next)
or from a draft model in the worker (which proposes after the step that samples the request:
the scheduler allocates the slots its proposals are computed in with that step's). Either
way drafts are a bonus that never costs anyone anything: they take only budget that every
decode after the request still leaves, only blocks no other running request needs for its
next token (never a preemption), never more than the request's output may still hold, and
with a grammar only the drafts it allows.

It lives beside the draft policy, not in the scheduler's loop, so that the loop asks one
question per request ("which drafts fit?") and speculative decoding keeps its arithmetic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from chunkserve.config.scheduler import SchedulerConfig
from chunkserve.core.kv.kv_cache_manager import KVCacheManager
from chunkserve.core.request import Request
from chunkserve.core.sched.chunking import Chunk
from chunkserve.core.sched.grammars import Grammars
from chunkserve.core.spec_decode.ngram import NgramProposer
from chunkserve.core.spec_decode.policy import DecodeLoad, DraftPolicy
from chunkserve.core.step_predictor import StepTimePredictor

if TYPE_CHECKING:
    from chunkserve.core.sched.step_builder import StepBuilder


class DraftBudget:
    """The scheduler's speculative side: the proposer, the policy and their budgets. Without
    speculative decoding `policy` and `ngram` are None and no request has drafts."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, predictor: StepTimePredictor | None,
                 grammars: Grammars) -> None:
        self.config = config
        self.kv = kv
        self.grammars = grammars
        spec = config.speculative
        self.policy = None if spec is None else DraftPolicy(spec, predictor)
        self.ngram = None if spec is None or spec.drafts_in_worker else NgramProposer(
            spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens)

    @property
    def uses_draft_model(self) -> bool:
        return self.policy is not None and self.ngram is None

    def decode_load(self, running: list[Request]) -> DecodeLoad:
        """The running requests' next decodes (those whose prompts are done), one row each."""
        return DecodeLoad.of([r.num_computed_tokens for r in running if r.num_computed_tokens >= r.num_prompt_tokens])

    def propose_ngrams(self, requests: list[Request], running: list[Request]) -> None:
        """Each request's n-gram drafts for its next step, as many as the draft policy says pay
        (a proposal it does not get stays as its shadow, to keep its acceptance rate current)."""
        load = self.decode_load(running)
        for request in requests:
            proposal = self.ngram.propose(request.all_token_ids, self.config.max_model_len)
            k = self.policy.num_drafts(request.request_id, len(proposal), load, request.num_computed_tokens)
            request.spec_token_ids = proposal[:k]
            self.policy.set_shadow(request.request_id, proposal[0] if proposal and not k else None)

    def observe(self, request_id: str, num_drafted: int, accepted: list[int]) -> None:
        """A step verified the request's `num_drafted` drafts: `accepted` came of them."""
        self.policy.observe(request_id, num_drafted, len(accepted) - 1)
        self.policy.observe_next_token(request_id, accepted[0])

    # ----- the step's budget -------------------------------------------------------------

    def that_fit(self, request: Request, budget: int) -> list[int]:
        """The request's drafts, trimmed to the budget left beside its own token and to the
        output it may still produce (its proposer kept them under max_model_len)."""
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1)
        drafts = request.spec_token_ids[: max(room, 0)]
        if drafts and self.grammars.has(request.request_id):
            drafts = drafts[: self.grammars.num_valid_drafts(request.request_id, drafts)]
        return drafts

    def trim_to_blocks(self, request: Request, chunk: Chunk, step: StepBuilder, drafts: list[int],
                       running: list[Request]) -> tuple[Chunk, list[int]]:
        """The decode's chunk and drafts, its drafts trimmed to the blocks no other running
        request needs for its next token: drafts never cost anyone a preemption."""
        held = len(self.kv.block_table(request.request_id))
        needed = self.kv.num_blocks_for(request.num_computed_tokens + chunk.num_tokens) - held
        if self.kv.num_free_blocks - len(running) < needed:  # (else plenty: others need a block at most)
            room = (held + self._spare_blocks(request, step, running)) * self.config.block_size - request.num_computed_tokens
            drafts = drafts[: max(room - 1, 0)]
            chunk = Chunk(1 + len(drafts))
        return chunk, drafts

    def allocate_lookahead(self, request: Request, chunk: Chunk, step: StepBuilder, drafts: list[int],
                           running: list[Request]) -> int:
        """With a draft model: the drafts it proposes for the request after this step, with the
        slots their rows write allocated, if they take no block another running request needs
        for its next token (else none: no drafts rather than a preemption)."""
        proposals = self._draft_model_proposals(request, chunk, step, drafts)
        if not proposals:
            return 0
        total = request.num_computed_tokens + chunk.num_tokens + proposals
        needed = self.kv.num_blocks_for(total) - len(self.kv.block_table(request.request_id))
        if self.kv.num_free_blocks - len(running) < needed and needed > self._spare_blocks(request, step, running):
            return 0
        return proposals if self.kv.allocate_slots(request.request_id, total) is not None else 0

    def _spare_blocks(self, request: Request, step: StepBuilder, running: list[Request]) -> int:
        """Free blocks that no running request but `request`, not yet in the step, needs for its next token."""
        return self.kv.num_free_blocks - sum(max(self.kv.num_blocks_for(r.num_computed_tokens + 1) - len(self.kv.block_table(r.request_id)),
                              0) for r in running if r is not request and not step.is_taken(r.request_id))

    def _draft_model_proposals(self, request: Request, chunk: Chunk, step: StepBuilder, drafts: list[int]) -> int:
        """With a draft model: how many drafts it should propose for the request after this step,
        if the step samples it (the slots they are computed in are allocated with the step's)."""
        if not self.uses_draft_model:
            return 0
        if request.num_computed_tokens + chunk.num_tokens - len(drafts) != request.num_tokens:
            return 0  # a prompt chunk that does not finish the prompt samples nothing
        context = request.num_tokens + len(drafts)  # (at most: the bonus token's position)
        room = min(self.config.speculative.num_speculative_tokens, self.config.max_model_len - 1 - context,
                   request.max_tokens - request.num_output_tokens - 2 - len(drafts))
        load = step.decode_load if request.is_decoding else DecodeLoad(
            step.decode_load.shape.plus(request.num_tokens, 1, is_decode=True), step.decode_load.num_decodes + 1)
        return self.policy.num_drafts(request.request_id, room, load, context)

    # ----- per request ---------------------------------------------------------------------

    def forget(self, request_id: str) -> None:
        if self.policy is not None:
            self.policy.forget(request_id)

    def registry_sizes(self) -> dict[str, int]:
        return {} if self.policy is None else self.policy.registry_sizes()
