"""Runs one scheduled step: update the persistent batch from the scheduler's diff
(persistent_batch.py), build the flat batch, one forward, logits for the sampling rows, sample.
A decode that carries draft tokens (speculative decoding) has a row per draft and samples them
all: `sample_runs` keeps the drafts the target agrees with and adds one token of its own; a
draft model, if configured, then proposes the next drafts (docs/SPECULATIVE.md).

A step changes the requests' state (their token histories, their generators) only once it has
succeeded for every row: when it raises, the engine core can void it and run it again without
the requests at fault (`RequestFailedError` names them where the runner can tell).

With several ranks (model/parallel.py) every rank runs every step on its shard: a pipeline stage
after the first starts from the previous stage's (hidden, residual), a stage before the last
sends its own on, and only the last stage's first tensor-parallel rank samples. The ranks then
take every request's tokens from the steps (`tokens_from_steps`: ScheduledRequest.new_token_ids)
rather than from their own sampling, so they all hold the same histories.

In deterministic mode (`--deterministic`) every request samples by Gumbel-max with a seed of its
own (its seed, else one derived from the engine's seed and its id: sampler.py, gumbel.py), and
the ops must give a row the same bits in any batch, which plain torch cannot: the C++ ops are
required."""

from __future__ import annotations

import numpy as np
import torch

from chunkserve.core.kv_connector import KVConnectorWorker, NoOpConnector
from chunkserve.core.messages import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput, TokenLogprobs
from chunkserve.errors import InvalidRequestError, RequestFailedError
from chunkserve.model.config import ModelConfig
from chunkserve.model.llama import LlamaModel
from chunkserve.model.vlm.encoder import VisionEncoder
from chunkserve.ops.cpp_ops import cpp_ops_for, model_ops_for
from chunkserve.worker.gumbel import request_seed
from chunkserve.worker.input_batch import ForwardBatch, build_forward_batch
from chunkserve.worker.kv_cache import allocate_kv_pool, layer_caches, read_blocks, write_blocks
from chunkserve.worker.multimodal_inputs import MultiModalInputs
from chunkserve.worker.persistent_batch import PersistentBatch
from chunkserve.worker.sampler import InvalidRowsError, SamplingState, gather_logprobs, sample_runs
from chunkserve.worker.draft_model import DraftModelProposer

PROMPT_LOGPROB_ROWS = 256  # prompt rows turned into logits at once for prompt_logprobs


