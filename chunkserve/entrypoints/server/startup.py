"""What `chunkserve serve` does before it loads the frontend (`app.run_server`): bind the port,
so that a port in use is an error before anything loads, and start the engine-core process, so
that the process loads torch and the model while this one loads the frontend and the tokenizer
(one after the other, the two took the sum of both). Nothing here imports torch."""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass

from chunkserve.config.engine import EngineArgs
from chunkserve.engine.core_process import EngineProcess, start_engine_process
from chunkserve.entrypoints.args import ServerArgs
from chunkserve.errors import InvalidRequestError


@dataclass
class Startup:
    engine_args: EngineArgs  # as the engine got them
    server_args: ServerArgs
    listener: socket.socket  # bound, not yet listened on
    engine: EngineProcess | None  # None: the engine runs in the server's process (--disable-frontend-multiprocessing)

    def abandon(self) -> None:
        """For a start that fails before the server runs."""
        self.listener.close()
        if self.engine is not None:
            self.engine.kill()


def begin_serving(engine_args: EngineArgs, server_args: ServerArgs) -> Startup:
    """The bound port and the started engine process (none under --disable-frontend-multiprocessing);
    raises, having closed what it opened, if either fails."""
    if engine_args.disaggregation_mode == "prefill":  # the bootstrap port listens where the server does
        engine_args = dataclasses.replace(engine_args, disaggregation_bootstrap_host=server_args.host)
    listener = bind_socket(server_args.host, server_args.port)
    engine = None
    if not server_args.disable_frontend_multiprocessing:
        try:
            engine = start_engine_process(engine_args, server_args.max_waiting_requests)
        except BaseException:
            listener.close()
            raise
    return Startup(engine_args, server_args, listener, engine)


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now: a port in use is an error before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise InvalidRequestError(f"cannot listen on {host}:{port}: {error.strerror} (is another server running "
                                  f"there? choose another --port)") from None
    return sock
