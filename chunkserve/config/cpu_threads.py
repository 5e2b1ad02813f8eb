"""The syntax of `--cpu-omp-threads-bind` (vLLM's VLLM_CPU_OMP_THREADS_BIND): which CPUs the
engine's compute threads run on. Checked here, when the engine's arguments are built; the
executor turns it into thread counts and placements (executor/cpu_threads.py)."""

from __future__ import annotations

import os

from chunkserve.errors import InvalidRequestError

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's name; the flag wins where both are given
BIND_AUTO = "auto"  # threads from the CPUs the process may use (affinity, cgroup quota), not pinned
BIND_NONE = "nobind"  # no placement, OMP_NUM_THREADS (or torch's default) decides the count
RANK_SEPARATOR = "|"


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """A Linux CPU list ("0-3", "0,2,4-5") as sorted CPU ids; InvalidRequestError on anything else
    (empty, descending ranges, negative ids, repeats)."""
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last) if dash else int(first)
        except ValueError:
            raise InvalidRequestError(f"CPU list {text!r}: {part.strip()!r} is not a CPU id or a range like 0-3") from None
        if low < 0 or high < low:
            raise InvalidRequestError(f"CPU list {text!r}: {part.strip()!r} is not a range of CPU ids (low-high, from 0)")
        cpus.extend(range(low, high + 1))
    if len(set(cpus)) != len(cpus):
        raise InvalidRequestError(f"CPU list {text!r} names a CPU twice")
    return tuple(sorted(cpus))


def parse_threads_bind(text: str) -> str | list[tuple[int, ...]]:
    """`auto`, `nobind`, or one CPU list per rank of this node ("0-3|4-7"), whose lists must not
    share a CPU."""
    text = text.strip()
    if text in (BIND_AUTO, BIND_NONE):
        return text
    if not text:
        raise InvalidRequestError(f"cpu_omp_threads_bind is empty: give {BIND_AUTO}, {BIND_NONE} or CPU lists "
                                  f"like 0-3 (one per rank, separated by {RANK_SEPARATOR})")
    try:
        lists = [parse_cpu_list(part) for part in text.split(RANK_SEPARATOR)]
    except InvalidRequestError as error:
        raise InvalidRequestError(f"cpu_omp_threads_bind {text!r}: {error}") from None
    every = [cpu for cpus in lists for cpu in cpus]
    if len(set(every)) != len(every):
        raise InvalidRequestError(f"cpu_omp_threads_bind {text!r}: two ranks' lists share a CPU")
    return lists


def threads_bind_setting(flag: str | None) -> str:
    """The flag when given, else VLLM_CPU_OMP_THREADS_BIND, else auto."""
    return flag if flag is not None else os.environ.get(BIND_ENV, BIND_AUTO)
