"""Drive a vision-language model through `ModelRunner.execute` with hand-made SchedulerOutputs,
as the scheduler would: a prompt cut into chunks of N tokens, each image's encoder input in the
step of the first chunk that reaches its range; then greedy decodes. Every row's logits are
recorded (a hook on the model's forward), and transformers' model on the same processor output
is the reference."""

from __future__ import annotations

import numpy as np
import torch

from chunkserve.config.model import ModelSource
from chunkserve.core.messages import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from chunkserve.core.multimodal import MultiModalFeature
from chunkserve.model.loader import load_model, load_model_config
from chunkserve.model.vlm.encoder import VisionEncoder
from chunkserve.model.vlm.processing import MultiModalProcessor
from chunkserve.sampling_params import SamplingParams
from chunkserve.worker.model_runner import ModelRunner
from tests.multimodal_models import build_vlm

BLOCK_SIZE = 16
NUM_BLOCKS = 64
PROMPT = "<|im_start|>user\nIMAGE what is this? IMAGE and this<|im_end|>\n<|im_start|>assistant\n"


class MultiModalDriver:
    def __init__(self, folder: str, op_backend: str = "auto") -> None:
        self.config = load_model_config(ModelSource(folder, "hf"))
        self.processor = MultiModalProcessor.from_folder(folder, self.config)
        model = load_model(ModelSource(folder, "hf"), self.config, "float32", 512)
        self.encoder = VisionEncoder.from_folder(folder, self.config)
        self.runner = ModelRunner(model, self.config, NUM_BLOCKS, BLOCK_SIZE, seed=0, op_backend=op_backend,
                                  encoder=self.encoder)
        self.logits: list[torch.Tensor] = []  # every row's, one tensor per step
        self.positions: list[torch.Tensor] = []  # the positions each step's forward took
        model.register_forward_pre_hook(lambda module, args: self.positions.append(args[1].clone()))
        model.register_forward_hook(lambda module, args, out: self.logits.append(module.compute_logits(out)))
        self._next_block = 0

    def process(self, images: list) -> tuple[list[int], list[MultiModalFeature]]:
        return self.processor.process(PROMPT.replace("IMAGE", self.processor.image_placeholder), images)

    def prefill(self, request_id: str, token_ids: list[int], features: list[MultiModalFeature], chunk: int,
                max_tokens: int = 1) -> tuple[torch.Tensor, list[ModelRunnerOutput]]:
        """Run the prompt in chunks of `chunk` tokens; its logits [P, vocab] and the steps' outputs."""
        self.logits.clear()
        blocks = self.blocks_for(len(token_ids) + max_tokens)
        new = new_request(request_id, token_ids, features, max_tokens)
        scheduled_images: set[int] = set()
        outputs = []
        for start in range(0, len(token_ids), chunk):
            count = min(chunk, len(token_ids) - start)
            encoder_inputs = [i for i, f in enumerate(features) if f.overlaps(start, start + count)
                              and i not in scheduled_images]
            scheduled_images.update(encoder_inputs)
            step = ScheduledRequest(request_id, start, count, blocks if start == 0 else [], start == 0,
                                    start + count == len(token_ids), False, encoder_inputs=encoder_inputs)
            outputs.append(self.runner.execute(SchedulerOutput([step], [new] if start == 0 else [])))
        return torch.cat(self.logits), outputs

    def blocks_for(self, num_tokens: int) -> list[int]:
        """Blocks for a request, taken round the pool: the requests before it are done with theirs."""
        count = -(-num_tokens // BLOCK_SIZE)
        first, self._next_block = self._next_block, self._next_block + count
        return [block % NUM_BLOCKS for block in range(first, first + count)]

    def decode(self, request_id: str, num_computed: int, steps: int) -> list[int]:
        """Greedy decode steps after a prompt of `num_computed` tokens whose first token was sampled."""
        state = self.runner.persistent_batch.sampling[request_id]
        for index in range(steps):
            step = ScheduledRequest(request_id, num_computed + index, 1, [], False, True, True)
            self.runner.execute(SchedulerOutput([step], []))
        return state.token_ids[state.num_prompt_tokens :]


def new_request(request_id: str, token_ids: list[int], features: list[MultiModalFeature],
                max_tokens: int = 1) -> NewRequestData:
    return NewRequestData(request_id, token_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), None,
                          mm_features=features)


def hf_inputs(token_ids: list[int], features: list[MultiModalFeature]) -> dict[str, torch.Tensor]:
    """transformers' model inputs for the prompt: its processors' tensors of all images, batched
    as the full processor batches them (Idefics3's images along dim 1, the others' along dim 0)."""
    inputs: dict[str, torch.Tensor] = {"input_ids": torch.tensor([token_ids])}
    axis = 1 if "pixel_attention_mask" in features[0].data else 0  # Idefics3: [1, images, ...]
    for key in features[0].data:
        inputs[key] = torch.from_numpy(np.concatenate([f.data[key] for f in features], axis=axis))
    if "image_grid_thw" in inputs:  # Qwen2-VL: which tokens are image tokens, for its M-RoPE
        types = torch.zeros_like(inputs["input_ids"], dtype=torch.int32)
        for f in features:
            types[0, f.offset : f.end] = 1
        inputs["mm_token_type_ids"] = types
    return inputs


def vlm_folder(tmp_path_factory, architecture: str) -> str:
    """The tiny model of `architecture`, built once per test session (tests must not change it)."""
    folder = tmp_path_factory.getbasetemp() / f"vlm-{architecture}"
    if not (folder / "config.json").exists():
        build_vlm(architecture, str(folder))
    return str(folder)


def hf_model(folder: str):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
