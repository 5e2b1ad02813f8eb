"""Routing policies for a fleet of chunkserve replicas under multi-turn chat: how much of each
chat's history the replica it lands on still has cached, and what that does to TTFT.

Each (policy, seed) run starts its own replicas (cold caches: no run inherits another's), each
pinned to a core of its own (`--replica-cpus 0,1`) and publishing KV events, puts the policy's
front end before them and sends `chunkserve bench serve`'s multi-turn workload through it:
`--chats` chats of `--turns` turns, a `--system-len`-token system prompt shared by every chat,
`--user-len`-token user turns, `--answer-len`-token answers, the chats' first turns arriving as a
Poisson process at `--rate` chats/s (keep it below saturation: the question is placement, not
queueing), every later turn sent when the previous one's answer ended.

Policies (front ends):
  smg-round-robin    SMG (`smg launch --policy round_robin`): the cache-blind baseline;
  smg-cache-aware    SMG `--policy cache_aware`: its own approximate tree of what it sent where;
  event-driven       benchmarks/fleet/event_router.py: Dynamo's KV indexer following the replicas'
                     KV events; each request to the replica with the fewest blocks to prefill (the
                     indexer's overlap) plus blocks in flight, Dynamo's KV router cost (its docstring);
  ray-prefix-affinity  Ray Serve LLM's PrefixCacheAffinityRouter before chunkserve replicas on Ray
                     Serve (chunkserve/entrypoints/ray_serve.py), one per one-CPU node of a local
                     cluster, each node pinned to its replica's CPUs (`ray_prefix_affinity`).

Every replica runs with `--metrics-compat vllm`: SMG reads each one's load from its vLLM-named
gauges (without them it sees none, and cache_aware never balances).

Per run, for turns >= 2 (the turns with a history to reuse): the history hit rate (of the chat's
own history, the previous turn's prompt in whole blocks less the shared system prompt, the share
the replica read from its cache: round-robin over N replicas gives about 1/N, as the system prompt
is soon cached everywhere; the answer in the history is the workload's, not the server's, so it
is never cached), the prompt hit rate (cached over prompt tokens, system prompt included), TTFT
p50/p99; for the whole run: output tokens/s, requests each replica served (its
`chunkserve:request_success_total`) and failures. Written as JSON (`--out`) with a figure beside it.

    python -m benchmarks.fleet.multi_turn --seeds 0,1,2 --out fleet.json          # the measurement
    python -m benchmarks.fleet.multi_turn --smoke --model TINY.gguf --out /tmp/f.json   # 2 chats x 2 turns
    python -m benchmarks.fleet.multi_turn --dry-run                                   # the plan only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.support import text_workload  # benchmarks/support.py
from chunkserve.bench.client import run_requests
from chunkserve.bench.host import machine
from chunkserve.bench.kv_indexer import KVIndexer
from chunkserve.bench.metrics import ms_distribution, summarize, ttft
from chunkserve.bench.service import Service, free_port, serve_command
from chunkserve.bench.smg import smg_binary, smg_command, wait_smg_workers
from chunkserve.bench.workloads import RequestSpec
from chunkserve.config.model import resolve_model
from chunkserve.engine.tokenizer import load_tokenizer

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK_SIZE = 16
SUCCESS = "chunkserve:request_success_total"
RAY_OBJECT_STORE_BYTES = 80 * 1024 * 1024  # Ray's minimum is 75 MiB; the benchmark moves kilobytes
SMOKE = {"chats": 2, "turns": 2, "system_len": 64, "user_len": 32, "answer_len": 8, "max_model_len": 512}


class PolicyUnavailable(Exception):
    """A policy that cannot run here; the run is recorded as skipped with this reason."""


@dataclass
class Replica:
    service: Service
    events: str  # where a subscriber connects
    replay: str


@dataclass
class FrontEnd:
    url: str  # where the benchmark sends its requests
    replicas: list[Service]  # whose /metrics count the requests each served


# ----- replicas and front ends ----------------------------------------------------------------

def start_replicas(args: argparse.Namespace, workdir: str, tag: str) -> list[Replica]:
    """One chunkserve server per `--replica-cpus` entry, pinned there, publishing KV events; all
    stopped if one fails to start."""
    replicas = []
    for index, cpus in enumerate(args.replica_cpus):
        events, replay = free_port(), free_port()
        events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
                         "replay_endpoint": f"tcp://*:{replay}", "topic": ""}
        service = Service(serve_command(*replica_flags(args), "--kv-events-config", json.dumps(events_config)),
                          os.path.join(workdir, f"{tag}-replica{index}.log"), cpus=cpus,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, label=f"replica {index}")
        replicas.append(Replica(service, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"))
    try:
        for replica in replicas:
            replica.service.wait_healthy(show_log=True)
    except RuntimeError:
        for replica in replicas:
            replica.service.stop(grace_s=0)
        raise
    return replicas


def replica_flags(args: argparse.Namespace) -> list[str]:
    model = ["--model", args.model] if args.model else []
    return [*model, "--block-size", str(BLOCK_SIZE), "--max-model-len", str(args.max_model_len),
            "--metrics-compat", "vllm", *args.server_flags]


def smg_front_end(policy: str) -> Callable:
    @contextlib.contextmanager
    def front_end(args: argparse.Namespace, workdir: str, tag: str) -> Iterator[FrontEnd]:
        if smg_binary() is None:  # skipped before any replica starts
            raise PolicyUnavailable("SMG is not installed: pip install 'chunkserve[fleet]'")
        services = [r.service for r in start_replicas(args, workdir, tag)]
        try:
            command = smg_command("--worker-urls", *[s.url for s in services], "--policy", policy,
                                  metrics_port=free_port())
            with Service(command, os.path.join(workdir, f"{tag}-smg.log"), cpus=args.front_cpus,
                         label=f"smg {policy}") as smg:
                wait_smg_workers(smg.url, smg.popen, len(services), log_path=smg.log_path)
                yield FrontEnd(smg.url, services)
        finally:
            for service in services:
                service.stop(grace_s=0)
    return front_end


@contextlib.contextmanager
def event_driven(args: argparse.Namespace, workdir: str, tag: str) -> Iterator[FrontEnd]:
    """Dynamo's indexer following every replica, and benchmarks/fleet/event_router.py before them."""
    replicas = start_replicas(args, workdir, tag)
    indexer = None
    try:
        indexer = KVIndexer(os.path.join(workdir, f"{tag}-indexer.log"), BLOCK_SIZE, cpus=args.front_cpus)
        for index, replica in enumerate(replicas):
            indexer.register(index, replica.events, replica.replay)
        command = [sys.executable, "-m", "benchmarks.fleet.event_router", "--indexer", indexer.service.url,
                   "--block-size", str(BLOCK_SIZE), "--overlap-weight", str(args.overlap_weight),
                   *(["--model", args.model] if args.model else [])]
        for replica in replicas:
            command += ["--replica", replica.service.url]
        with Service(command, os.path.join(workdir, f"{tag}-router.log"), cpus=args.front_cpus, cwd=REPOSITORY,
                     label="event router") as router:
            router.wait_healthy(show_log=True)
            yield FrontEnd(router.url, [r.service for r in replicas])
    finally:
        if indexer is not None:
            indexer.stop()
        for replica in replicas:
            replica.service.stop(grace_s=0)


