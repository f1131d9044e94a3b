"""CPU and IO priority of the daemon's background threads (issue 33): the threads that persist,
write, hash, commit, replicate and upload run below the trainer, so that a save in flight takes
the cores the trainer leaves idle rather than the ones it is using.

On Linux every one of these is per thread, and a thread created later inherits the values of the
thread that creates it (the writer's pool threads, started from the persist thread, get the
persist thread's): nice (setpriority(PRIO_PROCESS, tid)), the IO priority (the ioprio_set system
call) and the CPU affinity (sched_setaffinity(tid)). `BackgroundPriority.apply` sets them on the
calling thread; use it as a thread pool's initializer. Never apply it to the event loop or the
gRPC threads: they answer a save's stall-critical calls.

The IO priority is honoured by the BFQ scheduler (and mq-deadline's priority classes); with
"none" it has no effect. Buffered writes reach the disk from the kernel's writeback threads, so
it mostly orders reads and fsync-driven writeback, not the page-cache copies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from dataclasses import dataclass
from typing import Callable, Final

from ckptd.common.names import decimal

__all__ = [
    "IONICE_CLASSES", "BackgroundPriority", "PriorityError", "cpus_setting", "ionice_setting", "nice_setting", "parse_cpus", "thread_ionice",
    "thread_nice",
]

log = logging.getLogger(__name__)

MAX_NICE: Final = 19
IONICE_CLASSES: Final = ("best-effort", "idle", "off")
_IOPRIO_CLASS: Final = {"best-effort": 2, "idle": 3}  # IOPRIO_CLASS_BE, IOPRIO_CLASS_IDLE
_IOPRIO_BE_LOWEST: Final = 7  # the lowest level within best-effort (0 is the highest)
_IOPRIO_CLASS_SHIFT: Final = 13
_IOPRIO_WHO_PROCESS: Final = 1  # "process" means one thread: a tid
# (ioprio_set, ioprio_get) by machine; the generic table (aarch64, riscv64) has 30/31.
_IOPRIO_SYSCALLS: Final = {"x86_64": (251, 252), "aarch64": (30, 31), "arm64": (30, 31)}


class PriorityError(ValueError):
    """A priority setting that is malformed or cannot be applied here; the message says how to fix it."""


@dataclass(frozen=True)
class BackgroundPriority:
    """What the daemon's background threads run at.

    nice: how many nice levels below the daemon's own (the process's nice + nice, at most 19);
        0 = unchanged.
    ionice: "best-effort" (the lowest level, 7, of the default class), "idle" (disk time only
        when no other process wants it: a busy disk can hold a save's durability back
        indefinitely) or "off" (unchanged).
    cpus: the CPUs the threads may run on (e.g. the cores the trainer does not use); empty =
        unchanged.
    """

    nice: int = 0
    ionice: str = "off"
    cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.nice, bool) or not isinstance(self.nice, int) or not 0 <= self.nice <= MAX_NICE:
            raise PriorityError(f"background nice {self.nice!r}: expected an integer from 0 (off) to {MAX_NICE}")
        if self.ionice not in IONICE_CLASSES:
            raise PriorityError(f"background ionice {self.ionice!r}: expected one of {', '.join(IONICE_CLASSES)}")
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in self.cpus):
            raise PriorityError(f"background CPUs {self.cpus!r}: expected CPU numbers >= 0, e.g. 2-3 or 0,2")

    @property
    def off(self) -> bool:
        return self.nice == 0 and self.ionice == "off" and not self.cpus

    def initializer(self) -> Callable[[], None] | None:
        """A thread pool's `initializer` that applies these values; None when they are all off."""
        return None if self.off else self.apply

    def check(self) -> None:
        """Raise PriorityError when these values cannot be applied on this machine (an IO
        priority off Linux or on an unknown architecture, CPUs this process may not use)."""
        if self.ionice != "off" and _ioprio_syscalls() is None:
            raise PriorityError(
                f"--background-ionice {self.ionice}: no IO priorities on {platform.system()} {platform.machine()} "
                "(Linux on x86_64 or aarch64 only); use --background-ionice off"
            )
        if self.cpus:
            allowed = os.sched_getaffinity(0)
            outside = sorted(set(self.cpus) - allowed)
            if outside:
                raise PriorityError(
                    f"--background-cpus: CPU(s) {', '.join(map(str, outside))} are not among the CPUs this daemon may use "
                    f"({format_cpus(allowed)}); give a subset of those"
                )

    def apply(self) -> None:
        """Set these values on the calling thread (a thread pool's initializer). A value the
        kernel refuses is logged, not raised: the thread still does its work, at the old priority."""
        tid = threading.get_native_id()
        try:
            if self.nice:
                target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, os.getpid()) + self.nice)
                os.setpriority(os.PRIO_PROCESS, tid, target)
            if self.ionice != "off":
                _set_ioprio(tid, _ioprio_value(self.ionice))
            if self.cpus:
                os.sched_setaffinity(tid, self.cpus)
        except OSError as exc:
            log.warning("thread %s (%s) keeps its priority: %s cannot be applied: %s", threading.current_thread().name, tid, self, exc)


