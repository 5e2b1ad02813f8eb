"""Simulated replicas behind a router, on one timeline: every replica's steps and every
arrival happen in time order (a discrete-event loop), so a 10-minute workload runs in seconds.

Routers (the policies SMG and vLLM's router offer, by the names users know):
- `round-robin`: request i to replica i mod N.
- `least-load`: the replica with the fewest unfinished requests.
- `prefix`: the replica whose prefix cache holds the longest start of the prompt (ties: least
  load), as SMG's cache_aware and Dynamo's KV router aim to.
A request is routed when it arrives, from the replicas' state at that moment. Prefill/decode
pairs (`--pd P:D`): the policy picks a prefill and a decode instance in their pools.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from chunkserve.bench.client import RequestResult
from chunkserve.errors import InvalidRequestError
from chunkserve.sim.disagg import instance_params
from chunkserve.sim.replica import Replica
from chunkserve.sim.trace import SimRequest

ROUTERS = ("round-robin", "least-load", "prefix")


def route(router: str, replicas: list[Replica], index: int, prompt: tuple[int, ...]) -> Replica:
    if router == "round-robin":
        return replicas[index % len(replicas)]
    if router == "least-load":
        return min(replicas, key=lambda r: r.load)
    if router == "prefix":
        return max(replicas, key=lambda r: (r.cached_prefix_tokens(prompt), -r.load))
    raise InvalidRequestError(f"--router must be one of {', '.join(ROUTERS)}, got {router!r}")


def run_fleet(requests: list[SimRequest], replicas: list[Replica], router: str = "round-robin",
              start_time: float = 0.0, on_finished: Callable[[], None] | None = None,
              prefill: list[Replica] | None = None) -> list[RequestResult]:
    """Serve `requests` (arrivals in seconds from `start_time`) on `replicas`; each request's
    results in trace order (n samples of a request: n results, one after another). With
    `prefill` (prefill instances; `replicas` are then decode instances), each request goes to
    one of each, paired by a room as `chunkserve router --pd-disaggregation` pairs them, the
    router's policy choosing within each pool; the client's results are the decode side's."""
    if router not in ROUTERS:
        raise InvalidRequestError(f"--router must be one of {', '.join(ROUTERS)}, got {router!r}")
    prefill = prefill or []
    if prefill and any(request.n > 1 for request in requests):
        raise InvalidRequestError("n above 1 is not supported by a prefill/decode disaggregated deployment (its "
                                  "server refuses it too): give requests with n 1")
    everyone = [*prefill, *replicas]
    arrivals: list[tuple[float, int, int]] = []  # (time, order, request index)
    order = itertools.count()
    followers: dict[int, list[int]] = {}
    for index, request in enumerate(requests):
        if request.after is None:
            heapq.heappush(arrivals, (start_time + request.arrival, next(order), index))
        else:
            followers.setdefault(request.after, []).append(index)
    where: dict[str, tuple[Replica, int]] = {}  # sample id -> (replica, request index)
    samples_left = {index: request.n for index, request in enumerate(requests)}
    routed = 0

    def ended(sample_ids: list[str], replica: Replica) -> None:
        """Samples that finished (or were refused): a request whose last sample ended lets the
        turns that follow it arrive."""
        for sample_id in sample_ids:
            index = where[sample_id][1]
            samples_left[index] -= 1
            if on_finished is not None:
                on_finished()
            if samples_left[index] == 0:
                end = max(replica.results[f"{index}-{s}"].end_time for s in range(requests[index].n))
                for follower in followers.get(index, ()):
                    heapq.heappush(arrivals, (end + requests[follower].arrival, next(order), follower))

    while True:
        busy = [(when, i) for i, r in enumerate(everyone) if (when := r.next_event()) is not None]
        next_step = min(busy) if busy else None
        if arrivals and (next_step is None or arrivals[0][0] <= next_step[0]):
            when, _, index = heapq.heappop(arrivals)
            request = requests[index]
            replica = route(router, replicas, routed, request.prompt_token_ids)
            params = prefill_replica = None
            if prefill:
                prefill_replica = route(router, prefill, routed, request.prompt_token_ids)
                params = instance_params(routed, prefill.index(prefill_replica))
            routed += 1
            refused = []
            for sample in range(request.n):
                sample_id = f"{index}-{sample}"
                where[sample_id] = (replica, index)
                if not replica.submit(sample_id, request.prompt_token_ids, request.output_len, when, request.kind,
                                      request.priority, params):
                    refused.append(sample_id)
            if prefill_replica is not None and not refused:  # (a refused request: both halves refuse it)
                prefill_replica.submit(f"{index}-0", request.prompt_token_ids, 1, when, request.kind,
                                       request.priority, params)
            ended(refused, replica)
            continue
        if next_step is None:
            break
        replica = everyone[next_step[1]]
        finished = replica.advance()
        if replica not in prefill:  # a prefill instance's half of a request: the client sees the decode side's
            ended(finished, replica)
    stuck = [r for r in everyone if r.core.has_unfinished_requests()]
    if stuck:
        raise RuntimeError(f"the simulation ended with {sum(len(r.core.unfinished_request_ids()) for r in stuck)} "
                           "request(s) unfinished, waiting for what never came (a KV transfer?)")
    unrouted = [i for i in range(len(requests)) if f"{i}-0" not in where]
    if unrouted:
        raise InvalidRequestError(f"requests {unrouted[:5]} never arrived: their `after` request never ended")
    return [where[f"{i}-{s}"][0].results[f"{i}-{s}"] for i, request in enumerate(requests) for s in range(request.n)]
