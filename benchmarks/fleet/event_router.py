"""The fleet benchmark's event-driven selection: a small HTTP router that places each completion
on a replica from what the replicas' KV events say they hold (Dynamo's standalone KV indexer,
which follows their `--kv-events-config` streams), the routing a Dynamo-style router does.

The rule, per request, is Dynamo's KV router cost: for each replica, the blocks it would have to
prefill (the prompt's blocks less the longest cached prefix the indexer's `/query` gives for it)
times `--overlap-weight` (Dynamo's `overlap_score_weight`, default 1) plus the blocks of the
prompts this router has in flight to it; the lowest cost wins, then the fewest requests in flight, then the lowest index. Overlap
alone ("most cached prefix, then least load") sends every chat to the replica that first cached
the shared system prompt; weighing it against the load in the same unit keeps a chat where its
history is unless that replica is busier by more than the history is worth.

Only what the benchmark sends: POST /v1/completions with a prompt (text, encoded with the
replicas' tokenizer as they encode it, or token ids), forwarded byte for byte and streamed back;
GET /health.

    python -m benchmarks.fleet.event_router --indexer http://127.0.0.1:8090 --block-size 16 \\
        --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from chunkserve.bench.kv_indexer import IndexerClient
from chunkserve.config.model import resolve_model
from chunkserve.engine.tokenizer import load_tokenizer


def choose(prompt_blocks: int, overlaps: dict[int, int], in_flight_blocks: list[int], in_flight: list[int],
           overlap_weight: float) -> int:
    """The replica with the lowest cost (weighted blocks to prefill there + blocks in flight
    there), then the fewest requests in flight, then the lowest index."""
    def cost(i: int) -> tuple[float, int, int]:
        return overlap_weight * (prompt_blocks - overlaps.get(i, 0)) + in_flight_blocks[i], in_flight[i], i

    return min(range(len(in_flight)), key=cost)


def build_app(replicas: list[str], indexer: IndexerClient, tokenizer: Any, overlap_weight: float) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))
    in_flight = [0] * len(replicas)
    in_flight_blocks = [0] * len(replicas)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.body()
        prompt = json.loads(body)["prompt"]
        token_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        overlaps = await asyncio.to_thread(indexer.overlap_blocks, token_ids)
        blocks = len(token_ids) // indexer.block_size
        chosen = choose(blocks, overlaps, in_flight_blocks, in_flight, overlap_weight)
        in_flight[chosen] += 1
        in_flight_blocks[chosen] += blocks

        def done() -> None:
            in_flight[chosen] -= 1
            in_flight_blocks[chosen] -= blocks

        try:
            upstream = await client.send(client.build_request(
                "POST", f"{replicas[chosen]}/v1/completions", content=body,
                headers={"content-type": "application/json"}), stream=True)
        except httpx.HTTPError:
            done()
            raise

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                done()

        return StreamingResponse(relay(), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type"))

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica", action="append", required=True, help="a replica's base URL (its index: order)")
    parser.add_argument("--indexer", required=True, help="the indexer's base URL, replicas registered by index")
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--model", default=None, help="the replicas' model, for its tokenizer (default: chunkserve's)")
    parser.add_argument("--overlap-weight", type=float, default=1.0,
                        help="the weight of the blocks to prefill against the blocks in flight (Dynamo's default: 1)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model(args.model))
    app = build_app(args.replica, IndexerClient(args.indexer, args.block_size), tokenizer, args.overlap_weight)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
