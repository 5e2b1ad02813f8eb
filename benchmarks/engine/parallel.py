"""Tensor and pipeline parallelism on this machine: where a step's time goes.

Runs the offline `LLM` (the engine in this process, one worker process per rank over gloo)
in these configurations, alternating their order round by round:

  tp1-mini, tp2-mini: a random-weight Llama of SmolLM2-135M's size that TP 2 can split
                      (30 layers, hidden 512, 8 heads / 4 KV heads of 64, MLP 1536, vocab 49152;
                      SmolLM2's 9 heads do not divide by 2);
  tp1, tp3, pp2:      SmolLM2-135M-Instruct itself (the default GGUF), TP 3 (3 heads each) and
                      PP 2 (15 + 15 layers).

For each: decode-1 and decode-8 TBT (the median time between a request's tokens, 1 and 8 requests
at once: 64-token prompts, 64 output tokens), and Scenario A (64 requests at once, 256-token prompts, 64 output tokens,
`--max-num-batched-tokens 256`): output tok/s, the median step, and per step the collectives
each rank ran (count, bytes, seconds, from the step records' `ranks`). Every rank gets
OMP_NUM_THREADS = cores / ranks (at least 1), as the executor sets it.

Then gloo's own latency on this host: all-reduce of 1, 8 and 256 rows of 576 floats between 2
processes, and a pipeline hop (send + recv of the same). From the counts and bytes, what the
same collectives would cost on one GPU node with NCCL is projected from assumed NCCL figures
(--nccl-latency-us, --nccl-busbw-gbs), not measured here: no GPU was lent to this run.

    .venv/bin/python -m benchmarks.engine.parallel --rounds 2 --out parallel.json
    .venv/bin/python -m benchmarks.engine.parallel --rounds 1 --configs tp1,pp2 --requests 16   # a short check
    .venv/bin/python -m benchmarks.engine.parallel --smoke --model TINY_MODEL   # seconds: tp1, a few tokens, gloo twice
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from benchmarks.support import add_smoke_flag  # benchmarks/support.py

from chunkserve import LLM, SamplingParams
from chunkserve.bench.host import machine
from chunkserve.bench.service import free_port

CONFIGS = {
    "tp1-mini": ("mini", {}),
    "tp2-mini": ("mini", {"tensor_parallel_size": 2}),
    "tp1": (None, {}),
    "tp3": (None, {"tensor_parallel_size": 3}),
    "pp2": (None, {"pipeline_parallel_size": 2}),
}


def build_mini_model(folder: str) -> str:
    """A random-weight Llama of SmolLM2-135M's size whose heads split over 2 ranks."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from chunkserve.config.model import resolve_model
    from chunkserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(None))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def median_tbt(outputs) -> float:
    """The median time between a request's tokens, over every request (a pipeline splits the
    decodes over its micro-batches, so no one step holds them all: step times would mislead)."""
    gaps = [b - a for o in outputs for a, b in zip(o.metrics.token_times, o.metrics.token_times[1:])]
    return statistics.median(gaps)


def comm_per_step(records) -> dict:
    """Per step and rank (means over the steps): collectives, their bytes and seconds, the rank's step."""
    ranked = [r for r in records if r.ranks]
    if not ranked:
        return {}
    ranks = sorted({rank["rank"] for r in ranked for rank in r.ranks})
    out = {}
    for rank in ranks:
        rows = [x for r in ranked for x in r.ranks if x["rank"] == rank]
        out[rank] = {key: statistics.fmean(x[key] for x in rows) for key in ("comm_ops", "comm_bytes", "comm_s",
                                                                               "compute_s")}
    return out


