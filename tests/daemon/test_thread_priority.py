"""The background threads' priority (issue 33): nice, IO priority and CPUs set per thread by a
pool's initializer, inherited by threads those threads start (the writer's pool, started from the
persist thread), read back from /proc; bad values refused with what to write; a running daemon's
persist thread at the configured values, its event loop at the daemon's own."""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient
from ckptd.daemon.engine.commit import ThreadPool
from ckptd.daemon.thread_priority import (
    BackgroundPriority,
    PriorityError,
    cpus_setting,
    format_cpus,
    ionice_setting,
    nice_setting,
    parse_cpus,
    thread_ionice,
    thread_nice,
)
from ckptd.demo.process import DaemonProcess
from daemon_rig import DaemonFactory

BASE_NICE = os.getpriority(os.PRIO_PROCESS, os.getpid())
BEST_EFFORT_LOWEST = (2, 7)
IDLE = (3, 0)


def observed(priority: BackgroundPriority) -> tuple[int, tuple[int, int], set[int], list[tuple[int, tuple[int, int]]]]:
    """(nice, ioprio, affinity) of a new thread that applied `priority`, and (nice, ioprio) of
    each of two threads it started afterwards."""
    def child() -> tuple[int, tuple[int, int]]:
        tid = threading.get_native_id()
        return thread_nice(tid), thread_ionice(tid)

    def parent() -> tuple[int, tuple[int, int], set[int], list[tuple[int, tuple[int, int]]]]:
        tid = threading.get_native_id()
        with ThreadPoolExecutor(2) as inner:  # as the writer's pool, started from the persist thread
            children = [f.result() for f in [inner.submit(child) for _ in range(2)]]
        return thread_nice(tid), thread_ionice(tid), os.sched_getaffinity(tid), children

    with ThreadPoolExecutor(1, initializer=priority.apply) as pool:
        return pool.submit(parent).result()


@pytest.mark.parametrize(
    ("priority", "nice", "ioprio"),
    [
        (BackgroundPriority(), BASE_NICE, None),  # the defaults: unchanged
        (BackgroundPriority(nice=3, ionice="idle"), min(19, BASE_NICE + 3), IDLE),
        (BackgroundPriority(nice=19, ionice="best-effort"), 19, BEST_EFFORT_LOWEST),  # capped at 19
        (BackgroundPriority(nice=0, ionice="off"), BASE_NICE, None),  # off: as the creating thread
    ],
)
def test_a_thread_and_the_threads_it_starts_run_at_the_priority(priority: BackgroundPriority, nice: int, ioprio: tuple[int, int] | None) -> None:
    me = threading.get_native_id()
    got_nice, got_ioprio, _, children = observed(priority)
    expected_ioprio = ioprio if ioprio is not None else thread_ionice(me)
    assert (got_nice, got_ioprio) == (nice, expected_ioprio)
    assert children == [(nice, expected_ioprio)] * 2  # inherited: nice and the IO priority alike
    assert thread_nice(me) == BASE_NICE  # the calling thread is left as it was


def test_the_cpus_are_set_per_thread() -> None:
    cpu = min(os.sched_getaffinity(0))
    assert observed(BackgroundPriority(nice=0, ionice="off", cpus=(cpu,)))[2] == {cpu}
    assert os.sched_getaffinity(0) != {cpu} or os.cpu_count() == 1  # the calling thread keeps its CPUs


def test_the_persist_pool_applies_it_and_no_priority_leaves_the_thread_alone() -> None:
    import asyncio

    def nice_here() -> int:
        return thread_nice(threading.get_native_id())

    for priority, expected in ((BackgroundPriority(nice=5, ionice="off"), min(19, BASE_NICE + 5)), (None, BASE_NICE)):
        pool = ThreadPool(priority)
        try:
            assert asyncio.run(pool.run(nice_here)) == expected
        finally:
            pool.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nice": 20}, "expected an integer from 0 (off) to 19"),
        ({"nice": -1}, "expected an integer from 0 (off) to 19"),
        ({"nice": True}, "expected an integer from 0 (off) to 19"),
        ({"ionice": "realtime"}, "expected one of best-effort, idle, off"),
        ({"cpus": (-1,)}, "expected CPU numbers >= 0"),
    ],
)
def test_bad_values_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PriorityError, match=re.escape(message)):
        BackgroundPriority(**kwargs)  # type: ignore[arg-type]


