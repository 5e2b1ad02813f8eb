"""`chunkserve serve`: the OpenAI-compatible server; `chunkserve generate "PROMPT"`: one answer."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import sys

from chunkserve.config.engine import EngineArgs
from chunkserve.entrypoints.args import ServerArgs, add_cli_args, from_cli_args
from chunkserve.entrypoints.router.args import add_arguments as add_router_arguments
from chunkserve.errors import InvalidRequestError, ModelLoadError

BENCH_COMMANDS = {
    "serve": "load a server with a workload; latency percentiles, throughput, goodput",
    "plot": "figures from bench results and step traces",
    "sweep": "run server configurations through the same workloads; one summary table",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chunkserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate an answer to one prompt")
    generate.add_argument("prompt", help="the prompt (the chat template is applied unless --raw)")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_cli_args(EngineArgs, generate)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_cli_args(ServerArgs, serve)
    add_cli_args(EngineArgs, serve)
    router = commands.add_parser("router", help="balance requests over prefill and decode servers (PD disaggregation)")
    add_router_arguments(router)
    bench = commands.add_parser("bench", help="benchmark OpenAI-compatible servers, plot and sweep")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    for name, text in BENCH_COMMANDS.items():
        module = importlib.import_module(f"chunkserve.bench.{name}")
        command = bench_commands.add_parser(name, help=text, description=module.__doc__.split("\n", 1)[0])
        module.add_arguments(command)
        command.set_defaults(bench_main=module.main)
    return parser


def _generate(args: argparse.Namespace) -> None:
    from chunkserve.entrypoints.llm import LLM
    from chunkserve.sampling_params import SamplingParams

    params = SamplingParams(  # before the model loads, so a bad flag fails at once
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
    )
    llm = LLM(**vars(from_cli_args(EngineArgs, args)))
    has_template = bool(getattr(llm.get_tokenizer(), "chat_template", None))
    if args.raw or not has_template:
        output = llm.generate(args.prompt, params, use_tqdm=False)[0]
    else:
        output = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    print(output.outputs[0].text)


def apply_torchrun_env(engine_args: EngineArgs, server_args: ServerArgs) -> tuple[EngineArgs, ServerArgs]:
    """Under torchrun, each of its processes is one node (`--nproc-per-node 1`): its group rank is
    the node rank, the group count --nnodes, MASTER_ADDR/MASTER_PORT the store torchrun's agent
    hosts; node 0 serves, the others run headless. Outside torchrun, the flags as given."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env:
        return engine_args, server_args
    if int(env.get("LOCAL_WORLD_SIZE", "1")) != 1:
        raise InvalidRequestError("under torchrun, start one chunkserve process per node (--nproc-per-node 1): it "
                                  "starts the node's worker ranks itself")
    node_rank = int(env.get("GROUP_RANK", env["RANK"]))
    engine_args = dataclasses.replace(
        engine_args, nnodes=int(env.get("GROUP_WORLD_SIZE", env["WORLD_SIZE"])), node_rank=node_rank,
        master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]),
    )
    return engine_args, dataclasses.replace(server_args, headless=node_rank != 0)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            _generate(args)
        elif args.command == "serve":
            engine_args, server_args = apply_torchrun_env(from_cli_args(EngineArgs, args),
                                                          from_cli_args(ServerArgs, args))
            if server_args.headless:
                from chunkserve.executor.launch import run_headless

                sys.exit(run_headless(engine_args))
            from chunkserve.entrypoints.server.app import run_server

            run_server(engine_args, server_args)
        elif args.command == "router":
            from chunkserve.entrypoints.router.app import main as router_main

            router_main(args)
        elif args.command == "bench":
            logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request
            args.bench_main(args)
    except (InvalidRequestError, ModelLoadError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
