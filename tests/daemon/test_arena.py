"""Arena sets (daemon/ckptd/daemon/handoff/arena.py), in process on a real tmpfs directory: a
set's arenas are made several at once, and when one cannot be made none is left behind."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from ckptd.daemon.errors import Exhausted
from ckptd.daemon.handoff import arena as arena_module
from ckptd.daemon.handoff.arena import ARENA_PREFIX, Arena, ArenaPool, remove_stale_arenas

MiB = 1 << 20


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ckptd-test-", dir="/dev/shm") as d:
        yield Path(d)


def _files(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.iterdir() if p.name.startswith(ARENA_PREFIX))


def test_a_sets_arenas_are_made_at_once_one_per_rank_with_bytes(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = Arena.__init__
    threads: set[str] = set()

    def init(self: Arena, path: Path, size: int) -> None:
        threads.add(threading.current_thread().name)
        made(self, path, size)

    monkeypatch.setattr(Arena, "__init__", init)
    monkeypatch.setattr(arena_module.os, "cpu_count", lambda: 4)
    pool = ArenaPool(shm_dir, "job", max_inflight=1)
    taken = pool.reserve_new()
    sizes = (2 * MiB, 0, 1 * MiB, 3 * MiB, 4096)
    pool.allocate(taken.arena_set, sizes)
    assert threads and all(name.startswith("ckptd-arena") for name in threads)  # on the pool's threads, not the caller's
    arenas = taken.arena_set.arenas
    assert [a.size if a is not None else 0 for a in arenas] == list(sizes)
    assert arenas[1] is None  # a rank with nothing to hand over has no arena
    assert [a.path.name.rsplit("-", 1)[-1] for a in arenas if a is not None] == ["r0", "r2", "r3", "r4"]
    for a in arenas:
        if a is not None:
            a.view(a.size - 1, 1)[0] = 7  # mapped and writable to its last byte
    assert len(_files(shm_dir)) == 4
    pool.allocate(taken.arena_set, (MiB,))  # replaced: the old files go
    assert len(_files(shm_dir)) == 1
    pool.close()
    assert _files(shm_dir) == []


@pytest.mark.parametrize("failing_rank", [0, 2, 3])
def test_when_one_ranks_arena_cannot_be_made_none_of_the_set_is_kept(shm_dir: Path, monkeypatch: pytest.MonkeyPatch, failing_rank: int) -> None:
    made = Arena.__init__

    def init(self: Arena, path: Path, size: int) -> None:
        if path.name.endswith(f"-r{failing_rank}"):
            raise Exhausted(f"cannot reserve {size} bytes of shared memory in {path.parent}: No space left on device")
        made(self, path, size)

    monkeypatch.setattr(Arena, "__init__", init)
    monkeypatch.setattr(arena_module, "ALLOCATE_THREADS", 4)
    pool = ArenaPool(shm_dir, "job", max_inflight=1)
    taken = pool.reserve_new()
    with pytest.raises(Exhausted, match="No space left"):
        pool.allocate(taken.arena_set, (MiB, MiB, MiB, MiB))
    assert _files(shm_dir) == []
    assert taken.arena_set.arenas == []
    pool.undo(taken)
    pool.close()


class _Plan:
    """What held_part reads of a SavePlan: the bytes each rank's part fills."""

    def __init__(self, arena_bytes: tuple[int, ...]) -> None:
        self.arena_bytes = arena_bytes


def test_held_part_names_the_ranks_arena_of_the_newest_held_snapshot(shm_dir: Path) -> None:
    pool = ArenaPool(shm_dir, "job", max_inflight=2)
    assert pool.held_part(0) is None  # nothing held
    older, newer = pool.reserve_new().arena_set, pool.reserve_new().arena_set
    pool.allocate(older, (2 * MiB, MiB))
    pool.allocate(newer, (2 * MiB, 0, MiB))
    pool.hold(older, 3, _Plan((MiB + 5, 4096)), {})
    older.readers = 1  # a load reads step 3: it stays held beside step 4
    pool.hold(newer, 4, _Plan((MiB, 0, 512)), {})
    part = pool.held_part(0)
    assert part is not None and (part.step, part.path, part.nbytes) == (4, newer.arenas[0].path_text, MiB)
    assert pool.held_part(1) is None  # the rank copied nothing into step 4
    assert pool.held_part(2) is not None and pool.held_part(2).nbytes == 512
    assert pool.held_part(3) is None and pool.held_part(-1) is None  # no such rank
    pool.release(newer)
    part = pool.held_part(1)
    assert part is not None and (part.step, part.nbytes) == (3, 4096)  # step 3 is the newest held now
    pool.close()


