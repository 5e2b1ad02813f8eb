"""/dashboard: its screenshot during Scenario B, and what live viewers cost the engine.

- `--screenshot PNG`: a server on the model (default: SmolLM2), eight decode streams, then a
  2,048-token prompt arriving among them; a headless Chromium (chunkserve/bench/browser.py,
  Debian's `chromium`) shows /dashboard while the prompt's chunks run beside the decodes, and
  saves the page once the prompt is half computed (README's screenshot).
- `--cost`: one server with an admin key, eight streams decoding; rounds alternate between no
  viewer and three viewers reading /dashboard/events (each a client reading every event), and
  compare the engine's decode-8 step times (from /debug/steps: that round's decode-only steps with
  the most rows, 8 once every stream runs) and the
  streams' TBT. Numbers are medians per round; the spread between rounds of the same kind is the
  host's noise, against which the viewers' cost is read.

    .venv/bin/python -m benchmarks.engine.dashboard --screenshot docs/img/dashboard.png
    .venv/bin/python -m benchmarks.engine.dashboard --cost --rounds 3
    .venv/bin/python -m benchmarks.engine.dashboard --dry-run --cost --screenshot x.png   # the plan, nothing started

(the live view itself is tested against a server in tests/entrypoints/server/test_dashboard.py)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import tempfile
import threading
import time

import httpx
import numpy as np

from benchmarks.support import add_model_flag
from chunkserve.bench.browser import Browser, chromium_path
from chunkserve.bench.host import machine
from chunkserve.bench.service import Service, serve_command

ADMIN_KEY = "dashboard-bench-admin"
STREAMS = 8


def start_server(args: argparse.Namespace, *flags: str) -> Service:
    model = ["--model", args.model] if args.model else []
    log = os.path.join(args.workdir, "server.log")
    server = Service(serve_command(*model, "--admin-api-key", ADMIN_KEY, "--max-num-batched-tokens",
                                   str(args.budget), *flags), log, label="dashboard bench")
    server.wait_healthy()
    return server


def complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion; its token arrival times."""
    times = []
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())
    return {"token_times": times}


def prompt(length: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(1000, 40000, size=length)]


# ----- the screenshot ---------------------------------------------------------------------------------------------

def screenshot(args: argparse.Namespace) -> None:
    server = start_server(args, "--dashboard-without-auth")
    try:
        with Browser.start(width=1400, height=1150) as browser, \
                concurrent.futures.ThreadPoolExecutor(STREAMS + 1) as pool:
            browser.open(server.url + "/dashboard")
            browser.send("Runtime.evaluate", {"expression": "document.getElementById('window').value = '30';"
                                              "document.getElementById('window').dispatchEvent(new Event('change'))"})
            browser.wait_for("document.getElementById('status').textContent === 'live'")
            streams = [pool.submit(complete, server.url, prompt(64, seed), args.stream_tokens) for seed in range(STREAMS)]
            browser.wait_for("+document.getElementById('running').textContent >= 8", timeout_s=120)
            time.sleep(args.lead_s)  # (a few seconds of decode-only steps before the prompt, for the picture)
            long = pool.submit(complete, server.url, prompt(args.long_len, 99), 16)
            half = args.long_len // 2
            browser.wait_for(f"[...document.querySelectorAll('tr.request')].some(r => r.dataset.promptLen == "
                             f"'{args.long_len}' && +r.dataset.computed >= {half})", timeout_s=300)
            browser.wait_for("document.querySelectorAll('g.step.mixed').length >= 3", timeout_s=60)
            path = browser.screenshot(args.screenshot)
            errors = list(browser.errors)
            long.result()
            for stream in streams:
                stream.result()
        print(f"screenshot: {path}; page errors: {errors or 'none'}")
    finally:
        server.stop()


# ----- the viewers' cost -----------------------------------------------------------------------------------------

