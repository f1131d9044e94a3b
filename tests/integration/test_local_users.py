"""Local users cannot redirect or read another user's data (issue 30 finding 9), against a real
daemon running as root: a link or a file planted at a load's staging path in shared memory,
a socket directory another user made, and the mode of the root the daemon makes. Other users
are other uids (subprocesses started as `nobody`, directories chowned to a spare uid)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient
from ckptd.client.errors import CheckpointError
from daemon_rig import DaemonFactory

NOBODY = 65534
OTHER_UID = 65533
DATA_FILE = "model-00001-of-00001.safetensors"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the daemon must run as root, the attacker as another uid")


def _staging_name(daemon_pid: int, job: str, step: int) -> str:
    """Where a daemon stages a step's data file for a load (engine/staging.StagingFiles.path)."""
    return f"ckptd-{daemon_pid}-fetch-{job}-{step}-{DATA_FILE}"


def _save_two_steps(address: str, job: str) -> torch.nn.Module:
    """Steps 1 and 2 of `job`; returns step 1's model (step 2 is the one held in memory, so a load
    of step 1 with read_files=False is staged through shared memory)."""
    torch.manual_seed(9)
    first = torch.nn.Linear(64, 64)
    with CheckpointClient(job, address=address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": first}).wait_durable(timeout=60)
        ckpt.save(2, {"model": torch.nn.Linear(64, 64)}).wait_durable(timeout=60)
    return first


def _load_step_1(address: str, job: str) -> torch.nn.Module:
    restored = torch.nn.Linear(64, 64)
    torch.nn.init.zeros_(restored.weight)
    with CheckpointClient(job, address=address, on_error="raise", read_files=False) as ckpt:
        assert ckpt.load({"model": restored}, step=1) == 1
    return restored


# issue 30 finding 9 (a)
def test_a_file_another_user_plants_at_a_staging_path_in_shared_memory_receives_nothing(tmp_path: Path) -> None:
    shared = Path(tempfile.mkdtemp(prefix="ckptd-test-", dir="/dev/shm"))
    os.chmod(shared, 0o1777)  # shared memory as on every host: /dev/shm is 1777
    factory = DaemonFactory(tmp_path / "root")
    shutil.rmtree(factory.shm_dir)
    factory.shm_dir = shared
    try:
        daemon = factory.start()
        model = _save_two_steps(daemon.address, "victim")
        bait = shared / _staging_name(daemon.pid, "victim", 1)
        subprocess.run(["sh", "-c", 'umask 0; : > "$1"', "sh", str(bait)], user=NOBODY, group=NOBODY, check=True)
        assert bait.stat().st_uid == NOBODY and bait.stat().st_size == 0

        restored = _load_step_1(daemon.address, "victim")

        assert torch.equal(restored.weight, model.weight)
        assert bait.stat().st_size == 0  # the planter reads nothing of the victim's tensors
        own = shared / f"ckptd-user-{os.geteuid()}"
        assert stat.S_IMODE(own.stat().st_mode) == 0o750 and own.stat().st_uid == os.geteuid()
        assert not [p for p in shared.iterdir() if p.is_file() and p != bait]  # arenas and staging live in `own`
    finally:
        factory.close()


# issue 30 finding 9 (a)
def test_a_link_planted_at_a_staging_path_is_not_written_through(daemons, tmp_path: Path) -> None:
    daemon = daemons.start()
    model = _save_two_steps(daemon.address, "victim")
    secret = tmp_path / "victim-file"
    secret.write_bytes(b"another user's file")
    link = daemons.shm_dir / _staging_name(daemon.pid, "victim", 1)
    link.symlink_to(secret)

    with pytest.raises(CheckpointError) as refused:
        _load_step_1(daemon.address, "victim")
    assert secret.read_bytes() == b"another user's file" and link.is_symlink()  # nothing written through the link
    assert "not the one this daemon created" in str(refused.value)

    link.unlink()
    assert torch.equal(_load_step_1(daemon.address, "victim").weight, model.weight)  # the daemon is fine


def _serve(tmp_path: Path, socket_path: Path, root: Path | None = None, umask: int | None = None) -> subprocess.CompletedProcess[str]:
    shm = tempfile.mkdtemp(prefix="ckptd-test-", dir="/dev/shm")
    cmd = [sys.executable, "-m", "ckptd.daemon.app.cli", "serve", "--root", str(root or tmp_path / "root"), "--socket", str(socket_path), "--shm-dir", shm]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, preexec_fn=None if umask is None else (lambda: os.umask(umask)))
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# issue 30 finding 9 (b)
def test_a_socket_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "sockets"
    planted.mkdir()
    os.chmod(planted, 0o777)
    os.chown(planted, OTHER_UID, OTHER_UID)

    out = _serve(tmp_path, planted / "ckptd.sock")

    assert out.returncode == 1, out.stderr[-2000:]
    assert f"owned by uid {OTHER_UID}" in out.stderr and "another user could replace the socket" in out.stderr
    assert list(planted.iterdir()) == []


# issue 30 finding 9 (b)
def test_a_group_writable_socket_directory_is_refused_with_the_fix(tmp_path: Path) -> None:
    shared = tmp_path / "run-ckptd"
    shared.mkdir()
    os.chmod(shared, 0o770)  # the old RuntimeDirectoryMode: every trainer in the group could swap the socket
    out = _serve(tmp_path, shared / "ckptd.sock")
    assert out.returncode == 1 and "writable by its group" in out.stderr and f"chmod go-w {shared}" in out.stderr
    assert list(shared.iterdir()) == []


# issue 30 finding 9 (c)
def test_the_root_the_daemon_makes_is_0750(daemons) -> None:
    assert not daemons.root.exists()
    daemons.start()
    assert stat.S_IMODE(daemons.root.stat().st_mode) == 0o750
