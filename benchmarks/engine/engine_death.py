"""How fast a server notices its engine core died, and what it does next.

Starts `chunkserve serve` (the flags after `--` go to it), runs a streaming request, kills the
engine-core process with SIGKILL (as the OOM killer would) and times what follows: the
stream's error event, and then either the server's exit (its code should be 1, so a
supervisor restarts it) or, with `--restart-engine-on-failure`, /health answering 503 and
the first completed request of the new engine core. Each mode runs `--repeat` times;
the table gives the median and the worst.

    .venv/bin/python -m benchmarks.engine.engine_death --repeat 3
    .venv/bin/python -m benchmarks.engine.engine_death --repeat 3 -- --restart-engine-on-failure
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable

import httpx

from chunkserve.bench.service import Service, free_port

API_KEY = "engine-death"
START_TIMEOUT_S = 600


def engine_pid(server_pid: int) -> int:
    """The server's child that runs the engine core (a multiprocessing spawn)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline") as f:
                command = f.read()
        except OSError:
            continue
        if parent == server_pid and "spawn_main" in command:
            return int(entry)
    raise RuntimeError("no engine-core process found")


def start_stream(url: str, headers: dict[str, str]) -> threading.Event:
    """A long streaming completion in a thread, returned once its first line arrived (or after 60 s);
    the event is set when the stream reports an error or breaks."""
    error_event = threading.Event()
    streaming = threading.Event()

    def stream() -> None:
        body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as response:
                for line in response.iter_lines():
                    streaming.set()
                    if '"error"' in line:
                        error_event.set()
        except httpx.TransportError:
            error_event.set()

    threading.Thread(target=stream, daemon=True).start()
    streaming.wait(60)
    return error_event


def health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code
    except httpx.TransportError:
        return None


def serves(url: str, headers: dict[str, str]) -> bool:
    try:
        return httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers,
                          timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def poll_until_each_held(conditions: dict[str, Callable[[], bool]], since: float,
                         held: dict[str, float | int | None]) -> None:
    """Polls the conditions together, in order, until each has held once or 300 s passed; records
    in `held` the seconds from `since` to each one's first time."""
    while len(held) < len(conditions) and time.monotonic() - since < 300:
        for name, condition in conditions.items():
            if name not in held and condition():
                held[name] = time.monotonic() - since
        time.sleep(0.01)


def run_once(server_flags: list[str], log_dir: str) -> dict[str, float | int | None]:
    port = free_port()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    service = Service([sys.executable, "-m", "chunkserve.entrypoints.cli", "serve", "--api-key", API_KEY,
                       *server_flags], os.path.join(log_dir, f"server-{port}.log"), port=port, log_mode="w",
                      start_timeout_s=START_TIMEOUT_S)
    url, server = service.url, service.popen
    try:
        service.wait_healthy()
        error_event = start_stream(url, headers)
        killed = time.monotonic()
        os.kill(engine_pid(server.pid), signal.SIGKILL)
        restarting = "--restart-engine-on-failure" in server_flags
        # what is timed from the kill (a server that exits never answers 503)
        conditions = {"stream_error_s": error_event.is_set}
        if restarting:
            conditions["health_503_s"] = lambda: health(url) == 503
            conditions["serving_again_s"] = lambda: "health_503_s" in result and serves(url, headers)
        else:
            conditions["exit_s"] = lambda: server.poll() is not None
        result: dict[str, float | int | None] = {}
        poll_until_each_held(conditions, killed, result)
        result = {name: result.get(name) for name in conditions}
        if not restarting:
            result["exit_code"] = server.poll()
        return result
    finally:
        service.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("server_flags", nargs="*", help="flags for `chunkserve serve` (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        runs = [run_once(args.server_flags, log_dir) for _ in range(args.repeat)]
    print(f"chunkserve serve {' '.join(args.server_flags)}: engine core killed with SIGKILL, {args.repeat} runs")
    print(f"{'measure':<18} {'median':>8} {'worst':>8}")
    for name in runs[0]:
        values = [r[name] for r in runs]
        if name == "exit_code":
            print(f"{name:<18} {' '.join(str(v) for v in values):>17}")
        elif None in values:
            print(f"{name:<18} {'never':>8} (in {values.count(None)} of {len(values)} runs)")
        else:
            print(f"{name:<18} {statistics.median(values):>7.2f}s {max(values):>7.2f}s")


if __name__ == "__main__":
    main()
