"""How many compute threads an engine process runs, where, and how they wait: from the CPUs
it may use (affinity, cgroup quota), the bind setting and the user's own OpenMP variables."""

from __future__ import annotations

import pytest

from chunkserve.errors import InvalidRequestError
from chunkserve.executor.cpu_threads import (
    cgroup_cpu_limit,
    format_cpu_list,
    plan_threads,
    thread_environment,
)

FOUR = (0, 1, 2, 3)


def write_cgroup(tmp_path, self_cgroup: str, files: dict[str, str]) -> tuple[str, str]:
    """A fake cgroup mount under tmp_path and a /proc/self/cgroup naming it; returns (root, self file)."""
    for relative, text in files.items():
        path = tmp_path / "cgroup" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "self").write_text(self_cgroup)
    return str(tmp_path / "cgroup"), str(tmp_path / "self")


def test_cgroup_v2_quota_is_quota_over_period_the_smallest_along_the_path(tmp_path):
    root, self_file = write_cgroup(tmp_path, "0::/pods/web\n", {
        "cpu.max": "max 100000\n", "pods/cpu.max": "300000 100000\n", "pods/web/cpu.max": "150000 100000\n"})
    assert cgroup_cpu_limit(root, self_file) == 1.5
    root, self_file = write_cgroup(tmp_path, "0::/pods/web\n", {"pods/cpu.max": "100000 100000\n",
                                                                "pods/web/cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root, self_file) == 1.0


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    root, self_file = write_cgroup(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/job\n", {
        "cpu,cpuacct/job/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_limit(root, self_file) == 0.5
    root, self_file = write_cgroup(tmp_path, "1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n",
                                                           "cpu/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_limit(root, self_file) is None
    assert cgroup_cpu_limit(str(tmp_path / "absent"), str(tmp_path / "absent-self")) is None


@pytest.mark.parametrize(("limit", "threads"), [(None, 4), (8.0, 4), (2.4, 2), (1.5, 2), (0.3, 1)])
def test_auto_runs_one_thread_per_allowed_cpu_capped_by_the_rounded_quota(limit, threads):
    plan = plan_threads("auto", cpus=FOUR, cpu_limit=limit, environ={})
    assert (plan.threads, plan.cpus, plan.pinned) == (threads, FOUR, False)
    assert ("quota" in plan.reason) == (limit is not None and threads < 4)


def test_auto_shares_the_cpus_among_the_ranks_and_keeps_the_users_thread_count():
    assert plan_threads("auto", 1, 2, cpus=FOUR, environ={}).threads == 2
    assert plan_threads("auto", 0, 3, cpus=(0, 1), environ={}).threads == 1
    plan = plan_threads("auto", cpus=FOUR, environ={"OMP_NUM_THREADS": "3"})
    assert plan.threads == 3 and plan.reason == "OMP_NUM_THREADS"
    assert plan_threads("nobind", cpus=FOUR, cpu_limit=1.0, environ={}).threads == 4  # nobind ignores the quota


def test_a_cpu_list_pins_one_thread_per_cpu_of_the_ranks_own_list():
    plan = plan_threads("0-1|2-3", 1, 2, cpus=FOUR, environ={})
    assert (plan.threads, plan.cpus, plan.pinned) == (2, (2, 3), True)
    env = thread_environment(plan, {})
    assert (env["OMP_NUM_THREADS"], env["OMP_PLACES"], env["OMP_PROC_BIND"]) == ("2", "{2},{3}", "close")


def test_a_cpu_list_outside_the_allowed_cpus_or_against_omp_num_threads_is_refused():
    with pytest.raises(InvalidRequestError, match="names CPUs 4-5, which this process may not use .it may use 0-3"):
        plan_threads("2-5", cpus=FOUR, environ={})
    with pytest.raises(InvalidRequestError, match="OMP_NUM_THREADS=3 contradicts"):
        plan_threads("0-1", cpus=FOUR, environ={"OMP_NUM_THREADS": "3"})


def test_the_engine_process_bounds_its_threads_spin_unless_the_user_chose_how_they_wait():
    plan = plan_threads("auto", cpus=FOUR, environ={})
    env = thread_environment(plan, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "4", "GOMP_SPINCOUNT": "1000"}
    for users in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        assert thread_environment(plan, users) == {**users, "OMP_NUM_THREADS": "4"}
    env = thread_environment(plan, {"OMP_NUM_THREADS": "1"})
    assert env == {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "1000"}
    assert thread_environment(None, {}) == {"GOMP_SPINCOUNT": "1000"}  # a process whose ranks compute


def test_cpu_lists_print_as_ranges():
    assert format_cpu_list((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8" and format_cpu_list((3,)) == "3"


def test_a_process_started_for_a_cpu_list_keeps_its_plan_though_its_own_thread_is_bound_to_the_first_cpu():
    """libgomp binds the process's own thread to the first place as torch loads: the engine
    process that `thread_environment` started for "0-1" may then run only on CPU 0, and its plan
    is still both CPUs (a list of several CPUs was refused there)."""
    started_for_it = thread_environment(plan_threads("0-1", cpus=FOUR, environ={}), {})
    plan = plan_threads("0-1", cpus=(0,), environ=started_for_it)
    assert (plan.threads, plan.cpus, plan.pinned) == (2, (0, 1), True)
    with pytest.raises(InvalidRequestError, match="names CPUs 1, which this process may not use"):
        plan_threads("0-1", cpus=(0,), environ={"OMP_PLACES": "{0}"})  # not started for this list