def run_config(name: str, model: str | None, flags: dict, args) -> dict:
    llm = LLM(model, max_num_batched_tokens=256, kv_cache_memory_gb=1.0, max_num_seqs=64, **flags)
    try:
        vocab = llm.get_tokenizer()
        story = vocab.encode("The old lighthouse keeper climbed the stairs every evening, counting the steps. " * 40)
        result: dict = {"config": name}
        for rows in (1, 8):
            prompts = [story[i * 7: i * 7 + 64] for i in range(rows)]
            llm.engine.engine_core.step_records.clear()
            outputs = llm.generate(prompts, SamplingParams(max_tokens=args.decode_len, temperature=0.0,
                                                           ignore_eos=True), use_tqdm=False)
            result[f"decode{rows}_tbt_ms"] = 1000 * median_tbt(outputs)
            decode_steps = [r for r in llm.engine.step_records if r.num_prefill_tokens == 0]
            result[f"decode{rows}_ranks"] = comm_per_step(decode_steps)
        prompts = [story[i: i + args.prompt_len] for i in range(args.requests)]
        llm.engine.engine_core.step_records.clear()
        start = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
        seconds = time.perf_counter() - start
        records = list(llm.engine.step_records)
        result["scenario_a_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
        result["scenario_a_step_ms_p50"] = 1000 * statistics.median(r.duration_s for r in records)
        result["steps"] = len(records)
        result["ranks"] = comm_per_step(records)
        return result
    finally:
        llm.engine.shutdown()


# ----- gloo on this host -------------------------------------------------------------------

def _collective_rank(rank: int, port: int, iterations: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times = {}
    for rows in (1, 8, 256):
        tensor = torch.randn(rows, 576)
        for _ in range(10):
            dist.all_reduce(tensor)
        samples = []
        for _ in range(iterations):
            start = time.perf_counter()
            dist.all_reduce(tensor)
            samples.append(time.perf_counter() - start)
        times[f"all_reduce_{rows}x576_us"] = 1e6 * statistics.median(samples)
        samples = []
        for _ in range(iterations):
            start = time.perf_counter()
            if rank == 0:
                dist.send(tensor, 1)
                dist.recv(tensor, 1)
            else:
                dist.recv(tensor, 0)
                dist.send(tensor, 0)
            samples.append(time.perf_counter() - start)
        times[f"hop_round_trip_{rows}x576_us"] = 1e6 * statistics.median(samples)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def gloo_latency(iterations: int) -> dict:
    import torch.multiprocessing as mp

    port = free_port()
    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    processes = [context.Process(target=_collective_rank, args=(rank, port, iterations, out)) for rank in (0, 1)]
    for process in processes:
        process.start()
    times = out.get()
    for process in processes:
        process.join()
    return times


def project_nccl(ranks: dict, latency_us: float, busbw_gbs: float) -> dict:
    """The rank with the most collective time: its collectives per step at NCCL's assumed cost."""
    if not ranks:
        return {}
    worst = max(ranks.values(), key=lambda r: r["comm_s"])
    nccl_ms = (worst["comm_ops"] * latency_us * 1e-6 + worst["comm_bytes"] / (busbw_gbs * 1e9)) * 1000
    return {"gloo_comm_ms_per_step": 1000 * worst["comm_s"], "comm_ops_per_step": worst["comm_ops"],
            "comm_kib_per_step": worst["comm_bytes"] / 1024, "nccl_projected_comm_ms_per_step": nccl_ms,
            "compute_ms_per_step": 1000 * (worst["compute_s"] - worst["comm_s"])}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--requests", type=int, default=64, help="Scenario A's requests")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--collective-iterations", type=int, default=200)
    parser.add_argument("--nccl-latency-us", type=float, default=20.0,
                        help="assumed NCCL all-reduce latency for small messages inside one NVLink node")
    parser.add_argument("--nccl-busbw-gbs", type=float, default=450.0,
                        help="assumed NCCL bus bandwidth (H100 NVLink-4)")
    parser.add_argument("--out", help="write every result as JSON here")
    parser.add_argument("--model", default=None,
                        help="the model of tp1, tp3 and pp2 (default: the default model, SmolLM2-135M-Instruct)")
    add_smoke_flag(parser, "tp1 on --model, a few tokens, gloo twice (seconds): does it run?")
    args = parser.parse_args()
    args.decode_len = 64
    if args.smoke:
        args.configs, args.rounds, args.requests, args.prompt_len, args.output_len = "tp1", 1, 2, 16, 4
        args.decode_len, args.collective_iterations = 4, 2
    return args


def run_rounds(names: list[str], args: argparse.Namespace) -> list[dict]:
    """Every config once per round, their order reversed every other round; each result printed
    as it comes."""
    mini = None
    results = []
    with tempfile.TemporaryDirectory() as folder:
        if any(CONFIGS[n][0] == "mini" for n in names):
            mini = build_mini_model(folder)
        for round_index in range(args.rounds):
            order = names if round_index % 2 == 0 else names[::-1]
            for name in order:
                model, flags = CONFIGS[name]
                result = run_config(name, mini if model == "mini" else args.model, flags, args)
                result["round"] = round_index
                results.append(result)
                print(json.dumps(result), flush=True)
    return results


def projected_median(rows: list[dict], phase: str, key: str, args: argparse.Namespace) -> str:
    """The median over rounds of one figure of a phase's collectives with NCCL projected ("-" when
    the config has no collectives)."""
    projections = [project_nccl(r[phase], args.nccl_latency_us, args.nccl_busbw_gbs) for r in rows]
    projections = [p for p in projections if p]
    if not projections:
        return "-"
    value = statistics.median(p[key] for p in projections)
    return f"{value:.2f}" if key.startswith("nccl") else f"{value:.1f}"


def print_tables(names: list[str], results: list[dict], args: argparse.Namespace) -> None:
    """The configs' medians: whole runs, then the decode steps alone."""
    header = ("config", "decode-1 TBT ms", "decode-8 TBT ms", "Scen. A tok/s", "A step p50 ms", "collectives/step",
              "KiB/step", "gloo comm ms/step", "compute ms/step", "NCCL comm ms/step (projected)")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    phases = []
    for name in names:
        rows = [r for r in results if r["config"] == name]

        def med(key: str) -> float:
            return statistics.median(r[key] for r in rows)

        def pmed(phase: str, key: str) -> str:
            return projected_median(rows, phase, key, args)

        print(f"| {name} | {med('decode1_tbt_ms'):.1f} | {med('decode8_tbt_ms'):.1f} | {med('scenario_a_tok_s'):.1f} | "
              f"{med('scenario_a_step_ms_p50'):.0f} | {pmed('ranks', 'comm_ops_per_step')} | "
              f"{pmed('ranks', 'comm_kib_per_step')} | {pmed('ranks', 'gloo_comm_ms_per_step')} | "
              f"{pmed('ranks', 'compute_ms_per_step')} | {pmed('ranks', 'nccl_projected_comm_ms_per_step')} |")
        for phase in ("decode1_ranks", "decode8_ranks"):
            phases.append(f"| {name} | {phase.split('_')[0]} | " + " | ".join(
                pmed(phase, key) for key in ("comm_ops_per_step", "comm_kib_per_step", "gloo_comm_ms_per_step",
                                             "compute_ms_per_step", "nccl_projected_comm_ms_per_step")) + " |")
    print("\nThe decode steps alone (the rank with the most collective time, means per step):\n")
    print("| config | load | collectives/step | KiB/step | gloo comm ms/step | compute ms/step | "
          "NCCL comm ms/step (projected) |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(phases))


def main() -> None:
    args = parse_args()
    names = args.configs.split(",")
    results = run_rounds(names, args)
    gloo = gloo_latency(args.collective_iterations)
    print("\ngloo on this host (2 processes, 1 thread each):", json.dumps(gloo))
    host = machine()
    print(f"\n{host['cpu']}, {host['cpus']} cores, AVX-512: {host['avx512_flags'] or 'none'}, commit {host['commit']}")
    print(f"medians over {args.rounds} round(s); NCCL projected at {args.nccl_latency_us:g} us + bytes / "
          f"{args.nccl_busbw_gbs:g} GB/s per collective (assumed, not measured)\n")
    print_tables(names, results, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": host, "gloo": gloo, "results": results,
                       "nccl_assumed": {"latency_us": args.nccl_latency_us, "busbw_gbs": args.nccl_busbw_gbs}}, f,
                      indent=1)


if __name__ == "__main__":
    main()
