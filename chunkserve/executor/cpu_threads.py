"""How many compute threads an engine process runs, on which CPUs, and how they wait.

The count comes from the CPUs the process may use: its affinity (taskset, a cgroup cpuset),
capped by its cgroup's CPU quota (cpu.max, or v1's cfs quota), shared among the ranks of this
node; `--cpu-omp-threads-bind` (vLLM's VLLM_CPU_OMP_THREADS_BIND) names CPUs instead, one
thread pinned to each. torch's OpenMP (libgomp) reads its settings once, when torch is
loaded, so they reach an engine as the environment of the process that runs it
(`thread_environment`), set by the process that starts it.

How the threads wait matters on a shared host: libgomp's default spins a waiting thread for
300,000 iterations (milliseconds) at each of the ~200 team joins of a decode step, so beside
another busy process a thread spins on a core while its team-mate waits for that very core,
and a step takes a scheduler slice per join. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) cures
that but pays a wake-up at every join even alone; a spin bounded to 1,000 iterations (tens of
microseconds) covers the gaps between a step's parallel regions and gives the core up soon
after. Unless the user chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment), the
engine's threads get that bound (WAIT_SETTING; the measurements that chose it are in
docs/benchmarks-log.md, "Sharing a host").
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from chunkserve.config.cpu_threads import BIND_AUTO, BIND_NONE, parse_threads_bind
from chunkserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

WAIT_SETTING = {"GOMP_SPINCOUNT": "1000"}
USER_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # either one: the user's choice stands
CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"


@dataclass(frozen=True)
class ThreadPlan:
    """One engine process's compute threads: how many, the CPUs they may run on, whether each is
    pinned to one of them, and how the count was chosen."""

    threads: int
    cpus: tuple[int, ...]
    pinned: bool
    reason: str

    def summary(self, environ: Mapping[str, str]) -> str:
        """For the start-up log, with the wait policy of a process started with `environ`."""
        placement = "one pinned to each" if self.pinned else "not pinned"
        return (f"{self.threads} threads (from {self.reason}) on CPUs {format_cpu_list(self.cpus)}, {placement}; "
                f"OpenMP waits: {wait_policy_of(environ)}")


def format_cpu_list(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def wait_policy_of(environ: Mapping[str, str]) -> str:
    settings = [f"{name}={environ[name]}" for name in USER_WAIT_SETTINGS if name in environ]
    return " ".join(settings) or "libgomp's default (spins before sleeping)"


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (taskset and cgroup cpusets count, not the machine's CPUs)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


def threads_cpus() -> tuple[int, ...]:
    """The CPUs this process's threads may run on, together: pinned threads each have one, and
    the process's own thread only the first of them (`allowed_cpus` reads that thread's)."""
    cpus: set[int] = set()
    try:
        for thread in os.listdir("/proc/self/task"):
            try:
                cpus |= os.sched_getaffinity(int(thread))
            except OSError:  # the thread ended meanwhile
                pass
    except (OSError, AttributeError):  # no /proc, not Linux
        pass
    return tuple(sorted(cpus)) or allowed_cpus()


def cgroup_cpu_limit(cgroup_root: str = CGROUP_ROOT, self_cgroup: str = SELF_CGROUP) -> float | None:
    """CPUs' worth of time this process's cgroup may use (quota / period, the smallest along its
    path: cgroup v2's cpu.max, v1's cpu.cfs_quota_us / cpu.cfs_period_us); None where there is no
    quota or no cgroup file to read."""
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2's unified hierarchy
            limits += _along_path(os.path.join(cgroup_root), path, _v2_limit)
        elif "cpu" in controllers.split(","):
            limits += _along_path(os.path.join(cgroup_root, controllers), path, _v1_limit)
    return min(limits, default=None)


def _along_path(mount: str, path: str, read) -> list[float]:
    """`read` of the cgroup folder at `path` and of each of its ancestors, where it gives a limit."""
    parts = [p for p in path.split("/") if p]
    folders = [os.path.join(mount, *parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [limit for limit in map(read, folders) if limit is not None]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _v2_limit(folder: str) -> float | None:
    text = _read(os.path.join(folder, "cpu.max"))
    if text is None or text.startswith("max"):
        return None
    quota, period = text.split()
    return int(quota) / int(period)


def _v1_limit(folder: str) -> float | None:
    quota, period = _read(os.path.join(folder, "cpu.cfs_quota_us")), _read(os.path.join(folder, "cpu.cfs_period_us"))
    if quota is None or period is None or int(quota) < 0:
        return None
    return int(quota) / int(period)


def plan_threads(bind: str, rank_index: int = 0, ranks: int = 1, cpus: tuple[int, ...] | None = None,
                 cpu_limit: float | None = None, environ: Mapping[str, str] | None = None) -> ThreadPlan:
    """The plan of the `rank_index`-th of this node's `ranks` engine processes, from the bind
    setting, the allowed `cpus` and the cgroup's `cpu_limit` (default: this process's), and the
    user's OMP_NUM_THREADS, which `auto` and `nobind` respect. A bind setting with CPU lists has
    one per rank (EngineArgs checks it)."""
    cpus = allowed_cpus() if cpus is None else cpus
    cpu_limit = cgroup_cpu_limit() if cpu_limit is None else cpu_limit
    environ = os.environ if environ is None else environ
    setting = parse_threads_bind(bind)
    user_threads = environ.get("OMP_NUM_THREADS")
    if setting in (BIND_AUTO, BIND_NONE):
        if user_threads:
            return ThreadPlan(int(user_threads.split(",")[0]), cpus, False, "OMP_NUM_THREADS")
        if setting == BIND_NONE:
            return ThreadPlan(max(1, len(cpus) // ranks), cpus, False, "nobind: every allowed CPU, shared by the ranks")
        usable = len(cpus)
        reason = f"{len(cpus)} allowed CPUs"
        if cpu_limit is not None and math.floor(cpu_limit + 0.5) < usable:
            usable = max(1, math.floor(cpu_limit + 0.5))
            reason = f"the cgroup's CPU quota ({cpu_limit:g} CPUs)"
        if ranks > 1:
            reason += f" shared by {ranks} ranks"
        return ThreadPlan(max(1, usable // ranks), cpus, False, reason)
    mine = setting[rank_index]
    # A process started for this plan (its environment places one thread on each of these CPUs)
    # has had its own thread bound to the first of them by libgomp as torch loaded: its affinity
    # is that one CPU now, and the plan was checked where it was made.
    started_for_it = environ.get("OMP_PLACES") == places(mine)
    if not started_for_it and (outside := sorted(set(mine) - set(cpus))):
        raise InvalidRequestError(f"cpu_omp_threads_bind {bind!r} names CPUs {format_cpu_list(tuple(outside))}, "
                                  f"which this process may not use (it may use {format_cpu_list(cpus)})")
    if user_threads and int(user_threads.split(",")[0]) != len(mine):
        raise InvalidRequestError(f"OMP_NUM_THREADS={user_threads} contradicts cpu_omp_threads_bind {bind!r} "
                                  f"({len(mine)} CPUs for rank {rank_index}): unset one of them")
    return ThreadPlan(len(mine), mine, True, "cpu_omp_threads_bind")


def thread_environment(plan: ThreadPlan | None, environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` plus what an engine process started with it needs for `plan` (None: a process
    that leaves the computing to ranks of their own): its thread count, one place per pinned
    thread (libgomp then binds thread i to the i-th CPU), and the wait policy unless the user
    set one."""
    env = dict(environ)
    if plan is not None:
        env["OMP_NUM_THREADS"] = environ.get("OMP_NUM_THREADS") or str(plan.threads)
    if plan is not None and plan.pinned:
        env["OMP_PLACES"] = places(plan.cpus)
        env["OMP_PROC_BIND"] = "close"
    if not any(name in environ for name in USER_WAIT_SETTINGS):
        env.update(WAIT_SETTING)
    return env