@contextlib.contextmanager
def ray_prefix_affinity(args: argparse.Namespace, workdir: str, tag: str) -> Iterator[FrontEnd]:
    """Ray Serve LLM's PrefixCacheAffinityRouter before chunkserve replicas on Ray Serve
    (chunkserve/entrypoints/ray_serve.py): a local cluster of one one-CPU node per
    `--replica-cpus` entry, each node's raylet started pinned there (its workers, the replicas,
    inherit the pinning), one replica per node. Serve's controller and HTTP proxy run on the
    nodes too, so they share the replicas' cores (SMG and the event router run beside them
    unpinned). The replicas' own /metrics are not reachable through Serve: requests per replica
    are not counted for this policy."""
    try:
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        from chunkserve.entrypoints.ray_serve import build_chunkserve_app
    except ImportError as error:
        raise PolicyUnavailable(f"Ray Serve is not installed: {error}") from None
    allowed = os.sched_getaffinity(0)
    cluster = Cluster()
    try:
        for index, cpus in enumerate(args.replica_cpus):
            os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split("-")})
            cluster.add_node(num_cpus=1, object_store_memory=RAY_OBJECT_STORE_BYTES,
                             **({"include_dashboard": False} if index == 0 else {}))
        os.sched_setaffinity(0, allowed)
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine_kwargs = {"block_size": BLOCK_SIZE, "max_model_len": args.max_model_len,
                         **({"model": args.model} if args.model else {})}
        serve.run(build_chunkserve_app({"engine_kwargs": engine_kwargs, "num_replicas": len(args.replica_cpus),
                                        "request_router": "prefix_cache_affinity"}), name="chunkserve",
                  route_prefix="/")
        yield FrontEnd(f"http://127.0.0.1:{port}", [])
    finally:
        os.sched_setaffinity(0, allowed)
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        cluster.shutdown()


