"""What publishing KV events (--kv-events-config) costs the engine thread per step.

The engine publishes each step's events after the step, on its own thread: building the
message (msgpack of the step's BlockStored / BlockRemoved events, token ids included) and a
non-blocking send. This runs the default model in-process with events on and a subscriber
connected, on a multi-turn workload (a shared system prompt, growing conversations, a pool
small enough to evict), times every `publish` call, and reports its cost next to the step it
follows: the share of step time (total and per step, p50/p99/max) and the bytes sent.

    .venv/bin/python -m benchmarks.engine.kv_events_overhead [--chats 16] [--turns 4] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

from benchmarks.support import (  # benchmarks/support.py
    EventRecorder,
    add_model_flag,
    add_smoke_flag,
)
from chunkserve.bench.host import machine
from chunkserve.config import EngineArgs
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.sampling_params import SamplingParams


def conversations(chats: int, turns: int, system_len: int, turn_len: int, seed: int = 0) -> list[list[list[int]]]:
    """Per chat, the prompt of each turn: the system prompt, then every earlier turn and answer."""
    rng = random.Random(seed)
    system = [rng.randint(100, 40000) for _ in range(system_len)]
    chats_out = []
    for _ in range(chats):
        history, prompts = list(system), []
        for _ in range(turns):
            history += [rng.randint(100, 40000) for _ in range(turn_len)]
            prompts.append(list(history))
            history += [rng.randint(100, 40000) for _ in range(64)]  # the answer (as if it were the model's)
        chats_out.append(prompts)
    return chats_out


def run(args: argparse.Namespace, folder: str) -> dict:
    endpoint = f"ipc://{folder}/events"
    engine = LLMEngine(EngineArgs(model=args.model, num_kv_blocks=args.num_kv_blocks, kv_events_config={
        "enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": f"ipc://{folder}/replay"}))
    publisher = engine.engine_core.kv_events
    costs: list[float] = []
    steps: list[float] = []
    publish = publisher.publish

    def timed_publish(events):
        start = time.perf_counter()
        publish(events)
        costs.append(time.perf_counter() - start)

    publisher.publish = timed_publish
    recorder = EventRecorder(endpoint)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    chats = conversations(args.chats, args.turns, args.system_len, args.turn_len)
    try:
        for turn in range(args.turns):  # every chat's turn t together, as concurrent users would
            for c, prompts in enumerate(chats):
                engine.add_request(f"c{c}-t{turn}", prompts[turn], params)
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()  # (one publish per step, timed inside it)
                steps.append(time.perf_counter() - start)
    finally:
        engine.shutdown()
        frames = recorder.close()
    assert len(costs) >= len(steps)
    per_step = [cost / step for cost, step in zip(costs, steps)]
    return {
        "steps": len(steps), "publish_calls": len(costs), "messages_received": len(frames),
        "bytes_received": sum(len(payload) for _, payload in frames), "evictions": engine.engine_core.scheduler.kv.pool.num_evictions,
        "publish_us": {"p50": statistics.median(costs) * 1e6, "p99": sorted(costs)[int(len(costs) * 0.99)] * 1e6,
                       "max": max(costs) * 1e6},
        "step_ms_p50": statistics.median(steps) * 1e3,  # engine.step() calls, the publish included
        "share_of_step_time_total": sum(costs) / sum(steps),
        "share_per_step": {"p50": statistics.median(per_step), "p99": sorted(per_step)[int(len(per_step) * 0.99)],
                           "max": max(per_step)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--turn-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=512, help="small enough that later turns evict")
    parser.add_argument("--out", help="write the result as JSON here")
    add_model_flag(parser)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.chats, args.turns, args.system_len, args.turn_len, args.output_len = 2, 2, 64, 32, 4
    with tempfile.TemporaryDirectory(prefix="kv-events-") as folder:
        result = {"host": machine(), "config": vars(args), **run(args, folder)}
    print(json.dumps(result, indent=2))
    share = result["share_per_step"]
    print(f"publish cost per step: {result['publish_us']['p50']:.0f} us p50, {share['p50']:.3%} of the step p50, "
          f"{share['p99']:.3%} p99, {share['max']:.3%} max; {result['share_of_step_time_total']:.3%} of all step time")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