# The daemon's settings (config.py): a flag's or environment variable's text, or a TOML value.
# Each raises PriorityError saying what was expected.


def nice_setting(raw: object) -> int:
    """--background-nice: 0 (off) .. 19, as an integer or its text."""
    value = -1
    if isinstance(raw, str) and (number := decimal(raw.strip())) is not None:
        value = number
    elif isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    if not 0 <= value <= MAX_NICE:
        raise PriorityError(f"an integer from 0 (off) to {MAX_NICE}: how many nice levels below the daemon's own its background threads run")
    return value


def ionice_setting(raw: object) -> str:
    """--background-ionice: one of IONICE_CLASSES (any case) that this machine can set."""
    value = raw.strip().lower() if isinstance(raw, str) else ""
    if value not in IONICE_CLASSES:
        raise PriorityError("one of " + ", ".join(repr(c) for c in IONICE_CLASSES))
    try:
        BackgroundPriority(nice=0, ionice=value).check()
    except PriorityError as exc:
        raise PriorityError(f"'off' here: {exc}") from None
    return value


def cpus_setting(raw: object) -> tuple[int, ...]:
    """--background-cpus: a CPU list such as '2-3' or '0,2,4' (or a TOML list of integers) of
    CPUs this process may use; '' or [] = unset."""
    expected = "a CPU list such as '2-3' or '0,2,4' (empty: unset)"
    try:
        if isinstance(raw, str):
            cpus = parse_cpus(raw)
        elif isinstance(raw, (list, tuple)) and all(isinstance(c, int) and not isinstance(c, bool) for c in raw):
            cpus = parse_cpus(",".join(map(str, raw)))
        else:
            raise PriorityError("not a string or a list of integers")
        BackgroundPriority(nice=0, ionice="off", cpus=cpus).check()
    except PriorityError as exc:
        raise PriorityError(f"{expected}; {exc}") from None
    return cpus


def parse_cpus(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6) (sorted, each once); '' -> () (unset). Raises PriorityError."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        first, dash, last = part.partition("-")
        try:
            lo, hi = int(first, 10), int(last if dash else first, 10)
        except ValueError:
            raise PriorityError(f"CPU list {text!r}: {part!r} is not a CPU number or range; write e.g. 2-3 or 0,2,4") from None
        if lo < 0 or hi < lo:
            raise PriorityError(f"CPU list {text!r}: {part!r} is not a CPU number or an ascending range; write e.g. 2-3 or 0,2,4")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def format_cpus(cpus: set[int] | tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    runs: list[str] = []
    ordered = sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)


def thread_nice(tid: int) -> int:
    """A thread's nice value, from /proc/self/task/<tid>/stat (field 19)."""
    stat = open(f"/proc/self/task/{tid}/stat").read()
    return int(stat.rpartition(")")[2].split()[16])


def thread_ionice(tid: int) -> tuple[int, int]:
    """A thread's IO priority as (class, level): class 0 = none set (follows its nice), 2 =
    best-effort, 3 = idle. Raises PriorityError where there is no ioprio_get."""
    calls = _ioprio_syscalls()
    if calls is None:
        raise PriorityError(f"no IO priorities on {platform.system()} {platform.machine()}")
    value = _libc().syscall(calls[1], _IOPRIO_WHO_PROCESS, tid)
    if value < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return value >> _IOPRIO_CLASS_SHIFT, value & ((1 << _IOPRIO_CLASS_SHIFT) - 1)


def _ioprio_value(name: str) -> int:
    level = _IOPRIO_BE_LOWEST if name == "best-effort" else 0
    return (_IOPRIO_CLASS[name] << _IOPRIO_CLASS_SHIFT) | level


def _ioprio_syscalls() -> tuple[int, int] | None:
    if platform.system() != "Linux":
        return None
    return _IOPRIO_SYSCALLS.get(platform.machine())


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _set_ioprio(tid: int, value: int) -> None:
    calls = _ioprio_syscalls()
    assert calls is not None  # check() refused the setting
    if _libc().syscall(calls[0], _IOPRIO_WHO_PROCESS, tid, value) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
