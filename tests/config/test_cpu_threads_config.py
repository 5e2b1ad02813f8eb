"""--cpu-omp-threads-bind (vLLM's VLLM_CPU_OMP_THREADS_BIND): its syntax and its errors."""

from __future__ import annotations

import pytest

from chunkserve.config.cpu_threads import BIND_ENV, parse_cpu_list, parse_threads_bind
from chunkserve.config.engine import EngineArgs
from chunkserve.errors import InvalidRequestError


@pytest.mark.parametrize(("text", "cpus"), [("0", (0,)), ("0-3", (0, 1, 2, 3)), ("4,0-1", (0, 1, 4)),
                                            (" 2 - 3 ", (2, 3))])
def test_cpu_lists_in_linux_syntax(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(("text", "complaint"), [("x", "'x' is not a CPU id"), ("3-1", "'3-1' is not a range"),
                                                 ("-1", "is not a CPU id or a range"), ("0,,1", "'' is not a CPU id"),
                                                 ("0-2,1", "names a CPU twice")])
def test_a_bad_cpu_list_says_which_part_is_wrong(text, complaint):
    with pytest.raises(InvalidRequestError, match=complaint):
        parse_cpu_list(text)


def test_one_list_per_rank_or_a_keyword():
    assert parse_threads_bind("auto") == "auto" and parse_threads_bind("nobind") == "nobind"
    assert parse_threads_bind("0-1|2-3") == [(0, 1), (2, 3)]
    with pytest.raises(InvalidRequestError, match="two ranks' lists share a CPU"):
        parse_threads_bind("0-2|2-3")
    with pytest.raises(InvalidRequestError, match="empty"):
        parse_threads_bind(" ")
    with pytest.raises(InvalidRequestError, match="cpu_omp_threads_bind 'all'"):
        parse_threads_bind("all")


def test_the_flag_wins_over_vllms_variable_which_wins_over_auto(monkeypatch):
    monkeypatch.delenv(BIND_ENV, raising=False)
    assert EngineArgs().cpu_omp_threads_bind == "auto"
    monkeypatch.setenv(BIND_ENV, "nobind")
    assert EngineArgs().cpu_omp_threads_bind == "nobind"
    assert EngineArgs(cpu_omp_threads_bind="0").cpu_omp_threads_bind == "0"


def test_engine_args_refuse_a_list_count_other_than_the_ranks_of_this_node():
    with pytest.raises(InvalidRequestError, match="gives 2 CPU lists for the 1 rank"):
        EngineArgs(cpu_omp_threads_bind="0|1")
    assert EngineArgs(cpu_omp_threads_bind="0|1", tensor_parallel_size=2).cpu_omp_threads_bind == "0|1"
    with pytest.raises(InvalidRequestError, match="gives 1 CPU lists for the 2 rank"):
        EngineArgs(cpu_omp_threads_bind="0-1", tensor_parallel_size=2)
