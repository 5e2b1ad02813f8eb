"""`chunkserve serve [MODEL]`: the OpenAI-compatible server; `chunkserve generate "PROMPT"`: one answer.

`serve` takes vLLM's launch commands as they are: the model positional or `--model`, vLLM's
and SGLang's spellings of our flags (config/engine.py, args.py), their flags with no meaning
here (foreign_flags.py: a note, or a refusal naming the alternative), and `--config FILE.yaml`
(its keys are flags; the command line wins)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import sys

from chunkserve.bench.datasets import DatasetError
from chunkserve.config.engine import EngineArgs
from chunkserve.entrypoints import sim_cli
from chunkserve.entrypoints.args import ServerArgs, add_cli_args, from_cli_args
from chunkserve.entrypoints.foreign_flags import add_foreign_flags, check_foreign_flags
from chunkserve.entrypoints.router.args import add_arguments as add_router_arguments
from chunkserve.errors import InvalidRequestError, ModelLoadError
from chunkserve.version import VERSION

BENCH_COMMANDS = {  # name: (module, help)
    "serve": ("chunkserve.bench.serve", "load a server with a workload; latency percentiles, throughput, goodput"),
    "throughput": ("chunkserve.entrypoints.bench_throughput",
                   "offline throughput of the engine, as vllm bench throughput: requests/s, tokens/s"),
    "plot": ("chunkserve.bench.plot", "figures from bench results and step traces"),
    "sweep": ("chunkserve.bench.sweep", "run server configurations through the same workloads; one summary table"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chunkserve", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--version", action="version", version=f"chunkserve {VERSION}")
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
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as --model (vLLM's form)")
    serve.add_argument("--config", metavar="FILE.yaml",
                       help="flags from a YAML file, one key per flag (tensor-parallel-size: 2); the command line wins")
    add_cli_args(ServerArgs, serve)
    add_cli_args(EngineArgs, serve)
    add_foreign_flags(serve)
    router = commands.add_parser(
        "router", help="pair requests over prefill and decode servers (PD disaggregation; SMG's `smg launch "
                       "--pd-disaggregation` does too, with more policies: README, \"Serving a fleet\")")
    add_router_arguments(router)
    sim = commands.add_parser("sim", help="simulate serving a workload: the real scheduler on a simulated clock",
                              description=sim_cli.__doc__.split("\n", 1)[0])
    sim_cli.add_sim_arguments(sim)
    profile = commands.add_parser("profile", help="fit the step-time profile `chunkserve sim` runs on")
    sim_cli.add_profile_arguments(profile)
    bench = commands.add_parser("bench", help="benchmark OpenAI-compatible servers, plot and sweep")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    for name, (module_name, text) in BENCH_COMMANDS.items():
        module = importlib.import_module(module_name)
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


_BOOL_FIELDS = {f.name for cls in (EngineArgs, ServerArgs) for f in dataclasses.fields(cls) if f.type == "bool"}


def expand_config_file(argv: list[str]) -> list[str]:
    """`serve ... --config FILE.yaml`: the file's keys become flags placed before the command
    line's own (so these win), as vLLM's --config: `key: value`, `switch: true`, `key: [a, b]`."""
    if "serve" not in argv:
        return argv
    for index, item in enumerate(argv):
        if item == "--config" or item.startswith("--config="):
            path = item.split("=", 1)[1] if "=" in item else (argv[index + 1] if index + 1 < len(argv) else "")
            rest = argv[:index] + argv[index + (1 if "=" in item else 2):]
            break
    else:
        return argv
    import yaml

    try:
        with open(path) as file:
            config = yaml.safe_load(file) or {}
    except (OSError, yaml.YAMLError) as error:
        raise InvalidRequestError(f"--config {path!r} could not be read: {error}") from None
    if not isinstance(config, dict):
        raise InvalidRequestError(f"--config {path!r} must hold a mapping of flag names to values")
    flags: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:  # off: our switches have a --no- form; a foreign switch off is not given
            if str(key).replace("-", "_") in _BOOL_FIELDS:
                flags.append("--no-" + flag[2:])
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    at = rest.index("serve") + 1
    return rest[:at] + flags + rest[at:]


def _serve_args(args: argparse.Namespace) -> tuple[EngineArgs, ServerArgs]:
    check_foreign_flags(args)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise InvalidRequestError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    return from_cli_args(EngineArgs, args), from_cli_args(ServerArgs, args)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = build_parser().parse_args(expand_config_file(sys.argv[1:] if argv is None else list(argv)))
        if args.command == "generate":
            _generate(args)
        elif args.command == "serve":
            engine_args, server_args = apply_torchrun_env(*_serve_args(args))
            if server_args.headless:
                from chunkserve.executor.launch import run_headless

                sys.exit(run_headless(engine_args))
            from chunkserve.entrypoints.server.startup import begin_serving

            startup = begin_serving(engine_args, server_args)  # the engine process loads while the frontend does
            try:
                from chunkserve.entrypoints.server.app import run_server
            except BaseException:
                startup.abandon()
                raise
            run_server(startup)
        elif args.command == "router":
            from chunkserve.entrypoints.router.app import main as router_main

            router_main(args)
        elif args.command == "sim":
            sim_cli.sim_main(args)
        elif args.command == "profile":
            sim_cli.profile_main(args)
        elif args.command == "bench":
            logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request
            try:
                args.bench_main(args)
            except DatasetError as error:
                raise InvalidRequestError(str(error)) from None
    except (InvalidRequestError, ModelLoadError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