class ModelRunner:
    def __init__(self, model: LlamaModel, config: ModelConfig, num_blocks: int, block_size: int, seed: int,
                 op_backend: str = "auto", kv_connector: KVConnectorWorker | None = None,
                 kv_config: ModelConfig | None = None, tokens_from_steps: bool = False,
                 drafter: DraftModelProposer | None = None, encoder: VisionEncoder | None = None,
                 deterministic: bool = False) -> None:
        """`kv_config`: the shape of this rank's share of the KV (its layers and KV heads; default
        `config`, all of them). `drafter`: speculative decoding's draft model, which proposes the
        next drafts of the requests the scheduler asks (`num_draft_proposals`). `encoder`: a
        vision-language model's vision encoder, whose outputs the runner caches. `deterministic`:
        batch-invariant numerics and seeded Gumbel-max sampling (EngineArgs.deterministic)."""
        self.model = model
        self.parallel = model.parallel
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.block_size = block_size
        self.tokens_from_steps = tokens_from_steps
        self.dtype = next(model.parameters()).dtype  # of the activations between stages
        self.kv_pool = allocate_kv_pool(kv_config or config, model.compute_dtype, num_blocks, block_size)
        self.kv_caches = layer_caches(self.kv_pool)
        self.seed = seed
        self.deterministic = deterministic
        self.generator = torch.Generator().manual_seed(seed)
        self.kv_connector = kv_connector or NoOpConnector()
        self.kv_connector.register_kv_caches(self.kv_pool)
        # told per layer when KV may be read and was written; None skips the calls of a no-op
        self._layer_connector = None if isinstance(self.kv_connector, NoOpConnector) else self.kv_connector
        self.persistent_batch = PersistentBatch()
        self.drafter = drafter
        self.multimodal = None if encoder is None else MultiModalInputs(encoder)
        self.cpp_ops = cpp_ops_for(op_backend)
        if deterministic and self.cpp_ops is None:
            raise InvalidRequestError("--deterministic needs the C++ ops, which could not be built here (see the "
                                      "warning above): plain torch gives a row different bits in different batches")
        self.attention_kernels = (None if self.cpp_ops is None
                                  else self.cpp_ops.attention_kernels(deterministic=deterministic))
        model.set_ops(model_ops_for(self.cpp_ops, model.compute_dtype, model.int8_activations,
                                    deterministic=deterministic))
        if drafter is not None:
            drafter.bind(num_blocks, block_size, self.cpp_ops, self.attention_kernels, deterministic)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        # The connector's I/O first, in every step (an empty one too, and before anything can fail,
        # so its metadata is never lost): it copies out the blocks to save before this forward may
        # overwrite them, then copies in the loads that finished.
        connector = self.kv_connector
        connector.bind_connector_metadata(output.kv_connector_metadata)
        connector.start_load_kv()
        batch = self.persistent_batch
        multimodal = self.multimodal
        for request_id in output.finished_request_ids:
            batch.remove(request_id)
            if multimodal is not None:
                multimodal.remove_request(request_id)
        invalid: dict[str, str] = {}
        for new in output.new_requests:
            state, problem = self._new_state(new)
            batch.remove(new.request_id)  # sent again after a failed step: a fresh state, as the first time
            batch.add(new.request_id, state)
            if problem is None and multimodal is not None:
                problem = multimodal.add_request(new)
            if problem is not None:
                invalid[new.request_id] = problem
        for scheduled in output.scheduled:
            batch.update_blocks(scheduled)
            if scheduled.new_token_ids and scheduled.request_id in batch:
                token_ids = batch.sampling[scheduled.request_id].token_ids
                del token_ids[scheduled.token_ids_from:]
                token_ids.extend(scheduled.new_token_ids)
            state = batch.sampling.get(scheduled.request_id)
            if state is not None and state.prompt_logprobs is not None and (
                    scheduled.num_computed_tokens >= len(state.prompt_logprobs)):  # rows before it were never here
                invalid[scheduled.request_id] = (
                    f"prompt_logprobs cannot be computed: the prompt's first {scheduled.num_computed_tokens} tokens "
                    "were computed by another engine (an imported request); send it again")
        if invalid:  # raised once the diff is applied, so the batch stays in step with the scheduler
            raise RequestFailedError("; ".join(invalid.values()), list(invalid))
        result = ModelRunnerOutput(sampled_token_ids={})
        if multimodal is not None:
            result.num_encoder_calls, result.encoder_seconds = multimodal.run_encoders(output)
        if not output.is_empty:
            scored = self._forward_and_sample(output, result)
            self._keep_prompt_logprobs(output.scheduled, scored, result)
            connector.wait_for_save()
        connector.on_step_output(result.sampled_token_ids, result.logprobs, self.generator_state)
        result.finished_sending, result.finished_recving = connector.get_finished(output.finished_request_ids)
        result.invalid_block_ids = connector.get_block_ids_with_load_errors()
        result.kv_connector_output = connector.take_connector_output()
        return result

    def _forward_and_sample(self, output: SchedulerOutput,
                            result: ModelRunnerOutput) -> dict[str, list[TokenLogprobs]]:
        """One forward, then the sampling rows' tokens into `result`. Returns the prompt logprobs
        the step's rows scored (`_score_prompts`), which the caller keeps once the step succeeded."""
        persistent = self.persistent_batch
        sampling = persistent.sampling
        scheduled = output.scheduled
        token_ids = {s.request_id: sampling[s.request_id].token_ids for s in scheduled}
        tables = {s.request_id: persistent.blocks(s.request_id) for s in scheduled}
        batch = build_forward_batch(scheduled, token_ids, tables, self.block_size, self.attention_kernels)
        batch.attn.kv_connector = self._layer_connector
        parallel = self.parallel
        intermediate = None
        if not parallel.is_first_stage:
            rows = (len(batch.input_ids), self.hidden_size)
            intermediate = tuple(parallel.recv_from_prev_stage([rows, rows], self.dtype))
        positions, input_embeds = self._positions_and_embeds(batch, scheduled)
        hidden = self.model(batch.input_ids, positions, self.kv_caches, batch.attn, intermediate, input_embeds)
        if not parallel.is_last_stage:
            parallel.send_to_next_stage(list(hidden))
            return {}
        scored = self._score_prompts(batch, scheduled, hidden)
        if not batch.sample_request_ids:
            if self.drafter is not None:  # the draft model's KV follows every computed row, prompt chunks too
                self.drafter.propose(batch, scheduled, token_ids, tables, {})
            return scored
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if logits is None:  # a tensor-parallel rank that only lent its vocabulary shard
            return scored
        ids = batch.sample_request_ids
        states = [sampling[request_id] for request_id in ids]
        by_id = {s.request_id: s for s in scheduled}
        drafts = [by_id[request_id].draft_token_ids for request_id in ids]
        first_rows = np.cumsum([0] + [1 + len(d) for d in drafts[:-1]])  # each request's first logits row
        wants_logprobs = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        logprob_rows = [first_rows[i] + j for i in wants_logprobs for j in range(1 + len(drafts[i]))]
        raw_logprobs = logits[logprob_rows].log_softmax(dim=-1) if wants_logprobs else None
        try:
            runs = sample_runs(logits, states, drafts, self.generator,  # modifies logits in place
                               [by_id[request_id].grammar_bitmask for request_id in ids])
        except InvalidRowsError as error:
            culprits = [ids[index] for index in error.rows]
            raise RequestFailedError("sampling failed: the request's logits, after its penalties, token masks "
                                     "(grammar, allowed_token_ids, bad_words, min_tokens) and temperature, are not a "
                                     "probability distribution (NaN or infinite, or every token masked)",
                                     culprits) from None
        if wants_logprobs:  # one record per accepted token, from the row that scored it
            where = {row: i for i, row in enumerate(logprob_rows)}
            rows = [where[first_rows[i] + j] for i in wants_logprobs for j in range(len(runs[i]))]
            records = iter(gather_logprobs(raw_logprobs[rows], [t for i in wants_logprobs for t in runs[i]],
                                           [states[i].params.logprobs for i in wants_logprobs for _ in runs[i]]))
            result.logprobs = {ids[i]: [next(records) for _ in runs[i]] for i in wants_logprobs}
        result.sampled_token_ids = dict(zip(ids, runs))
        if self.drafter is not None:
            result.draft_token_ids = self.drafter.propose(batch, scheduled, token_ids, tables, result.sampled_token_ids)
        if not self.tokens_from_steps:
            for state, run in zip(states, runs):  # the step succeeded: only now does any state change
                state.token_ids.extend(run)
        return scored

    def _positions_and_embeds(self, batch: ForwardBatch, scheduled: list[ScheduledRequest]
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows' positions ([3, T] for M-RoPE) and, in a step that reaches an image, their
        input embeddings with the image rows spliced in (None: the model embeds the input ids)."""
        if self.multimodal is None:
            return batch.positions, None
        return (self.multimodal.positions(batch, scheduled),
                self.multimodal.input_embeds(batch, scheduled, self.model.embed_tokens))

    def _score_prompts(self, batch: ForwardBatch, scheduled: list[ScheduledRequest],
                       hidden: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        """prompt_logprobs: per request still gathering them, the records of the prompt tokens
        this step's rows predict (the row at position p predicts token p + 1), from the raw
        logits, with the request's top k. Empty on a rank that computes no logits. The rows are
        turned into logits PROMPT_LOGPROB_ROWS at a time, which bounds the memory a long chunk
        takes ([rows, vocab] floats)."""
        sampling = self.persistent_batch.sampling
        rows: list[int] = []
        targets: list[int] = []
        num_top: list[int] = []
        owners: list[tuple[str, int]] = []
        for s in scheduled:
            state = sampling[s.request_id]
            count = _num_prompt_rows(s, state)
            if count:
                first = batch.first_rows[s.request_id]
                rows.extend(range(first, first + count))
                targets.extend(state.token_ids[s.num_computed_tokens + 1 : s.num_computed_tokens + 1 + count])
                num_top.extend([state.params.prompt_logprobs] * count)
                owners.append((s.request_id, count))
        records: list[TokenLogprobs] = []
        for start in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            part = slice(start, start + PROMPT_LOGPROB_ROWS)
            logits = self.model.compute_logits(hidden[rows[part]])  # every rank calls it: it gathers the shards
            if logits is not None:  # (None: a tensor-parallel rank that only lent its vocabulary shard)
                records.extend(gather_logprobs(logits.log_softmax(dim=-1), targets[part], num_top[part]))
        if not records:
            return {}
        found = iter(records)
        return {request_id: [next(found) for _ in range(count)] for request_id, count in owners}

    def _keep_prompt_logprobs(self, scheduled: list[ScheduledRequest], scored: dict[str, list[TokenLogprobs]],
                              result: ModelRunnerOutput) -> None:
        """After a step that succeeded: each request gathering prompt logprobs keeps the step's
        (in place of any from before a preemption; placeholders on a rank that scored nothing,
        so every rank counts alike), and hands them all out in the step that samples its first
        token."""
        sampling = self.persistent_batch.sampling
        for s in scheduled:
            state = sampling[s.request_id]
            gathered = state.prompt_logprobs
            if gathered is None:
                continue
            del gathered[s.num_computed_tokens + 1 :]
            gathered.extend(scored.get(s.request_id) or [None] * _num_prompt_rows(s, state))
            if s.sample:
                result.prompt_logprobs[s.request_id] = gathered
                state.prompt_logprobs = None

    def _new_state(self, new: NewRequestData) -> tuple[SamplingState, str | None]:
        """The request's sampler state, and what is wrong with its data, if anything (the
        frontend checks this; a request that reaches the core another way is checked here)."""
        problem, generator = None, None
        params = new.sampling_params
        tokens = new.prompt_token_ids + new.output_token_ids
        if tokens and not 0 <= min(tokens) <= max(tokens) < self.vocab_size:
            problem = f"a token id of the request is outside the vocabulary [0, {self.vocab_size})"
        masked = [*(params.allowed_token_ids or ()), *(t for word in params.bad_words_token_ids or () for t in word)]
        if masked and not 0 <= min(masked) <= max(masked) < self.vocab_size:
            problem = f"allowed_token_ids or bad_words name a token outside the vocabulary [0, {self.vocab_size})"
        if new.mm_features and self.multimodal is None:
            problem = "the request has images, but the model takes text only"
        if params.bad_words and params.bad_words_token_ids is None:
            problem = "bad_words were not tokenized (the frontend's input processor does it)"
        try:
            if params.seed is not None:
                generator = torch.Generator().manual_seed(params.seed)
        except (RuntimeError, TypeError, OverflowError) as error:
            problem = f"seed {params.seed!r} is not usable: {error}"
        if generator is not None and new.generator_state is not None:  # an imported request continues its stream
            try:
                generator.set_state(torch.frombuffer(bytearray(new.generator_state), dtype=torch.uint8))
            except (RuntimeError, TypeError, ValueError) as error:
                problem = f"the imported request's generator state is not usable: {error}"
        state = SamplingState(
            params=params,
            token_ids=list(tokens),
            num_prompt_tokens=len(new.prompt_token_ids),
            eos_token_id=new.eos_token_id,
            generator=generator,
            # an imported request with output had its prompt logprobs handed out by the engine it came from
            prompt_logprobs=[None] if params.prompt_logprobs is not None and not new.output_token_ids else None,
            gumbel_seed=self._gumbel_seed(new),
        )
        return state, problem

    def _gumbel_seed(self, new: NewRequestData) -> int | None:
        """Deterministic mode: the request's seed, else one derived from the engine's and its id
        (the samples of an n > 1 request have ids of their own, so they differ)."""
        if not self.deterministic:
            return None
        seed = new.sampling_params.seed
        return request_seed(self.seed, new.request_id) if seed is None else seed

    # ----- KV and sampler state in and out (snapshots, KV tiers) ------------------------------

    def read_kv_blocks(self, block_ids: list[int]) -> list[bytes]:
        return read_blocks(self.kv_pool, block_ids, self.block_size)

    def write_kv_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        write_blocks(self.kv_pool, block_ids, self.block_size, payloads)

    def generator_state(self, request_id: str) -> bytes | None:
        """The request's own generator state (seeded requests), as the next draw would find it."""
        state = self.persistent_batch.sampling.get(request_id)
        if state is None or state.generator is None:
            return None
        return state.generator.get_state().numpy().tobytes()


def _num_prompt_rows(scheduled: ScheduledRequest, state: SamplingState) -> int:
    """How many of the step's rows of the request predict a prompt token whose logprob it is
    gathering: those at positions before the prompt's last (whose row predicts the output)."""
    if state.prompt_logprobs is None:
        return 0
    start = scheduled.num_computed_tokens
    return max(min(start + scheduled.num_scheduled_tokens, state.num_prompt_tokens - 1) - start, 0)