def places(cpus: tuple[int, ...]) -> str:
    """OMP_PLACES with one place per CPU."""
    return ",".join(f"{{{cpu}}}" for cpu in cpus)


def apply_in_process(plan: ThreadPlan) -> None:
    """Give this process's torch the plan's thread count. The placement and the wait policy
    reach torch only through the environment it was loaded with: a process chunkserve starts
    gets them (`thread_environment`), an engine in the caller's own process (`LLM`,
    --disable-frontend-multiprocessing) keeps what its environment had, and is told so."""
    import torch  # here only: the process that plans an engine process's threads never loads torch for it

    if torch.get_num_threads() != plan.threads:
        torch.set_num_threads(plan.threads)
    if plan.pinned and os.environ.get("OMP_PLACES") != places(plan.cpus):
        logger.warning("cpu_omp_threads_bind pins the threads of the engine processes chunkserve starts; this "
                       "engine runs in a process it did not start, so its %d threads are not pinned (start it "
                       "under taskset -c %s, or with OMP_PLACES and OMP_PROC_BIND set)", plan.threads,
                       format_cpu_list(plan.cpus))


def current_threads() -> dict:
    """This process's compute threads as torch runs them: count, allowed CPUs, pinning, waits."""
    import torch

    return {"threads": torch.get_num_threads(), "cpus": format_cpu_list(threads_cpus()),
            "pinned": "OMP_PLACES" in os.environ, "wait_policy": wait_policy_of(os.environ)}
