"""`--cpu-omp-threads-bind` (vLLM's VLLM_CPU_OMP_THREADS_BIND) through a real server: the engine
process it starts runs one pinned thread on each CPU of the list, and serves."""

from __future__ import annotations

from chunkserve.executor.cpu_threads import allowed_cpus, format_cpu_list
from tests.server_process import start_server, stop_server
from tests.tiny_model import tiny_server_flags


def test_a_list_of_every_allowed_cpu_pins_one_engine_thread_to_each(tmp_path_factory, tiny_gguf):
    cpus = allowed_cpus()
    bind = format_cpu_list(cpus)
    server = start_server(tmp_path_factory, *tiny_server_flags(tiny_gguf), "--cpu-omp-threads-bind", bind,
                          name="bound", env={"OMP_NUM_THREADS": str(len(cpus))})  # agrees with the list
    try:
        with server.client() as client:
            threads = client.get("/get_server_info").json()["cpu_threads"]
            answer = client.post("/v1/completions", json={"prompt": "Count to three:", "max_tokens": 4})
        assert (threads["threads"], threads["cpus"], threads["pinned"]) == (len(cpus), bind, True)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    finally:
        stop_server(server)
