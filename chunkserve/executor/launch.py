"""Starting and stopping a node's worker rank processes, on node 0 (for the multiprocess
executor) and on the others (`chunkserve serve --headless`)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

from chunkserve.config.engine import EngineArgs
from chunkserve.config.parallel import ParallelConfig
from chunkserve.executor.cpu_threads import plan_threads, thread_environment
from chunkserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

POLL_S = 0.1
SHUTDOWN_GRACE_S = 10.0


def spawn_rank_processes(parallel: ParallelConfig, ranks: range, threads_bind: str) -> dict[int, subprocess.Popen]:
    """Start the worker processes of `ranks` on this node; each exits when this process is gone.
    Each rank gets its share of the CPUs (or its own list of `threads_bind`), so the ranks'
    OpenMP teams do not fight over them."""
    endpoint = f"tcp://{parallel.master_addr}:{parallel.control_port}"
    processes = {}
    for index, rank in enumerate(ranks):
        plan = plan_threads(threads_bind, index, len(ranks))
        env = thread_environment(plan, os.environ)
        logger.info("rank %d compute threads: %s", rank, plan.summary(env))
        processes[rank] = subprocess.Popen(
            [sys.executable, "-m", "chunkserve.executor.rank_process", "--rank", str(rank), "--control", endpoint,
             "--parent-pid", str(os.getpid())], env=env)
    return processes


def stop_processes(processes: dict[int, subprocess.Popen], grace_s: float) -> None:
    """Wait up to `grace_s` for the processes to exit, then kill the rest."""
    deadline = time.monotonic() + grace_s
    for process in processes.values():
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_headless(config: EngineArgs) -> int:
    """A node that only runs workers (`chunkserve serve --headless`): start this node's ranks,
    which connect to node 0's engine, and wait until they exit (the engine shut them down or
    went away). SIGINT/SIGTERM stop them. Returns the exit code. (An engine restarted after a
    failure finds no ranks here: restart the headless nodes with it.)"""
    parallel = config.parallel_config()
    if parallel.node_rank == 0:
        raise InvalidRequestError("--headless runs a node other than node 0 (which runs the engine): give "
                                  "--node-rank 1 or more, with --nnodes")
    processes = spawn_rank_processes(parallel, parallel.local_ranks, config.cpu_omp_threads_bind)
    logger.info("node %d of %d: ranks %s started; engine at %s:%d", parallel.node_rank, parallel.nnodes,
                list(parallel.local_ranks), parallel.master_addr, parallel.control_port)
    stopping = threading.Event()
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda *_: stopping.set())
    while not stopping.is_set() and all(p.poll() is None for p in processes.values()):
        stopping.wait(POLL_S)
    codes = {rank: p.poll() for rank, p in processes.items()}
    for process in processes.values():
        if process.poll() is None:
            process.terminate()
    stop_processes(processes, SHUTDOWN_GRACE_S)
    failed = {rank: code for rank, code in codes.items() if code not in (None, 0)}
    if failed:
        logger.error("worker ranks exited with codes %s", failed)
    return 1 if failed else 0