def viewer(url: str, stop: threading.Event, counts: list[int]) -> None:
    """Read /dashboard/events until `stop`, counting events (a browser's fetch reads them alike)."""
    with httpx.stream("GET", url + "/dashboard/events", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                counts.append(len(line))
            if stop.is_set():
                return


def cost_round(server: Service, viewers: int, args: argparse.Namespace, seed: int) -> dict:
    stop, counts = threading.Event(), []
    threads = [threading.Thread(target=viewer, args=(server.url, stop, counts), daemon=True) for _ in range(viewers)]
    for thread in threads:
        thread.start()
    last_step = max((s["step_id"] for s in server.steps(ADMIN_KEY, last=1)), default=-1)
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        answers = list(pool.map(lambda s: complete(server.url, prompt(32, seed * 100 + s), args.stream_tokens),
                                range(STREAMS)))
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    decoding = [s for s in server.steps(ADMIN_KEY) if s["step_id"] > last_step and s["num_prefill_tokens"] == 0]
    rows = max(s["num_decode_tokens"] for s in decoding)  # (STREAMS, unless the streams never all ran at once)
    steps = [s for s in decoding if s["num_decode_tokens"] == rows]
    gaps = [b - a for answer in answers for a, b in zip(answer["token_times"], answer["token_times"][1:])]
    return {"viewers": viewers, "decode_rows": rows, "decode_steps": len(steps),
            "step_ms_p50": 1000 * statistics.median(s["duration_s"] for s in steps),
            "tbt_ms_p50": 1000 * statistics.median(gaps), "events_read": len(counts),
            "event_bytes_mean": statistics.mean(counts) if counts else 0}


def cost(args: argparse.Namespace) -> None:
    server = start_server(args)
    rows = []
    try:
        cost_round(server, 0, args, 0)  # warm-up (not reported)
        for round_index in range(args.rounds):
            order = (0, args.viewers) if round_index % 2 == 0 else (args.viewers, 0)
            for viewers in order:
                row = cost_round(server, viewers, args, round_index + 1) | {"round": round_index + 1}
                rows.append(row)
                print(json.dumps(row))
    finally:
        server.stop()
    host = machine()
    print(f"\nCPU: {host.get('cpu')} (family {host.get('cpu_family')}, model {host.get('cpu_model')}), "
          f"{host.get('cpus')} CPUs; commit {host.get('commit')}")
    print("| viewers | round | decode step p50 (ms) | decode rows | steps | stream TBT p50 (ms) | events read |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['viewers']} | {row['round']} | {row['step_ms_p50']:.2f} | {row['decode_rows']} | "
              f"{row['decode_steps']} | {row['tbt_ms_p50']:.2f} | {row['events_read']} |")
    for key in ("step_ms_p50", "tbt_ms_p50"):
        alone = [r[key] for r in rows if r["viewers"] == 0]
        watched = [r[key] for r in rows if r["viewers"] == args.viewers]
        print(f"{key}: {args.viewers} viewers / none = {statistics.median(watched) / statistics.median(alone):.3f} "
              f"(rounds without viewers spread {min(alone):.2f}-{max(alone):.2f}, with {min(watched):.2f}-"
              f"{max(watched):.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": host, "args": vars(args), "rounds": rows}, f, indent=1)


def plan(args: argparse.Namespace) -> None:
    server = " ".join(serve_command(*(["--model", args.model] if args.model else []), "--admin-api-key", "***",
                                    "--max-num-batched-tokens", str(args.budget)))
    if args.screenshot:
        print(f"screenshot: {server} --dashboard-without-auth; {STREAMS} streams x {args.stream_tokens} tokens, "
              f"after {args.lead_s:g} s a {args.long_len}-token prompt; Chromium: {chromium_path() or 'missing'}; "
              f"-> {args.screenshot}")
    if args.cost:
        print(f"cost: {args.rounds} rounds of no viewer and {args.viewers} viewers (alternating), {STREAMS} streams x "
              f"{args.stream_tokens} tokens each, after a warm-up round; {server}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--screenshot", metavar="PNG", help="save the page during Scenario B here")
    parser.add_argument("--cost", action="store_true", help="step time with no viewer and with --viewers")
    parser.add_argument("--viewers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="--cost: rounds, each one without and one with viewers")
    parser.add_argument("--stream-tokens", type=int, default=256, help="tokens each stream decodes")
    parser.add_argument("--long-len", type=int, default=2048, help="--screenshot: the long prompt's tokens")
    parser.add_argument("--lead-s", type=float, default=3.0,
                        help="--screenshot: seconds of streams alone before the long prompt")
    parser.add_argument("--budget", type=int, default=256, help="--max-num-batched-tokens (Scenario B's)")
    parser.add_argument("--workdir", default=None, help="the server's log (default: a temp dir)")
    parser.add_argument("--out", help="--cost: the rounds as JSON")
    add_model_flag(parser)
    parser.add_argument("--dry-run", action="store_true", help="print what would run (and whether Chromium is "
                                                               "there for --screenshot); start nothing")
    args = parser.parse_args()
    if not (args.screenshot or args.cost):
        parser.error("give --screenshot PNG and/or --cost")
    if args.dry_run:
        plan(args)
        return
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="dashboard-bench-")
    if args.screenshot:
        screenshot(args)
    if args.cost:
        cost(args)


if __name__ == "__main__":
    main()