POLICIES: dict[str, Callable] = {
    "smg-round-robin": smg_front_end("round_robin"),
    "smg-cache-aware": smg_front_end("cache_aware"),
    "event-driven": event_driven,
    "ray-prefix-affinity": ray_prefix_affinity,
}


# ----- one run --------------------------------------------------------------------------------

def workload(args: argparse.Namespace, seed: int, tokenizer: Any) -> list[RequestSpec]:
    """`chunkserve bench serve`'s multi-turn workload with this benchmark's shape, as text (SMG takes
    no token-id prompt, and its cache_aware policy reads text)."""
    shape = argparse.Namespace(workload="multi-turn", num_prompts=args.chats, turns=args.turns,
                               prefix_len=args.system_len, input_len=args.user_len, output_len=args.answer_len,
                               request_rate=args.rate, think_time=0.0)
    return text_workload(shape, seed, tokenizer)


def turn_numbers(specs: list[RequestSpec]) -> list[int]:
    """Each request's turn in its chat, from 1 (a later turn follows the one before it)."""
    turns: list[int] = []
    for spec in specs:
        turns.append(1 if spec.after is None else turns[spec.after] + 1)
    return turns


def later_turn_metrics(specs: list[RequestSpec], results: list) -> dict:
    """Over the turns >= 2 that completed: the history hit rate (the chat's own history, past the
    system prompt every replica soon caches), the prompt hit rate (system prompt included) and TTFT."""
    turns = turn_numbers(specs)
    later = [(spec, result) for spec, result, turn in zip(specs, results, turns) if turn >= 2 and result.ok]
    shared = shared_prefix_tokens(specs, turns) // BLOCK_SIZE * BLOCK_SIZE
    history = [len(specs[spec.after].prompt_token_ids) // BLOCK_SIZE * BLOCK_SIZE - shared for spec, _ in later]
    hits = [min(max((result.cached_tokens or 0) - shared, 0), own) for (_, result), own in zip(later, history)]
    prompt_tokens = sum(len(spec.prompt_token_ids) for spec, _ in later)
    return {"history_hit_rate": sum(hits) / sum(history) if sum(history) else None,
            "prompt_hit_rate": (sum(result.cached_tokens or 0 for _, result in later) / prompt_tokens
                                if prompt_tokens else None),
            "ttft_ms": ms_distribution(ttft(result) for _, result in later)}


def shared_prefix_tokens(specs: list[RequestSpec], turns: list[int]) -> int:
    """The tokens every chat's first turn starts with (the system prompt; 0 with one chat)."""
    firsts = [spec.prompt_token_ids for spec, turn in zip(specs, turns) if turn == 1]
    if len(firsts) < 2:
        return 0
    length = 0
    while all(len(first) > length and first[length] == firsts[0][length] for first in firsts):
        length += 1
    return length


def served(replicas: list[Service]) -> list[float]:
    return [replica.metrics().get(SUCCESS, 0.0) for replica in replicas]


def warm_up(replicas: list[Service], model: str) -> None:
    """One short request to each replica directly, so no run's first turn pays a replica's first
    request (its text shares no block with the workload's)."""
    for replica in replicas:
        httpx.post(f"{replica.url}/v1/completions", json={"model": model, "prompt": "warm up", "max_tokens": 2},
                   timeout=120).raise_for_status()


def model_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def measure(policy: str, seed: int, args: argparse.Namespace, workdir: str, tokenizer: Any) -> dict:
    """One policy on fresh replicas with one seed's workload."""
    specs = workload(args, seed, tokenizer)
    try:
        with POLICIES[policy](args, workdir, f"{policy}-{seed}") as front:
            model = model_name(front.replicas[0].url if front.replicas else front.url)
            warm_up(front.replicas, model)
            before = served(front.replicas)
            _, _, results = asyncio.run(run_requests(specs, front.url, model, None, None))
            after = served(front.replicas)
    except PolicyUnavailable as reason:
        return {"policy": policy, "seed": seed, "skipped": str(reason)}
    summary = summarize(results)
    return {"policy": policy, "seed": seed, **later_turn_metrics(specs, results),
            "output_tok_s": summary["output_token_throughput"], "completed": summary["completed"],
            "failed": summary["failed"], "requests_per_replica": [b - a for a, b in zip(before, after)],
            "errors": sorted({r.error for r in results if r.error})[:5]}


# ----- report ---------------------------------------------------------------------------------

def policy_summary(runs: list[dict]) -> dict:
    """A policy's runs over the seeds: medians, failures summed, replicas' shares kept per seed."""
    done = [run for run in runs if "skipped" not in run]
    if not done:
        return {"skipped": runs[0]["skipped"]}

    def median(pick: Callable[[dict], float | None]) -> float | None:
        values = [value for value in map(pick, done) if value is not None]
        return statistics.median(values) if values else None

    return {"history_hit_rate": median(lambda run: run["history_hit_rate"]),
            "prompt_hit_rate": median(lambda run: run["prompt_hit_rate"]),
            "ttft_p50_ms": median(lambda run: run["ttft_ms"]["p50"]),
            "ttft_p99_ms": median(lambda run: run["ttft_ms"]["p99"]),
            "output_tok_s": median(lambda run: run["output_tok_s"]),
            "requests_per_replica": [run["requests_per_replica"] for run in done],
            "failed": sum(run["failed"] for run in done), "seeds": len(done)}


def table(summaries: dict[str, dict]) -> str:
    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [("| policy | history hit rate (turns >= 2) | prompt hit rate (turns >= 2) | TTFT p50 / p99 ms "
              "(turns >= 2) | output tok/s | requests per replica | failed |"), "|---|---|---|---|---|---|---|"]
    for policy, summary in summaries.items():
        if "skipped" in summary:
            lines.append(f"| {policy} | skipped: {summary['skipped']} ||||||")
            continue
        shares = "; ".join("/".join(f"{n:.0f}" for n in seed) for seed in summary["requests_per_replica"]
                           if seed) or "not counted"
        lines.append(f"| {policy} | {number(summary['history_hit_rate'], 3)} | {number(summary['prompt_hit_rate'], 3)} "
                     f"| {number(summary['ttft_p50_ms'], 0)} / "
                     f"{number(summary['ttft_p99_ms'], 0)} | {number(summary['output_tok_s'], 1)} | {shares} | "
                     f"{summary['failed']} |")
    return "\n".join(lines)


def busiest_share(summary: dict) -> float:
    """The median over seeds of the busiest replica's share of requests; NaN (no bar) where the
    policy's replicas could not be counted (Ray Serve's)."""
    shares = [max(seed) / sum(seed) for seed in summary["requests_per_replica"] if seed and sum(seed)]
    return statistics.median(shares) if shares else float("nan")


def figure(summaries: dict[str, dict], path: str, host: dict) -> str:
    """Hit rate, TTFT p50 and the busiest replica's share of requests, one bar per policy; the
    title names the CPU (`host`: chunkserve.bench.host.machine()'s) and the commit."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = {policy: s for policy, s in summaries.items() if "skipped" not in s}
    panels = [("history hit rate, turns >= 2", lambda s: s["history_hit_rate"] or 0.0),
              ("TTFT p50 ms, turns >= 2", lambda s: s["ttft_p50_ms"] or 0.0),
              ("busiest replica's share of requests", busiest_share)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (title, pick) in zip(axes, panels):
        ax.bar(list(measured), [pick(s) for s in measured.values()], color="tab:blue")
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    bf16 = "AVX512_BF16" if "avx512_bf16" in host.get("avx512_flags", "") else "no AVX512_BF16"
    fig.suptitle(f"2 replicas x 1 core, medians of seeds; {host['cpu']} family {host['cpu_family']} model "
                 f"{host['cpu_model']}, {host['cpus']} CPUs, {'AVX-512' if host['avx512'] else 'AVX2'}, {bf16}; "
                 f"chunkserve {host['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----- command line ---------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", type=lambda text: text.split(","), default=list(POLICIES),
                        help=f"comma-separated, of {', '.join(POLICIES)}")
    parser.add_argument("--seeds", type=lambda text: [int(s) for s in text.split(",")], default=[0, 1, 2])
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-len", type=int, default=512, help="tokens of the system prompt every chat shares")
    parser.add_argument("--user-len", type=int, default=128, help="tokens of each user turn")
    parser.add_argument("--answer-len", type=int, default=64, help="tokens of each answer")
    parser.add_argument("--rate", type=float, default=0.5, help="new chats per second (Poisson)")
    parser.add_argument("--model", default=None, help="the replicas' model (default: chunkserve's default)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--server-flags", type=shlex.split, default=[],
                        help='more flags for every replica, as one string: "--max-num-batched-tokens 256"')
    parser.add_argument("--replica-cpus", type=lambda text: text.split(","), default=["0", "1"],
                        help="one CPU list per replica (taskset -c): its count is the number of replicas")
    parser.add_argument("--overlap-weight", type=float, default=1.0,
                        help="event-driven: blocks to prefill weighed against blocks in flight (event_router.py)")
    parser.add_argument("--front-cpus", default=None, help="CPUs of the routers and the indexer (default: any)")
    parser.add_argument("--out", default=None, help="the JSON result; the figure is written beside it (.png)")
    parser.add_argument("--smoke", action="store_true",
                        help="2 chats x 2 turns of short prompts, one seed: checks that every policy runs; "
                             "its numbers mean nothing")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the replicas' command; start nothing")
    args = parser.parse_args(argv)
    if unknown := set(args.policies) - set(POLICIES):
        parser.error(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    if args.smoke:
        vars(args).update(SMOKE, seeds=args.seeds[:1])
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"{len(args.policies)} policies x seeds {args.seeds}: {args.chats} chats x {args.turns} turns, system "
          f"{args.system_len}, user {args.user_len}, answer {args.answer_len} tokens, {args.rate} chats/s; "
          f"replicas on CPUs {args.replica_cpus}: {' '.join(serve_command(*replica_flags(args)))}", flush=True)
    if args.dry_run:
        return
    tokenizer = load_tokenizer(resolve_model(args.model))
    runs = []
    with tempfile.TemporaryDirectory(prefix="fleet-") as workdir:
        for seed in args.seeds:
            for policy in args.policies:  # the policies take turns within a seed: drift hits them alike
                runs.append(measure(policy, seed, args, workdir, tokenizer))
                print(f"{policy} seed {seed}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    summaries = {policy: policy_summary([run for run in runs if run["policy"] == policy]) for policy in args.policies}
    print(table(summaries))
    if args.out:
        host = machine()
        with open(args.out, "w") as out:
            json.dump({"machine": host, "config": {k: v for k, v in vars(args).items() if k != "out"},
                       "summary": summaries, "runs": runs}, out, indent=1)
        print(f"written: {args.out}, {figure(summaries, os.path.splitext(args.out)[0] + '.png', host)}")


if __name__ == "__main__":
    main()
