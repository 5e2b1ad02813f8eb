"""Runs one scheduled step: build the flat batch, one forward, logits for sampling rows, sample."""

from __future__ import annotations

import torch

from chunkserve.core.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from chunkserve.model.config import ModelConfig
from chunkserve.model.llama import LlamaModel
from chunkserve.worker.input_batch import build_forward_batch
from chunkserve.worker.kv_cache import allocate_kv_cache
from chunkserve.worker.cpp_ops import cpp_ops_for
from chunkserve.worker.sampler import SamplingState, gather_logprobs, sample


class ModelRunner:
    def __init__(self, model: LlamaModel, config: ModelConfig, num_blocks: int, block_size: int, seed: int,
                 op_backend: str = "auto") -> None:
        self.model = model
        self.block_size = block_size
        self.dtype = model.embed_tokens.weight.dtype
        self.kv_caches = allocate_kv_cache(config, self.dtype, num_blocks, block_size)
        self.generator = torch.Generator().manual_seed(seed)
        self._states: dict[str, SamplingState] = {}
        # The C++ ops are float32 only; other dtypes keep plain torch.
        self.cpp_ops = cpp_ops_for(op_backend if self.dtype == torch.float32 else "torch")
        self.attention_kernels = None if self.cpp_ops is None else self.cpp_ops.attention_kernels()
        if self.cpp_ops is not None:
            model.set_ops(self.cpp_ops.model_ops())

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in output.finished_request_ids:
            self._states.pop(request_id, None)
        for new in output.new_requests:
            self._states[new.request_id] = self._new_state(new)
        if output.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})

        token_ids = {s.request_id: self._states[s.request_id].token_ids for s in output.scheduled}
        batch = build_forward_batch(output.scheduled, token_ids, self.block_size, self.attention_kernels)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
        if not batch.sample_request_ids:
            return ModelRunnerOutput(sampled_token_ids={})
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        states = [self._states[request_id] for request_id in batch.sample_request_ids]
        wants_logprobs = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        raw_logprobs = logits[wants_logprobs].log_softmax(dim=-1) if wants_logprobs else None
        tokens = sample(logits, states, self.generator)  # modifies logits in place
        for state, token in zip(states, tokens):
            state.token_ids.append(token)
        output = ModelRunnerOutput(sampled_token_ids=dict(zip(batch.sample_request_ids, tokens)))
        if wants_logprobs:
            records = gather_logprobs(
                raw_logprobs, [tokens[i] for i in wants_logprobs], [states[i].params.logprobs for i in wants_logprobs]
            )
            output.logprobs = {batch.sample_request_ids[i]: r for i, r in zip(wants_logprobs, records)}
        return output

    @staticmethod
    def _new_state(new: NewRequestData) -> SamplingState:
        seed = new.sampling_params.seed
        return SamplingState(
            params=new.sampling_params,
            token_ids=list(new.prompt_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            eos_token_id=new.eos_token_id,
            generator=None if seed is None else torch.Generator().manual_seed(seed),
        )