def test_cpus_outside_the_process_affinity_are_refused_with_the_allowed_ones() -> None:
    allowed = format_cpus(os.sched_getaffinity(0))
    with pytest.raises(PriorityError, match=f"CPU\\(s\\) 100000 are not among the CPUs this daemon may use \\({allowed}\\)"):
        BackgroundPriority(cpus=(100000,)).check()


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("", ()), ("0", (0,)), ("2-3", (2, 3)), ("0,2-4, 6", (0, 2, 3, 4, 6)), ("3,1,1", (1, 3)), (" 1 , ", (1,))],
)
def test_cpu_lists(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpus(text) == cpus
    assert parse_cpus(format_cpus(cpus)) == cpus


@pytest.mark.parametrize("text", ["x", "1-", "-1", "3-1", "1.5", "0x1"])
def test_bad_cpu_lists(text: str) -> None:
    with pytest.raises(PriorityError, match="write e.g. 2-3 or 0,2,4"):
        parse_cpus(text)


@pytest.mark.parametrize(
    ("parse", "raw", "value"),
    [
        (nice_setting, "10", 10), (nice_setting, 0, 0), (nice_setting, " 19 ", 19),
        (ionice_setting, "IDLE", "idle"), (ionice_setting, "off", "off"), (ionice_setting, "best-effort", "best-effort"),
        (cpus_setting, "0", (0,)), (cpus_setting, [0, 0], (0,)), (cpus_setting, "", ()), (cpus_setting, [], ()),
    ],
)
def test_settings(parse: object, raw: object, value: object) -> None:
    assert parse(raw) == value  # type: ignore[operator]


@pytest.mark.parametrize(
    ("parse", "raw"),
    [(nice_setting, "20"), (nice_setting, "-1"), (nice_setting, True), (nice_setting, 2.0), (ionice_setting, "rt"), (ionice_setting, 2),
     (cpus_setting, 1), (cpus_setting, [True]), (cpus_setting, "a-b")],
)
def test_bad_settings(parse: object, raw: object) -> None:
    with pytest.raises(PriorityError):
        parse(raw)  # type: ignore[operator]


# ------------------------------------------------------------------ a running daemon


def daemon_threads(daemon: DaemonProcess) -> dict[int, tuple[int, tuple[int, int]]]:
    """tid -> (nice, IO priority) of every thread of the daemon."""
    threads = {}
    for task in Path(f"/proc/{daemon.pid}/task").iterdir():
        tid = int(task.name)
        stat = (task / "stat").read_text()
        threads[tid] = int(stat.rpartition(")")[2].split()[16]), thread_ionice(tid)
    return threads


@pytest.mark.parametrize(
    ("args", "nice", "ioprio"),
    [((), 0, None), (("--background-nice", "10", "--background-ionice", "best-effort"), 10, BEST_EFFORT_LOWEST), (("--background-nice", "7", "--background-ionice", "idle"), 7, IDLE), (("--background-nice", "0", "--background-ionice", "off"), 0, None)],
)
def test_a_daemons_persist_thread_runs_at_the_configured_priority(daemons: DaemonFactory, args: tuple[str, ...], nice: int, ioprio: tuple[int, int] | None) -> None:
    daemon = daemons.start(*args)
    before = daemon_threads(daemon)
    base, base_ioprio = before[daemon.pid]
    with CheckpointClient(job="prio", address=daemon.address, rank=0, world_size=1, on_error="raise") as client:
        client.save(1, {"model": {"w": torch.arange(4096, dtype=torch.float32)}}).wait_durable()
    after = daemon_threads(daemon)
    new = {tid: after[tid] for tid in set(after) - set(before)}  # the persist thread starts with the first save
    expected = (min(19, base + nice), ioprio if ioprio is not None else base_ioprio)
    if ioprio is None and nice == 0:
        assert set(after.values()) == {(base, base_ioprio)}  # off: nothing lowered
    else:
        assert expected in new.values(), f"no new thread at nice {expected[0]}, IO priority {expected[1]}: {new}"
        kept = {tid: after[tid] for tid in set(before) & set(after)}  # the event loop (main thread), gRPC's threads
        assert set(kept.values()) == {(base, base_ioprio)}
