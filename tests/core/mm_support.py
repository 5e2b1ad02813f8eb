"""Requests with hand-made images and a fake runner with the worker's encoder cache, for the
scheduler's multimodal tests (support, not a test module)."""

from __future__ import annotations

import dataclasses
import zlib

from chunkserve.core.messages import ModelRunnerOutput, SchedulerOutput
from chunkserve.core.multimodal import MultiModalFeature
from chunkserve.core.request import Request
from chunkserve.sampling_params import SamplingParams
from tests.core.support import EOS, FakeRunner

PLACEHOLDER = 998  # every image's placeholder token id (the fake model's tokens are 1..997)


def image(identifier: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature(identifier=identifier, offset=offset, length=length)


def image_request(request_id: str, prompt_len: int, images: list[tuple[str, int, int]], max_tokens: int = 4,
                  text_seed: str = "text") -> Request:
    """A prompt of `prompt_len` tokens whose ranges (identifier, offset, length) hold placeholders;
    its text comes from `text_seed`, so requests with one seed share their text."""
    prompt = [(zlib.crc32(text_seed.encode()) + i) % 997 + 1 for i in range(prompt_len)]
    features = [image(*spec) for spec in images]
    for f in features:
        prompt[f.offset : f.end] = [PLACEHOLDER] * f.length
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=EOS,
                   arrival_time=0.0, mm_features=features)


def image_content(prompt: list[int], features: list[MultiModalFeature]) -> list[int]:
    """What the model computes from: each placeholder replaced by its image's row (so KV of one
    image is never the KV of another of the same size)."""
    content = list(prompt)
    for f in features:
        base = 1000 + zlib.crc32(f.identifier.encode()) % 100_000
        content[f.offset : f.end] = [base + row for row in range(f.length)]
    return content


class EncoderRunner(FakeRunner):
    """The fake runner plus the worker's encoder cache: it drops the outputs the step frees, runs the
    encoder inputs (`encoded`, in order), and asserts that it never encodes an output it holds and
    that every chunk finds the outputs of the images it overlaps. Its KV holds the images' content,
    so a block reused for another image fails the runner's KV check."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.held: set[str] = set()
        self.encoded: list[tuple[str, str]] = []  # (request id, identifier)
        self.features: dict[str, list[MultiModalFeature]] = {}

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self.held.difference_update(output.free_encoder_ids)
        for new in output.new_requests:
            self.features[new.request_id] = new.mm_features
        for s in output.scheduled:
            for index in s.encoder_inputs:
                identifier = self.features[s.request_id][index].identifier
                assert identifier not in self.held, f"{identifier} encoded while its output is held"
                self.held.add(identifier)
                self.encoded.append((s.request_id, identifier))
        for s in output.scheduled:
            for f in self.features[s.request_id]:
                if f.overlaps(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens):
                    assert f.identifier in self.held, f"{s.request_id}'s chunk needs {f.identifier}, not encoded"
        new = [dataclasses.replace(n, prompt_token_ids=image_content(n.prompt_token_ids, n.mm_features))
               for n in output.new_requests]
        result = super().execute(dataclasses.replace(output, new_requests=new))
        for request_id in output.finished_request_ids:
            self.features.pop(request_id, None)
        return result

    def encodes_of(self, request_id: str) -> list[str]:
        return [identifier for rid, identifier in self.encoded if rid == request_id]
