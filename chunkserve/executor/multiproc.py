"""One worker process per rank (tensor x pipeline parallel), driven from the engine core.

The engine core holds a ZMQ ROUTER socket on node 0 (`--master-addr`, `--master-port` + 1);
every rank's process connects a DEALER to it, whether it was started here or by a `--headless`
node. Each step's scheduler output is pickled once and the same bytes go to every rank; every
rank answers each step (its compute and communication stats, or its error), and the last
stage's first tensor-parallel rank answers with the sampled tokens. Steps go out without
waiting for the ones before (`submit`), so a pipeline holds up to `pp` of them; their answers
come back in order.

torch.distributed (gloo) joins the ranks for the model's own traffic; its store listens on
--master-port, hosted here (or by torchrun's agent, when torchrun started this node).

Death monitor: a local worker that exits, or a rank whose connection drops (the one its
hello came on: a stray connection to the port is no rank), raises `EngineDeadError` from whatever
the engine is waiting on, and, while the engine is idle, a thread reports it through the
failure callback. With a pipeline, a rank that fails a step for any reason but the requests'
own data (which every rank finds before the forward) is fatal too: the stages would no longer
agree on which step a tensor belongs to. A clean shutdown waits for the local workers to exit
(killing any that do not) and leaves no process behind.

The control socket carries pickles: like torch.distributed's own ports, it must only be
reachable from the cluster's machines (a trusted network), never from clients."""

from __future__ import annotations

import logging
import pickle
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import zmq
from zmq.utils.monitor import recv_monitor_message

