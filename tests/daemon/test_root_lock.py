"""The node lock of a storage root (storage/root_lock.py; issue 30 finding 4), in process: real
files, real record locks."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.service import CheckpointService
from ckptd.daemon.storage import root_lock
from ckptd.daemon.storage.root_lock import LockOwner, RootInUse, RootLock, lock_path


@pytest.fixture
def config(tmp_path: Path) -> DaemonConfig:
    (tmp_path / "shm").mkdir()
    return DaemonConfig(root=tmp_path / "root", socket=tmp_path / "s.sock", shm_dir=tmp_path / "shm", disk_reserve=0)


# issue 30 finding 4
def test_a_second_service_on_a_served_root_stops_before_its_recovery_removes_anything(config: DaemonConfig) -> None:
    first = CheckpointService(config)
    first.start()
    try:
        in_flight = config.root / "job" / "step-00000007"  # what the first daemon is writing: no index yet
        in_flight.mkdir(parents=True)
        (in_flight / ".tmp-model-00001-of-00001.safetensors.1").write_bytes(b"x" * 100)
        second = CheckpointService(DaemonConfig(**{**config.__dict__, "socket": config.socket.with_name("other.sock")}))
        with pytest.raises(RootInUse) as refused:
            second.start()
        message = str(refused.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in message and str(config.socket) in message
        assert "node 0" in message and "--node-rank" in message
        assert (in_flight / ".tmp-model-00001-of-00001.safetensors.1").read_bytes() == b"x" * 100
    finally:
        first.close()
    third = CheckpointService(config)  # the first one is closed: its lock is free
    third.start()
    third.close()


# issue 30 finding 4
def test_the_lock_records_its_owner_and_frees_when_released(tmp_path: Path) -> None:
    lock = RootLock.acquire(tmp_path, LockOwner.this_process(3, "/run/x.sock"))
    record = json.loads(lock_path(tmp_path, 3).read_text())
    assert (record["host"], record["pid"], record["socket"], record["node"]) == (socket.gethostname(), os.getpid(), "/run/x.sock", 3)
    assert stat.S_IMODE(lock_path(tmp_path, 3).stat().st_mode) == 0o640
    with pytest.raises(RootInUse):
        RootLock.acquire(tmp_path, LockOwner.this_process(3, "/run/y.sock"))
    other = RootLock.acquire(tmp_path, LockOwner.this_process(4, "/run/z.sock"))  # another node of a shared root
    assert other.others() == [f"node 3 ({LockOwner.from_json(lock_path(tmp_path, 3).read_bytes()).describe()})"]  # type: ignore[union-attr]
    lock.release()
    assert other.others() == []
    RootLock.acquire(tmp_path, LockOwner.this_process(3, "/run/y.sock")).release()
    other.release()


# issue 30 finding 4
def test_a_killed_holder_frees_the_lock(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time; from pathlib import Path; from ckptd.daemon.storage.root_lock import RootLock, LockOwner; "
            f"RootLock.acquire(Path({str(tmp_path)!r}), LockOwner.this_process(0, 'held.sock')); print('held', flush=True); time.sleep(60)"
        )],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RootInUse, match=f"pid {holder.pid}"):
            RootLock.acquire(tmp_path, LockOwner.this_process(0, "mine.sock"))
    finally:
        holder.kill()
        holder.wait()
    RootLock.acquire(tmp_path, LockOwner.this_process(0, "mine.sock")).release()  # SIGKILL dropped it


@pytest.mark.parametrize("planted", ["symlink", "hardlink", "fifo", "directory"])
def test_a_planted_lock_file_is_refused_and_left_as_it_is(tmp_path: Path, planted: str) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    root = tmp_path / "root"
    root.mkdir()
    path = lock_path(root, 0)
    {"symlink": lambda: path.symlink_to(victim), "hardlink": lambda: os.link(victim, path),
     "fifo": lambda: os.mkfifo(path), "directory": lambda: path.mkdir()}[planted]()
    with pytest.raises(RootInUse, match="lock"):
        RootLock.acquire(root, LockOwner.this_process(0, "s.sock"))
    assert victim.read_text() == "precious" and os.path.lexists(path)


def _no_file_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that refuses file locks (NFS without a lock manager: ENOLCK)."""
    def refuse(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(root_lock.fcntl, "flock", refuse)


# issue 30 finding 4
def test_without_file_locks_a_live_daemon_of_this_host_is_still_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    _no_file_locks(monkeypatch)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "ckptd", "serve"])  # a ckptd by its command line
    try:
        while b"ckptd" not in Path(f"/proc/{live.pid}/cmdline").read_bytes():  # exec'd
            time.sleep(0.01)
        lock_path(tmp_path, 0).write_bytes(LockOwner(socket.gethostname(), live.pid, "/run/live.sock", 0, 1.0).to_json())
        with pytest.raises(RootInUse, match=f"pid {live.pid}"):
            RootLock.acquire(tmp_path, LockOwner.this_process(0, "s.sock"))
    finally:
        live.kill()
        live.wait()
    lock = RootLock.acquire(tmp_path, LockOwner.this_process(0, "s.sock"))  # its daemon is gone: taken over, with a warning
    assert not lock.locked and "does not support file locks" in caplog.text and lock.others() == []
    lock.release()
