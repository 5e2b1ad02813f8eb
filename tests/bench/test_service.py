"""The server harness (chunkserve/bench/service.py) on a stand-in server: a few lines of Python
that answer /health and start a child, as `chunkserve serve` starts its engine core."""

from __future__ import annotations

import os
import sys
import time

import httpx
import pytest

from chunkserve.bench.service import Service, free_port, port_is_free

# argv: the file for the child's pid, "stubborn" to ignore SIGTERM (else "-"), then the port alone or `--port N`
FAKE_SERVER = """
import http.server, signal, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1] if "--port" in sys.argv else sys.argv[3])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
if sys.argv[2] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def child_pid(path) -> int:
    deadline = time.monotonic() + 10
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return int(path.read_text())


@pytest.mark.parametrize("stubborn", [False, True], ids=["graceful", "ignores SIGTERM"])
def test_a_stop_ends_the_server_and_its_children(tmp_path, stubborn):
    pid_file = tmp_path / "child.pid"
    service = Service([sys.executable, "-c", FAKE_SERVER, str(pid_file), "stubborn" if stubborn else "-"],
                      str(tmp_path / "server.log"))
    assert service.command[-2:] == ["--port", str(service.port)]  # appended: no {port} in the command
    assert service.wait_healthy(timeout_s=30) >= 0
    assert httpx.get(f"{service.url}/health").status_code == 200
    child = child_pid(pid_file)
    assert alive(child)
    started = time.monotonic()
    service.stop(grace_s=1, wait_port=True)
    assert time.monotonic() - started < 30
    assert service.popen.returncode == (-9 if stubborn else 0)  # SIGKILL once the grace ran out
    deadline = time.monotonic() + 10
    while alive(child):  # the group's stop reached the child too (reaped by init)
        assert time.monotonic() < deadline, "the child outlived its server"
        time.sleep(0.05)
    assert port_is_free(service.port)


def test_a_port_placeholder_is_filled_instead_of_a_flag(tmp_path):
    port = free_port()
    with Service([sys.executable, "-c", FAKE_SERVER, str(tmp_path / "child.pid"), "-", "{port}"],
                 str(tmp_path / "server.log"), port=port, label="fake", hide=[str(port)]) as service:
        assert service.command[-1] == str(port) and "--port" not in service.command
        service.wait_healthy(timeout_s=30)
    assert service.popen.returncode == 0
    log = (tmp_path / "server.log").read_text()
    assert log.startswith("\n===== fake: ") and "child.pid - ***\n" in log and "serving" in log  # the secret hidden


def test_a_server_that_exits_while_starting_fails_with_its_log(tmp_path):
    log_path = tmp_path / "server.log"
    service = Service([sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"], str(log_path))
    with pytest.raises(RuntimeError, match=f"exited with 3 while starting; see {log_path}"):
        service.wait_healthy(timeout_s=30)
    with pytest.raises(RuntimeError, match="(?s)exited with 3 .*no model here"):
        service.wait_healthy(timeout_s=30, show_log=True)
    service.stop()
    assert not os.path.exists(f"/proc/{service.popen.pid}")
