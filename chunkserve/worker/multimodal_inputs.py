"""The runner's images: the encoder cache, each request's features, and what a step's forward
takes from them (vLLM's `_execute_mm_encoder` and `_gather_mm_embeddings`).

The scheduler decides when an image's encoder runs (`ScheduledRequest.encoder_inputs`, in the
step of the first chunk that reaches its range) and when its output may go
(`SchedulerOutput.free_encoder_ids`); the cache holds the outputs by content hash in between,
so a chunk cut anywhere through an image, or another request with the same image, takes its
rows from there. A step that touches no image range builds nothing here."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from chunkserve.core.messages import NewRequestData, ScheduledRequest, SchedulerOutput
from chunkserve.core.multimodal import MultiModalFeature
from chunkserve.errors import RequestFailedError
from chunkserve.model.vlm.encoder import VisionEncoder
from chunkserve.worker.input_batch import ForwardBatch


@dataclass
class _RequestImages:
    features: list[MultiModalFeature]
    num_prompt_tokens: int
    # M-RoPE: the prompt's positions [3, P] and the delta of every position after it
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0


class MultiModalInputs:
    def __init__(self, encoder: VisionEncoder) -> None:
        self.encoder = encoder
        self.cache: dict[str, torch.Tensor] = {}  # identifier -> encoder output [num_embeds, hidden]
        self.requests: dict[str, _RequestImages] = {}  # only requests with images

    def add_request(self, new: NewRequestData) -> str | None:
        """Keep the request's features (sent once, with its first step); M-RoPE positions are
        computed here, once per request. Returns what is wrong with its images, if anything."""
        self.requests.pop(new.request_id, None)
        if not new.mm_features:
            return None
        images = _RequestImages(list(new.mm_features), len(new.prompt_token_ids))
        if self.encoder.uses_mrope:
            try:
                images.mrope_positions, images.mrope_delta = self.encoder.mrope_positions(new.prompt_token_ids,
                                                                                          images.features)
            except (KeyError, ValueError, RuntimeError, StopIteration) as error:
                return f"the M-RoPE positions of the request's images cannot be computed: {error!r}"
        self.requests[new.request_id] = images
        return None

    def remove_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def run_encoders(self, output: SchedulerOutput) -> tuple[int, float]:
        """Drop the outputs the scheduler freed, then encode the step's encoder inputs (those not
        cached already). Returns the encoder calls and their seconds. An image the encoder cannot
        take fails its request."""
        for identifier in output.free_encoder_ids:
            self.cache.pop(identifier, None)
        num_calls, start = 0, time.perf_counter()
        for scheduled in output.scheduled:
            images = self.requests.get(scheduled.request_id)
            for index in scheduled.encoder_inputs:
                if images is None or not 0 <= index < len(images.features):
                    raise RequestFailedError(f"request {scheduled.request_id!r} has no image {index} to encode",
                                             [scheduled.request_id])
                feature = images.features[index]
                if feature.identifier not in self.cache:
                    self.cache[feature.identifier] = self._encode(scheduled.request_id, feature)
                    num_calls += 1
        return num_calls, time.perf_counter() - start if num_calls else 0.0

    def _encode(self, request_id: str, feature: MultiModalFeature) -> torch.Tensor:
        try:
            return self.encoder.encode(feature)
        except (RuntimeError, ValueError, TypeError, KeyError) as error:
            raise RequestFailedError(f"the vision encoder failed on an image of request {request_id!r}: {error}",
                                     [request_id]) from error

    def input_embeds(self, batch: ForwardBatch, scheduled: list[ScheduledRequest],
                     embed_tokens: torch.nn.Module) -> torch.Tensor | None:
        """The step's input embeddings [T, hidden] float32, the rows inside image ranges replaced
        by their encoder output rows; None when no row is in one (the model embeds the ids)."""
        touched = [(s, feature) for s in scheduled if s.request_id in self.requests
                   for feature in self.requests[s.request_id].features
                   if feature.overlaps(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens)]
        if not touched:
            return None
        embeds = embed_tokens(batch.input_ids).float()
        for s, feature in touched:
            rows = self.cache.get(feature.identifier)
            if rows is None:
                raise RequestFailedError(f"request {s.request_id!r}: the encoder output of its image at prompt "
                                         f"position {feature.offset} is not in the encoder cache",
                                         [s.request_id])
            step_rows, encoder_rows = feature.embed_rows(s.num_computed_tokens,
                                                         s.num_computed_tokens + s.num_scheduled_tokens)
            first = batch.first_rows[s.request_id]
            embeds[torch.from_numpy(step_rows + first)] = rows[torch.from_numpy(encoder_rows)]
        return embeds

    def positions(self, batch: ForwardBatch, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """The step's positions: the batch's [T], unless the model has M-RoPE and a request of the
        step has images: then [3, T], where a prompt row takes its column of the request's
        positions, a row past the prompt (a decode, a draft) its position + delta on all three
        axes, and a request without images its plain position."""
        with_images = [s for s in scheduled if s.request_id in self.requests]
        if not self.encoder.uses_mrope or not with_images:
            return batch.positions
        positions = batch.positions.expand(3, -1).clone()
        for s in with_images:
            images = self.requests[s.request_id]
            first = batch.first_rows[s.request_id]
            own = batch.positions[first : first + s.num_scheduled_tokens]
            in_prompt = own < images.num_prompt_tokens
            prompt_columns = images.mrope_positions[:, own.clamp(max=images.num_prompt_tokens - 1)]
            positions[:, first : first + len(own)] = torch.where(in_prompt, prompt_columns, own + images.mrope_delta)
        return positions
