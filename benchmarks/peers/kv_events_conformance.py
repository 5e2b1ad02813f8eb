"""KV events conformance against vLLM 0.32 itself: chunkserve's messages decoded by vLLM's own
msgspec structs (`vllm.distributed.kv_events.KVEventBatch`, in the peers' vLLM venv), and vLLM's
messages decoded by the layout chunkserve's tests use (tests/kv_events_wire.py), so the tests'
decoder is the real one. The same workload goes to each server (a shared prefix, evictions from
a small chunkserve pool, a prefix-cache reset); a subscriber on loopback records the raw frames.
For chunkserve it also checks that the blocks the events leave a subscriber holding equal what
the server reports cached (GET /debug/kv_cache_blocks).

    .venv/bin/python -m benchmarks.peers.kv_events_conformance [--skip-vllm] [--out FILE]

`--smoke --model DIR`: chunkserve's half on that model, its messages decoded by the tests'
layout only (no vLLM needed): seconds.

vLLM: benchmarks/peers/setup.sh (hf, vllm), started by start_vllm.sh with VLLM_SERVER_DEV_MODE=1
(its /reset_prefix_cache). About 3 minutes, most of it vLLM's start.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import msgspec

from benchmarks.support import EventRecorder  # benchmarks/support.py
from chunkserve.bench.service import Service, free_port, serve_command
from tests.kv_events_wire import DECODER, index_of

PEERS_DIR = os.environ.get("PEERS_DIR", "/work/peers")
VLLM_PYTHON = os.path.join(PEERS_DIR, "vllm-venv", "bin", "python")
ADMIN_KEY = "conformance-admin"
SYSTEM = [1000 + (i * 37) % 5000 for i in range(96)]
VLLM_DECODE = """
import base64, json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
decoder = msgspec.msgpack.Decoder(KVEventBatch)
types, failures = {}, []
for line in open(sys.argv[1]):
    frame = json.loads(line)
    try:
        batch = decoder.decode(base64.b64decode(frame["payload"]))
    except Exception as error:
        failures.append(f"seq {frame['seq']}: {error}")
        continue
    for event in batch.events:
        types[type(event).__name__] = types.get(type(event).__name__, 0) + 1
print(json.dumps({"types": types, "failures": failures[:5], "num_failed": len(failures)}))
"""


def save_frames(frames: list[tuple[int, bytes]], path: str) -> str:
    """The frames as JSON lines (base64 payloads), for the vLLM venv's decoder to read."""
    with open(path, "w") as out:
        out.writelines(json.dumps({"seq": seq, "payload": base64.b64encode(payload).decode()}) + "\n"
                       for seq, payload in frames)
    return path


def drive(url: str, model: str, headers: dict[str, str], reset_path: str) -> None:
    """Prompts sharing a prefix, then unrelated long ones (evictions), then a prefix-cache reset."""
    prompts = [SYSTEM + [7000 + i] * (20 + 9 * i) for i in range(6)] + [[3000 + i] * 300 for i in range(4)]
    with httpx.Client(base_url=url, headers=headers, timeout=300) as client:
        for prompt in prompts:
            client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                 "temperature": 0}).raise_for_status()
        client.post(reset_path).raise_for_status()
        client.post("/v1/completions", json={"model": model, "prompt": prompts[0], "max_tokens": 8,
                                             "temperature": 0}).raise_for_status()


def settle(recorder: EventRecorder) -> None:
    """Wait until no frame arrives for a second (the server is idle after the last request)."""
    count = -1
    while count != len(recorder.frames):
        count = len(recorder.frames)
        time.sleep(1.0)


def decode_with_vllm(path: str) -> dict:
    result = subprocess.run([VLLM_PYTHON, "-c", VLLM_DECODE, path], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def decode_with_tests_layout(frames: list[tuple[int, bytes]]) -> dict:
    """Also the keys each event type carried on the wire (untyped decode), to compare the two servers'."""
    failures, keys = [], {}
    for seq, payload in frames:
        try:
            DECODER.decode(payload)
        except Exception as error:
            failures.append(f"seq {seq}: {error}")
        for event in msgspec.msgpack.decode(payload)[1]:
            keys.setdefault(event["type"], set()).update(event)
    return {"num_failed": len(failures), "failures": failures[:5],
            "keys": {kind: sorted(names) for kind, names in keys.items()}}


def chunkserve_run(folder: str, model_flags: list[str], with_vllm: bool) -> dict:
    """chunkserve's frames decoded by the tests' layout (`with_vllm`: and by vLLM's structs)."""
    port = free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
    with Service(serve_command(*model_flags, "--num-kv-blocks", "48", "--admin-api-key", ADMIN_KEY,
                               "--kv-events-config", json.dumps(config)),
                 os.path.join(folder, "chunkserve.log"), label="chunkserve") as server:
        server.wait_healthy()
        recorder = EventRecorder(f"tcp://127.0.0.1:{port}")
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        drive(server.url, model, headers, "/reset_prefix_cache")
        settle(recorder)
        cached = httpx.get(f"{server.url}/debug/kv_cache_blocks", headers=headers).json()
        frames = recorder.close()
    held = index_of([(seq, DECODER.decode(payload)) for seq, payload in frames])
    path = save_frames(frames, os.path.join(folder, "chunkserve-frames.jsonl"))
    return {"frames": len(frames), "vllm_structs": decode_with_vllm(path) if with_vllm else None,
            "tests_layout": decode_with_tests_layout(frames),
            "index_equals_cached_blocks": held.get("GPU", set()) == set(cached["blocks"]["GPU"])}


def vllm_run(folder: str) -> dict:
    port = free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    script = os.path.join(os.path.dirname(__file__), "start_vllm.sh")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    with Service([script, "{port}", "--kv-events-config", json.dumps(config)],
                 os.path.join(folder, "vllm.log"), env=env, label="vllm") as server:
        server.wait_healthy()
        recorder = EventRecorder(f"tcp://127.0.0.1:{port}")
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        drive(server.url, model, {}, "/reset_prefix_cache")
        settle(recorder)
        frames = recorder.close()
    path = save_frames(frames, os.path.join(folder, "vllm-frames.jsonl"))
    return {"frames": len(frames), "vllm_structs": decode_with_vllm(path),
            "tests_layout": decode_with_tests_layout(frames)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-vllm", action="store_true", help="only chunkserve's messages")
    parser.add_argument("--smoke", action="store_true",
                        help="chunkserve's messages, decoded by the tests' layout only (no vLLM needed)")
    parser.add_argument("--model", help="chunkserve's model (default: the default model)")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kv-events-") as folder:
        model_flags = ["--model", args.model, "--dtype", "float32"] if args.model else []
        result = {"chunkserve": chunkserve_run(folder, model_flags, with_vllm=not args.smoke)}
        if not (args.skip_vllm or args.smoke):
            result["vllm"] = vllm_run(folder)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=2)
    ok = all(run["frames"] > 0 and (run["vllm_structs"] or {"num_failed": 0})["num_failed"] == 0
             and run["tests_layout"]["num_failed"] == 0 for run in result.values())
    ok = ok and result["chunkserve"]["index_equals_cached_blocks"]
    print("conformance:", "ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
