"""What the engine core sends the frontend per step, against the history it would carry.

32 requests decode after prompts of P tokens until each has O output tokens (P + O: the
history); then, over the next decode steps, this prints the median size and pickling time of
each step's message in the two designs:

- before: the core detokenized and sent every request's whole `RequestOutput` each step
  (prompt and output ids, text, logprobs, token times), as `EngineUpdate(record, outputs,
  stats)` did until the token-only core;
- after: the core sends `EngineCoreOutputs`, one `EngineCoreOutput` per request with only the
  new token ids (engine/messages.py), and the frontend's output processor builds the
  `RequestOutput`s on its side.

It also prints the same for the step's `SchedulerOutput`, what the core hands its workers (and
will broadcast to every tensor/pipeline-parallel rank): before, each scheduled request carried
its whole block table; after, only the blocks added since the worker last saw it.

Both messages come from one real run: the engine core (its scheduler, KV accounting and
messages) on a simulated executor (no model: the message does not depend on the model's
numbers), and the real output processor with the default model's tokenizer.

    .venv/bin/python -m benchmarks.engine.step_message_bytes [--logprobs 5] [--model PATH]
    .venv/bin/python -m benchmarks.engine.step_message_bytes --smoke --model TINY_MODEL   # seconds: does it run?
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import statistics
import time

from benchmarks.support import add_model_flag, add_smoke_flag  # benchmarks/support.py

from chunkserve.config import EngineArgs, resolve_model
from chunkserve.engine.core import EngineCore
from chunkserve.engine.messages import EngineCoreRequest
from chunkserve.engine.output_processor import OutputProcessor
from chunkserve.engine.tokenizer import load_tokenizer
from chunkserve.executor.simulated import SimulatedExecutor
from chunkserve.model.loader import load_model_config
from chunkserve.sampling_params import SamplingParams

SHAPES = [(192, 64), (3072, 1024)]  # (prompt, output so far): 256 and 4K tokens of history
SMOKE_SHAPES = [(16, 8)]


def pickled(message: object, repeats: int = 5) -> tuple[int, float]:
    """(bytes, median microseconds) of pickle.dumps(message)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data = pickle.dumps(message)
        times.append(time.perf_counter() - start)
    return len(data), statistics.median(times) * 1e6


class RecordingExecutor(SimulatedExecutor):
    """Keeps the last step's scheduler output, and the same with whole block tables (the old shape)."""

    def execute_model(self, scheduler_output):
        self.last = scheduler_output
        self.last_whole = dataclasses.replace(scheduler_output, scheduled=[
            dataclasses.replace(s, new_block_ids=list(self.tables(s.request_id))) for s in scheduler_output.scheduled])
        return super().execute_model(scheduler_output)


def measure(tokenizer, model_config, num_requests: int, prompt_len: int, output_len: int, logprobs: int | None,
            steps: int) -> dict[str, tuple[float, float]]:
    blocks = num_requests * (prompt_len + output_len + steps + 32) // 16 + 64
    executor = RecordingExecutor(model_config, blocks)
    core = EngineCore(EngineArgs(max_num_batched_tokens=8192, max_num_seqs=num_requests, num_kv_blocks=blocks),
                      executor)
    executor.tables = core.scheduler.kv.block_table
    frontend = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=output_len + steps + 16, ignore_eos=True, temperature=0, logprobs=logprobs)
    for i in range(num_requests):
        prompt = [1000 + (i * 31 + j) % 40000 for j in range(prompt_len)]
        request = EngineCoreRequest(f"request-{i}", prompt, params, None, arrival_time=time.time())
        core.add_request(request)
        frontend.add_request(request, None)
    sizes: dict[str, list[tuple[int, float]]] = {"before": [], "after": [], "workers before": [],
                                                 "workers after": []}
    while True:
        step = core.step()
        if logprobs is not None:  # the simulated executor has no logprobs: made-up ones, as many as asked
            step.outputs[:] = [o._replace(new_logprobs=[_fake_logprobs(t, logprobs) for t in o.new_token_ids])
                               for o in step.outputs]
        outputs = frontend.process_outputs(step.outputs, step.timestamp).request_outputs
        done = min(len(o.outputs[0].token_ids) for o in outputs) if len(outputs) == num_requests else 0
        if done >= output_len and step.record.num_decode_tokens == num_requests:
            sizes["before"].append(pickled((step.record, outputs, step.stats)))
            sizes["after"].append(pickled(step))
            sizes["workers before"].append(pickled(executor.last_whole))
            sizes["workers after"].append(pickled(executor.last))
            if len(sizes["after"]) == steps:
                break
    return {name: (statistics.median(b for b, _ in rows), statistics.median(us for _, us in rows))
            for name, rows in sizes.items()}


def _fake_logprobs(token_id: int, k: int):
    from chunkserve.core.messages import TokenLogprobs

    return TokenLogprobs(token_id, -0.5, [(token_id + i, -0.5 - i) for i in range(k)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="decode steps measured per shape")
    parser.add_argument("--logprobs", type=int, default=None, help="each request asks for this many top logprobs")
    add_model_flag(parser)
    add_smoke_flag(parser)
    args = parser.parse_args()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.smoke:
        args.requests, args.steps = 4, 2
    source = resolve_model(args.model)
    tokenizer, model_config = load_tokenizer(source), load_model_config(source)
    print(f"{args.requests} requests decoding, logprobs {args.logprobs}; median of {args.steps} decode steps")
    print("| history (prompt + output) | message | before: bytes | before: pickle us | after: bytes | after: pickle us |")
    print("|---|---|---|---|---|---|")
    for prompt_len, output_len in shapes:
        result = measure(tokenizer, model_config, args.requests, prompt_len, output_len, args.logprobs, args.steps)
        for label, key in (("core -> frontend", ""), ("core -> workers", "workers ")):
            (before_bytes, before_us), (after_bytes, after_us) = result[key + "before"], result[key + "after"]
            print(f"| {prompt_len} + {output_len} | {label} | {before_bytes:,.0f} | {before_us:,.0f} | "
                  f"{after_bytes:,.0f} | {after_us:,.0f} |")


if __name__ == "__main__":
    main()