from chunkserve.config.engine import EngineArgs
from chunkserve.config.model import resolve_model
from chunkserve.core.messages import ModelRunnerOutput, SchedulerOutput
from chunkserve.errors import EngineDeadError, RequestFailedError
from chunkserve.executor.base import Executor, StepHandle
from chunkserve.config.parallel import under_torchrun
from chunkserve.executor.launch import SHUTDOWN_GRACE_S, spawn_rank_processes, stop_processes
from chunkserve.model.loader import load_model_config
from chunkserve.worker.worker import DIST_TIMEOUT

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often a wait looks at the workers' health
READY_TIMEOUT_S = 600.0  # every rank connected, within this long of start-up (remote nodes may start later)
PEER_ERROR_GRACE_S = 30.0  # after one rank failed a step, how long the others may take to answer it


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineArgs) -> None:
        self.config = config
        self.parallel = parallel = config.parallel_config()
        # refuse a split the model does not allow before any process starts
        self.model_config = load_model_config(resolve_model(config.model))
        parallel.check_model(self.model_config)
        self.world_size = parallel.world_size
        self._store = None
        if not under_torchrun():
            self._store = dist.TCPStore(parallel.master_addr, parallel.master_port, parallel.world_size,
                                        is_master=True, timeout=DIST_TIMEOUT, wait_for_workers=False)
        self._context = zmq.Context(io_threads=1)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a rank that is gone raises
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        # ZMQ binds an address, not a name (torchrun's MASTER_ADDR may be a host name)
        self._socket.bind(f"tcp://{socket.gethostbyname(parallel.master_addr)}:{parallel.control_port}")
        self._rank_fds: dict[int, int] = {}  # each rank's connection (its socket's file descriptor) -> rank
        self._identities: dict[int, bytes] = {}
        self._processes = {}
        self._replies: dict[tuple[str, int], dict[int, tuple[Any, BaseException | None]]] = defaultdict(dict)
        self._first_error_at: dict[tuple[str, int], float] = {}
        self._next_id = 0
        self._dead: EngineDeadError | None = None
        self._failure_callback: Callable[[BaseException], None] | None = None
        self._lock = threading.RLock()  # the sockets: the engine thread and the idle monitor
        self._busy = False
        self._closed = False
        try:
            self._processes = spawn_rank_processes(parallel, parallel.local_ranks, config.cpu_omp_threads_bind)
            self._await_ranks(pickle.dumps(config))
        except BaseException:
            self.shutdown()
            raise
        self._watcher = threading.Thread(target=self._watch_idle, name="chunkserve-worker-monitor", daemon=True)
        self._watcher.start()
        logger.info("%d worker ranks up (tensor_parallel_size %d, pipeline_parallel_size %d, %d node(s))",
                    self.world_size, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.nnodes)

    # ----- start-up -------------------------------------------------------------------

    def _await_ranks(self, config_bytes: bytes) -> None:
        """Wait for every rank's hello and hand it the engine's configuration; then every rank
        builds its worker (joining the process group) and says ready, or why it could not."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(self._identities) < self.world_size:
            self._check_health()
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(self._identities))
                raise EngineDeadError(f"worker ranks {missing} never connected to "
                                      f"{self.parallel.master_addr}:{self.parallel.control_port} (are the other "
                                      "nodes started, with the same --master-addr/--master-port?)")
            if not self._socket.poll(int(POLL_S * 1000)):
                continue
            identity, payload = self._socket.recv_multipart(copy=False)
            message = pickle.loads(payload.bytes)
            kind, rank = message[0], message[2 if message[0] == "ready" else 1]
            if kind == "ready" and message[4] is not None:  # a rank that could not build its worker
                raise message[4]
            if kind != "hello" or not 0 <= rank < self.world_size or rank in self._identities:
                logger.warning("ignored a control message %r from rank %r during start-up", kind, rank)
                continue
            self._identities[rank] = identity.bytes
            self._rank_fds[payload.get(zmq.SRCFD)] = rank
            self._socket.send_multipart([identity.bytes, config_bytes])
        self._wait("ready", 0)

    # ----- the executor interface -------------------------------------------------------

    def set_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        self._failure_callback = callback

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        call_id = self._new_id()
        self._broadcast(pickle.dumps(("rpc", call_id, method, args, kwargs or {})))
        replies = self._wait("rpc", call_id)
        return [replies[rank] for rank in range(self.world_size)]

    def submit(self, scheduler_output: SchedulerOutput) -> StepHandle:
        step_id = self._new_id()
        self._broadcast(pickle.dumps(("step", step_id, scheduler_output), protocol=pickle.HIGHEST_PROTOCOL))
        return _MultiprocStep(self, step_id)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(scheduler_output).result()

    def step_result(self, step_id: int) -> ModelRunnerOutput:
        replies = self._wait("step", step_id)
        output: ModelRunnerOutput = replies[self.parallel.output_rank]
        output.rank_stats = sorted((s for reply in replies.values() for s in reply.rank_stats), key=lambda s: s.rank)
        return output

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            try:
                grace = 0.0  # after a death the others may be stuck in a collective with the dead: no waiting
                if self._dead is None and self._identities:
                    try:
                        self._broadcast(pickle.dumps(("shutdown", 0)))
                        grace = SHUTDOWN_GRACE_S
                    except (zmq.ZMQError, EngineDeadError):
                        pass
            finally:
                stop_processes(self._processes, grace)
                self._monitor.close(linger=0)
                self._socket.close(linger=0)
                self._context.term()
                self._store = None

    # ----- messaging ----------------------------------------------------------------------

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _broadcast(self, payload: bytes) -> None:
        """The same bytes to every rank (one pickling per step)."""
        frame = zmq.Frame(payload)
        try:
            with self._lock:
                self._check_health()
                for identity in self._identities.values():  # (all of them, once start-up is done)
                    self._socket.send_multipart([identity, frame], copy=False)
        except zmq.ZMQError as error:  # ROUTER_MANDATORY: a rank's connection is gone
            raise self._die(f"a worker rank is unreachable ({error})") from None

    def _wait(self, kind: str, message_id: int) -> dict[int, Any]:
        """Every rank's answer to message `message_id`; raises the first rank's error, or
        EngineDeadError when a rank dies meanwhile (or, pipelined, fails a step by itself)."""
        key = (kind, message_id)
        self._busy = True
        try:
            while len(self._replies[key]) < self.world_size:
                errored = self._first_error_at.get(key)
                if errored is not None and time.monotonic() - errored > PEER_ERROR_GRACE_S:
                    failed = {r: e for r, (_, e) in self._replies[key].items() if e is not None}
                    raise self._die(f"worker rank(s) {sorted(failed)} failed ({next(iter(failed.values()))!r}) and "
                                    f"the others did not finish the same {kind} within {PEER_ERROR_GRACE_S:.0f} s")
                with self._lock:
                    self._check_health()
                    if not self._socket.poll(int(POLL_S * 1000)):
                        continue
                    _, payload = self._socket.recv_multipart()
                reply_kind, reply_id, rank, value, error = pickle.loads(payload)
                reply_key = (reply_kind, reply_id)
                self._replies[reply_key][rank] = (value, error)
                if error is not None:
                    self._first_error_at.setdefault(reply_key, time.monotonic())
                    if (reply_kind == "step" and self.parallel.pipeline_parallel_size > 1
                            and not isinstance(error, RequestFailedError)):
                        raise self._die(f"worker rank {rank} failed a pipelined step ({error!r}); the stages can no "
                                        "longer agree on which step a tensor belongs to")
        finally:
            self._busy = False
        replies = self._replies.pop(key)
        self._first_error_at.pop(key, None)
        for rank in sorted(replies):
            if replies[rank][1] is not None:
                raise replies[rank][1]
        return {rank: value for rank, (value, _) in replies.items()}

    # ----- health -----------------------------------------------------------------------------

    def _check_health(self) -> None:
        if self._dead is not None:
            raise self._dead
        for rank, process in self._processes.items():
            code = process.poll()
            if code is not None:
                raise self._die(f"worker rank {rank} (pid {process.pid}) exited with code {code}")
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            rank = self._rank_fds.get(event["value"])
            if rank is not None:  # (another connection to the port, a probe say, is no rank's)
                raise self._die(f"worker rank {rank}'s connection dropped: its process or node is gone")

    def _die(self, reason: str) -> EngineDeadError:
        if self._dead is None:
            logger.error("%s; the engine stops", reason)
            self._dead = EngineDeadError(reason)
        return self._dead

    def _watch_idle(self) -> None:
        """While the engine waits for work, nobody else looks at the workers: report a death
        through the failure callback within a second or so."""
        while not self._closed:
            time.sleep(0.5)
            if self._busy or self._closed or self._dead is not None:
                continue
            try:
                with self._lock:
                    if self._closed:
                        return
                    self._check_health()
            except EngineDeadError as error:
                if self._failure_callback is not None:
                    self._failure_callback(error)
                return


class _MultiprocStep(StepHandle):
    def __init__(self, executor: MultiprocExecutor, step_id: int) -> None:
        self._executor, self._step_id = executor, step_id

    def result(self) -> ModelRunnerOutput:
        return self._executor.step_result(self._step_id)