def _plant(shm_dir: Path, *names: str) -> None:
    for name in names:
        (shm_dir / name).write_bytes(b"x")


def test_the_files_of_an_earlier_daemon_with_this_pid_are_removed_at_start(shm_dir: Path) -> None:
    """A container restarted: the daemon is pid 1 again, and the node's /dev/shm still holds
    the files its earlier run made under pid 1 (left alone, they took the names this run makes:
    its first save failed with "File exists", and their memory never went back)."""
    me = os.getpid()
    _plant(shm_dir, f"{ARENA_PREFIX}{me}-job-s0-g1-r0", f"{ARENA_PREFIX}{me}-fetch-job-3-data.safetensors", f"{ARENA_PREFIX}{me}-replica-2")
    removed = remove_stale_arenas(shm_dir, me)
    assert sorted(p.name for p in removed) == sorted(
        [f"{ARENA_PREFIX}{me}-job-s0-g1-r0", f"{ARENA_PREFIX}{me}-fetch-job-3-data.safetensors", f"{ARENA_PREFIX}{me}-replica-2"]
    )
    assert _files(shm_dir) == []


def test_another_daemons_files_live_while_a_ckptd_has_their_pid(shm_dir: Path) -> None:
    dead = 2**22 + 19  # above pid_max's default: no such process here
    with subprocess.Popen(["sleep", "30"]) as other, subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "ckptd"]) as daemon:
        try:
            deadline = time.monotonic() + 10
            while b"ckptd" not in Path(f"/proc/{daemon.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
                time.sleep(0.01)  # its exec may not have finished
            _plant(
                shm_dir, f"{ARENA_PREFIX}{dead}-job-s0-g1-r0", f"{ARENA_PREFIX}{other.pid}-job-s0-g1-r0", f"{ARENA_PREFIX}{daemon.pid}-job-s0-g1-r0",
                "ckptd-user-notes", f"{ARENA_PREFIX}x-1",
            )
            removed = remove_stale_arenas(shm_dir, os.getpid())
        finally:
            other.kill()
            daemon.kill()
    # no such pid; a pid alive but no ckptd's; a live ckptd's stays; names without a pid are not the daemon's
    assert sorted(p.name for p in removed) == sorted([f"{ARENA_PREFIX}{dead}-job-s0-g1-r0", f"{ARENA_PREFIX}{other.pid}-job-s0-g1-r0"])
    assert _files(shm_dir) == sorted([f"{ARENA_PREFIX}{daemon.pid}-job-s0-g1-r0", "ckptd-user-notes", f"{ARENA_PREFIX}x-1"])


def test_entries_named_like_arenas_that_the_daemon_did_not_make_are_left_and_it_starts(shm_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Found in review: a directory (or a link, or another user's file) under a dead pid's arena
    name made the sweep raise (IsADirectoryError) and the daemon not start."""
    dead = 2**22 + 19
    (shm_dir / f"{ARENA_PREFIX}{dead}-job-s0-g1-r0").mkdir()
    (shm_dir / f"{ARENA_PREFIX}{dead}-job-s0-g1-r1").symlink_to("/etc/hostname")
    planted = shm_dir / f"{ARENA_PREFIX}{dead}-job-s0-g1-r2"
    planted.write_bytes(b"x")
    os.chown(planted, 65534, 65534)
    _plant(shm_dir, f"{ARENA_PREFIX}{dead}-job-s0-g1-r3")
    with caplog.at_level(logging.WARNING):
        removed = remove_stale_arenas(shm_dir, os.getpid())
    assert [p.name for p in removed] == [f"{ARENA_PREFIX}{dead}-job-s0-g1-r3"]
    assert len(list(shm_dir.iterdir())) == 3 and caplog.text.count("is not a file the daemon made") == 3
