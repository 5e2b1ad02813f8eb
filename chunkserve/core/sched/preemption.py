"""Whom to preempt when the KV pool runs dry while a running request grows: the least
important running request not already in this step. With the priority policy that is the
one of the highest priority value (then the latest arrival); otherwise the latest admitted.
A preempted request frees its blocks and is recomputed later (vLLM V1's only mode)."""

from __future__ import annotations

from chunkserve.core.request import Request


def pick_victim(candidates: list[Request], scheduling_policy: str) -> Request:
    if scheduling_policy == "priority":
        return max(candidates, key=lambda r: (r.priority, r.arrival_time))
    return max(candidates, key=lambda r: r.admission_seq)
