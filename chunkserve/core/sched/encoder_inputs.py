"""Which images' encoder runs in a step, and how a prompt chunk ends around them (vLLM V1's
`_try_schedule_encoder_inputs`).

A prompt chunk [start, start + n) needs the encoder output of every image whose placeholder range
it overlaps. For each such image, in prompt order:

- rows already in the KV cache (the range ends at or before `start`) need nothing;
- with `--disable-chunked-mm-input`, a chunk that would end inside the range ends before it
  instead (an image is computed whole or not at all). A chunk that starts at the range takes it
  whole when the step has room for it, past the chunk policy's cut (its alignment and caps would
  otherwise never let it start), and waits otherwise (vllm#52306: a chunk starting exactly at the
  range was split);
- an output the encoder cache holds is referenced, not encoded again;
- an image the step's encoder budget (`--max-num-batched-encoder-embeds`) or the encoder cache
  cannot take ends the chunk at the text before it: the encoder sees whole images only, so the
  image waits for a later step;
- otherwise it is encoded in this step (`ScheduledRequest.encoder_inputs`) and charged.

Planning takes nothing (`plan`); the scheduler commits a plan (`commit`) once the chunk's KV
blocks are allocated. A request references an output until every range of that image in its
prompt is in the KV cache (`free_computed`), and drops all its references when it finishes or
is preempted (a recompute encodes again what was evicted meanwhile).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chunkserve.config.scheduler import SchedulerConfig
from chunkserve.core.messages import SchedulerOutput
from chunkserve.core.request import Request
from chunkserve.core.sched.encoder_cache import EncoderCacheManager
from chunkserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from chunkserve.core.sched.step_builder import StepBuilder


@dataclass
class EncoderPlan:
    """A prompt chunk's length after the encoder's limits, and the images it needs, by index into
    the request's mm_features: to encode in this step, and found in the encoder cache."""

    num_tokens: int
    to_encode: list[int] = field(default_factory=list)
    cache_hits: list[int] = field(default_factory=list)


class EncoderInputs:
    """Plans and commits the encoder's work per prompt chunk, over the shared encoder cache."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.multimodal = config.max_tokens_per_mm_item is not None
        self.disable_chunked_mm_input = config.disable_chunked_mm_input
        self.budget_per_step = config.encoder_compute_budget
        self.cache = EncoderCacheManager(config.encoder_cache_capacity)
        self.num_encoder_inputs_total = 0
        self.num_encoder_embeds_total = 0
        self.num_cache_hits_total = 0  # images a request found encoded (by another request, or kept after one)

    def check_request(self, request: Request) -> None:
        """Refuse a request that could never run: images for a text model, or an image whose
        output exceeds what one step may encode or the encoder cache holds."""
        features = request.mm_features
        if not features:
            return
        if not self.multimodal:
            raise InvalidRequestError("this model takes no images: send text only", param="messages")
        limit = min(self.budget_per_step, self.cache.capacity)
        for index, feature in enumerate(features):
            if feature.num_embeds > limit:
                raise InvalidRequestError(
                    f"image {index} needs {feature.num_embeds} encoder output rows, more than this server's "
                    f"encoder cache or encoder budget per step holds ({limit}); send a smaller image or raise "
                    "--encoder-cache-size and --max-num-batched-encoder-embeds", param="messages")
            if feature.end > request.num_prompt_tokens or (index and feature.offset < features[index - 1].end):
                raise InvalidRequestError(f"image {index}'s placeholder range [{feature.offset}, {feature.end}) "
                                          "is outside the prompt or does not follow the one before it", param="messages")

    def plan(self, request: Request, start: int, num_tokens: int, room: int, step: StepBuilder) -> EncoderPlan:
        """The chunk [start, start + num_tokens) of the request's prompt after the encoder's limits
        (module docstring); `room` is the most tokens the step could give it (an image that
        starts the chunk may take that many under --disable-chunked-mm-input)."""
        if not request.mm_features or num_tokens == 0:
            return EncoderPlan(num_tokens)
        end = start + num_tokens
        plan = EncoderPlan(0)
        seen: set[str] = set()
        planned_rows = pinned_rows = 0
        for index, feature in enumerate(request.mm_features):
            if feature.offset >= end:
                break
            if feature.end <= start:
                continue  # its rows are in the KV cache
            if self.disable_chunked_mm_input and end < feature.end and start <= feature.offset:
                if start < feature.offset or feature.length > room:
                    end = feature.offset
                    break
                end = feature.end  # a whole image, past the chunk policy's cut
            if feature.identifier in seen:
                continue  # the same image earlier in this chunk
            seen.add(feature.identifier)
            if self.cache.is_cached(feature.identifier):
                plan.cache_hits.append(index)
                pinned_rows += self.cache.freeable_rows(feature.identifier)
                continue
            if not self.cache.can_allocate(feature.num_embeds, step.encoder_budget - planned_rows, planned_rows,
                                           pinned_rows):
                end = max(feature.offset, start)  # the text before it; the image waits
                break
            plan.to_encode.append(index)
            planned_rows += feature.num_embeds
        plan.num_tokens = end - start
        return plan

    def commit(self, request: Request, plan: EncoderPlan, step: StepBuilder) -> None:
        """The chunk is scheduled: take references to the outputs it found, hold room for those it encodes."""
        request_id = request.request_id
        for index in plan.cache_hits:
            feature = request.mm_features[index]
            if not self.cache.holds(feature.identifier, request_id):
                step.encoder_cache_hits += 1
                self.num_cache_hits_total += 1
            self.cache.check_and_update_cache(request_id, feature)
        for index in plan.to_encode:
            feature = request.mm_features[index]
            self.cache.allocate(request_id, feature)
            step.charge_encoder(feature.num_embeds)
            self.num_encoder_inputs_total += 1
            self.num_encoder_embeds_total += feature.num_embeds

    def embeds_to_encode(self, request: Request, start: int, num_tokens: int) -> int:
        """Encoder output rows a chunk [start, start + num_tokens) would compute (what the step-time
        model charges it): its images not in the KV cache nor the encoder cache, each once."""
        identifiers = {f.identifier: f.num_embeds for f in request.mm_features
                       if f.overlaps(start, start + num_tokens) and not self.cache.is_cached(f.identifier)}
        return sum(identifiers.values())

    def free_computed(self, request: Request) -> None:
        """Drop the request's references to images whose every range in its prompt is in the KV cache."""
        computed = request.num_computed_tokens
        needed = {f.identifier for f in request.mm_features if f.end > computed}
        for feature in request.mm_features:
            if feature.identifier not in needed:
                self.cache.free_encoder_input(request.request_id, feature.identifier)

    def forget(self, request: Request) -> None:
        """The request finished or was preempted: it needs no output any more."""
        self.cache.free(request.request_id, request.mm_features)

    def void(self, output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """The step failed before or after the worker saw it: the outputs it encoded may not exist, so
        they are encoded again when needed, and the outputs it freed are freed again with the next step."""
        self.cache.evicted_again(output.free_encoder_ids)
        for scheduled in output.scheduled:
            request = requests.get(scheduled.request_id)
            for index in scheduled.encoder_inputs if request is not None else ():
                self.cache.discard(request.mm_features[index].identifier)

    def registry_sizes(self) -> dict[str, int]:
        return self.cache.registry_sizes()

    def stats(self) -> dict[str, int]:
        """The encoder's counters, as SchedulerStats' fields."""
        return {"encoder_inputs_total": self.num_encoder_inputs_total,
                "encoder_embeds_total": self.num_encoder_embeds_total,
                "encoder_cache_hits_total": self.num_cache_hits_total}
