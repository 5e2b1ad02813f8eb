"""Tensor parallelism across processes and "nodes" through the real server: two
`chunkserve serve` commands on loopback (node 0 serving, node 1 --headless), the same through
torchrun, a worker rank killed mid-stream, and a clean shutdown that leaves no process and no
shared-memory segment. The model is a tiny random Llama (4 heads, 2 KV heads): TP 2 splits it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from chunkserve import LLM, SamplingParams
from tests.executor.support import tiny_llama
from tests.server_process import API_KEY, Server, free_port, port_is_free, start_server, wait_until_up

PROMPTS = ["The lighthouse keeper climbed", "Once upon a time", "Ships went by over the grey water and"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_tokenizer):
    return tiny_llama(tmp_path_factory.mktemp("tiny-tp"), default_tokenizer, 2)


@pytest.fixture(scope="module")
def expected(tiny_dir):
    """TP 1's greedy texts, offline."""
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def master_port() -> int:
    """A free port whose next one (the control socket) is free too."""
    while not port_is_free((port := free_port()) + 1):
        pass
    return port


def completions(server: Server) -> list[str]:
    with server.client() as http:
        body = {"prompt": PROMPTS, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return [choice["text"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])]


def processes() -> dict[int, tuple[int, list[str]]]:
    """Every live process: pid -> (parent pid, command line), from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        found[int(entry)] = (parent, argv)
    return found


def rank_pids(port: int) -> list[int]:
    """The worker rank processes whose control socket is on `port` + 1, in rank order."""
    control = f"tcp://127.0.0.1:{port + 1}"
    ranks = {}
    for pid, (_, argv) in processes().items():
        if "chunkserve.executor.rank_process" in argv and control in argv and not _zombie(pid):
            ranks[int(argv[argv.index("--rank") + 1])] = pid
    return [ranks[rank] for rank in sorted(ranks)]


def shm_segments() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if os.path.exists(f"/proc/{pid}") and not _zombie(pid)]
        time.sleep(0.1)
    return alive


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")
    except OSError:
        return True


def stop(server: Server, timeout_s: float = 60.0) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    return server.process.wait(timeout_s)


def test_two_nodes_on_loopback_equal_tp1_and_shut_down_clean(tmp_path_factory, tiny_dir, expected):
    port = master_port()
    before = shm_segments()
    nodes = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    head = start_server(tmp_path_factory, "--model", tiny_dir, "--num-kv-blocks", "64", "--node-rank", "0", *nodes,
                        name="node0", wait=False)
    log = tmp_path_factory.mktemp("node1") / "node1.log"
    with open(log, "w") as out:
        worker_node = subprocess.Popen([sys.executable, "-m", "chunkserve", "serve", "--headless", "--node-rank", "1",
                                        *nodes], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_up(head)
        assert len(rank_pids(port)) == 2
        assert completions(head) == expected
        metrics = head.metrics()
        assert metrics["chunkserve:comm_bytes_total{rank=1}"] > 0 and metrics["chunkserve:comm_ops_total{rank=0}"] > 0
        pids = rank_pids(port)
        assert stop(head) == 0
        assert worker_node.wait(30) == 0, open(log).read()
        assert wait_gone(pids, 10) == []
        assert shm_segments() <= before
    finally:
        for process in (head.process, worker_node):
            if process.poll() is None:
                process.kill()


@pytest.mark.slow  # the default tier starts two nodes with --headless
def test_two_nodes_through_torchrun_equal_tp1(tmp_path_factory, tiny_dir, expected):
    port, http_port = master_port(), free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    serve = ["-m", "chunkserve", "serve", "--model", tiny_dir, "--num-kv-blocks", "64", "-tp", "2",
             "--dtype", "float32",
             "--port", str(http_port), "--api-key", API_KEY]
    folder = tmp_path_factory.mktemp("torchrun")
    launched = []
    env = {**os.environ, "CHUNKSERVE_API_KEY": "", "CHUNKSERVE_ADMIN_API_KEY": ""}
    for node in (0, 1):
        with open(folder / f"node{node}.log", "w") as out:
            launched.append(subprocess.Popen([*torchrun, "--node-rank", str(node), *serve], stdout=out,
                                             stderr=subprocess.STDOUT, env=env))
    server = Server(launched[0], f"http://127.0.0.1:{http_port}", str(folder / "node0.log"))
    try:
        wait_until_up(server)
        assert completions(server) == expected
        pids = rank_pids(port)
        assert len(pids) == 2
        # torchrun's agent exits with an error on a signal of its own; a stopped server is a success
        node0_server = next(pid for pid, (parent, _) in processes().items() if parent == launched[0].pid)
        os.kill(node0_server, signal.SIGTERM)
        assert launched[0].wait(60) == 0, open(folder / "node0.log").read()
        assert launched[1].wait(60) == 0, open(folder / "node1.log").read()
        assert wait_gone(pids, 10) == []
    finally:
        for process in launched:
            if process.poll() is None:
                process.kill()


@pytest.mark.slow
def test_a_worker_killed_mid_stream_fails_its_requests_and_health_within_seconds(tmp_path_factory, tiny_dir):
    port = master_port()
    before = shm_segments()
    server = start_server(tmp_path_factory, "--model", tiny_dir, "--num-kv-blocks", "256", "-tp", "2",
                          "--master-port", str(port), name="killed")
    try:
        pids = rank_pids(port)
        assert len(pids) == 2
        body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0.0, "ignore_eos": True, "stream": True}
        events, ended = [], None
        start = time.monotonic()
        with server.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            try:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 5:
                            killed_at = time.monotonic()
                            os.kill(pids[1], signal.SIGKILL)
            except httpx.TransportError as error:  # the server may go before the stream's end is sent
                ended = error
        assert len(events) >= 5 and time.monotonic() - killed_at < 30
        finished = [e for e in events if e != "[DONE]" and '"finish_reason":"abort"' in e.replace(" ", "")]
        assert ended is not None or finished or any('"error"' in e for e in events), events[-3:]
        assert all('"finish_reason":"length"' not in e.replace(" ", "") for e in events), "the stream went on"
        deadline = time.monotonic() + 15
        healthy = True
        while healthy and time.monotonic() < deadline:
            try:
                healthy = httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                healthy = False
            time.sleep(0.2)
        assert not healthy, "/health still answered 200 after a worker died"
        assert server.process.wait(30) != 0
        assert wait_gone(pids, 10) == [], "a worker rank outlived the engine"
        assert shm_segments() <= before
        assert time.monotonic() - start < 60
    finally:
        if server.process.poll() is None:
            server.process.kill()


@pytest.mark.slow  # the default tier kills a worker mid-stream
def test_a_worker_killed_while_idle_fails_health_within_seconds(tmp_path_factory, tiny_dir):
    port = master_port()
    server = start_server(tmp_path_factory, "--model", tiny_dir, "--num-kv-blocks", "64", "-tp", "2",
                          "--master-port", str(port), name="idle-kill")
    try:
        pids = rank_pids(port)
        os.kill(pids[0], signal.SIGKILL)  # rank 0; nothing is running
        killed_at = time.monotonic()
        assert server.process.wait(30) != 0
        assert time.monotonic() - killed_at < 15, "the engine took too long to notice its dead worker"
        assert wait_gone(pids, 10) == []
        assert "worker rank 0" in open(server.log_path).read()
    finally:
        if server.process.poll() is None:
            server.process.kill()
