"""A worker rank's process: connect to the engine's control socket, take the engine's
configuration, build the rank's `Worker` (joining torch.distributed), then answer calls and
steps until told to stop. Started by the multiprocess executor on node 0, and by
`chunkserve serve --headless` on the other nodes:

    python -m chunkserve.executor.rank_process --rank R --control tcp://HOST:PORT

A watchdog thread ends the process when the engine's connection drops (the engine is gone)
or, with --parent-pid, when the process that started it is gone, even while the rank is stuck
in a collective with a dead peer: no rank outlives its engine. (Not PR_SET_PDEATHSIG: that
fires when the *thread* that started the process exits, and an offline `LLM` may be built on a
thread that ends before it.)"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import sys
import threading

import zmq
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger("chunkserve.rank")

WATCHDOG_POLL_MS = 1000


def _watchdog(rank: int, monitor: zmq.Socket, parent_pid: int | None) -> None:
    """Owns the monitor socket (ZMQ sockets are not shared between threads)."""
    connected = False
    while True:
        if monitor.poll(WATCHDOG_POLL_MS):
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_CONNECTED:
                connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED and connected:
                logger.error("rank %d: the engine's connection dropped; exiting", rank)
                os._exit(1)
        if parent_pid is not None and os.getppid() != parent_pid:
            logger.error("rank %d: the process that started it is gone; exiting", rank)
            os._exit(1)


def serve_rank(rank: int, control: str, parent_pid: int | None = None) -> int:
    context = zmq.Context(io_threads=1)
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, f"rank-{rank}".encode())
    socket.setsockopt(zmq.LINGER, 1000)
    socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    socket.connect(control)
    threading.Thread(target=_watchdog, args=(rank, monitor, parent_pid), name="chunkserve-rank-watchdog",
                     daemon=True).start()
    socket.send(pickle.dumps(("hello", rank)))
    worker = None
    try:
        while True:
            message = pickle.loads(socket.recv())
            if worker is None:  # the first message is the engine's configuration
                worker, error = _build_worker(message, rank)
                socket.send(pickle.dumps(("ready", 0, rank, None, error)))
                if error is not None:
                    return 1
                continue
            kind, message_id = message[:2]
            if kind == "shutdown":
                worker.shutdown()
                return 0
            value, error = None, None
            try:
                if kind == "step":
                    value = worker.execute_model(message[2])
                else:
                    _, _, method, args, kwargs = message
                    value = getattr(worker, method)(*args, **kwargs)
            except Exception as caught:
                error = _picklable(caught)
            socket.send(pickle.dumps((kind, message_id, rank, value, error), protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        socket.close()  # (the watchdog's monitor socket goes with the process)


def _build_worker(config, rank: int):
    from chunkserve.worker.worker import Worker

    try:
        return Worker(config, rank=rank), None
    except Exception as error:
        logger.exception("rank %d could not start", rank)
        return None, _picklable(error)


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(repr(error))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--control", required=True, help="the engine's control socket, tcp://HOST:PORT")
    parser.add_argument("--parent-pid", type=int, help="exit when this process (the starter) is gone")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the engine decides
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{args.rank} %(name)s: %(message)s")
    sys.exit(serve_rank(args.rank, args.control, args.parent_pid))


if __name__ == "__main__":
    main()
