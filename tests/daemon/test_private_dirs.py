"""Directories no other local user can change (private_dirs.py; issue 30 finding 9): the rule,
the daemon's directory in a shared /dev/shm, files created never through a link, and the
socket's directory of a daemon that is not root. Run as root; other users are other uids
(chown, and a forked child that drops to another uid)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from ckptd.common.paths import default_socket
from ckptd.daemon.tiers.replica_store import Receipt, ReplicaStore
from ckptd.daemon.engine.staging import StagingFiles
from ckptd.daemon.errors import Precondition
from ckptd.format.index import FileRecord
from ckptd.format.units import Unit
from ckptd.daemon.private_dirs import ShmDirUnsafe, SocketDirUnsafe, create_file, dir_problem, files_dir, prepare_socket_dir

OTHER_UID = 65533  # a user that is neither root nor the daemon (no account needed: chown takes a number)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give directories to another uid")


def _dir(path: Path, mode: int, uid: int = 0) -> Path:
    path.mkdir()
    os.chmod(path, mode)
    os.chown(path, uid, -1)
    return path


# issue 30 finding 9
@pytest.mark.parametrize(
    ("mode", "uid", "problem"),
    [
        (0o700, 0, None), (0o750, 0, None), (0o755, 0, None), (0o1777, 0, None), (0o1770, 0, None),
        (0o770, 0, "writable by its group"), (0o777, 0, "writable by its group and every user"), (0o757, 0, "every user"),
        (0o750, OTHER_UID, f"owned by uid {OTHER_UID}"), (0o1777, OTHER_UID, f"owned by uid {OTHER_UID}"),
    ],
)
def test_a_directory_is_private_when_only_its_owner_the_daemon_or_root_can_change_it(tmp_path: Path, mode: int, uid: int, problem: str | None) -> None:
    found = dir_problem(_dir(tmp_path / "d", mode, uid))
    assert found is None if problem is None else problem in (found or "")


# issue 30 finding 9 (b)
@pytest.mark.parametrize(("mode", "uid", "says"), [(0o750, OTHER_UID, f"owned by uid {OTHER_UID}"), (0o770, 0, "chmod go-w")])
def test_a_socket_directory_another_user_can_change_is_refused_with_the_fix(tmp_path: Path, mode: int, uid: int, says: str) -> None:
    directory = _dir(tmp_path / "sock", mode, uid)
    with pytest.raises(SocketDirUnsafe) as refused:
        prepare_socket_dir(directory)
    assert says in str(refused.value) and "--socket" in str(refused.value)
    assert list(directory.iterdir()) == []


# issue 30 finding 9 (b)
def test_a_missing_socket_directory_is_made_0750_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        prepare_socket_dir(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o750


# issue 30 finding 9 (b)
def test_a_non_root_daemon_refuses_the_tmp_socket_directory_another_user_made_first(tmp_path: Path) -> None:
    """Without $XDG_RUNTIME_DIR a user's daemon serves from /tmp/ckptd-<uid>; another user who
    made that directory first could swap the socket. The check runs as that user, in a child."""
    from ckptd.daemon.app.server import _prepare_socket

    victim, attacker = 61234, 61235
    planted = Path(f"/tmp/ckptd-{victim}")  # default_socket({}) of uid `victim`
    planted.mkdir(mode=0o777, exist_ok=False)
    try:
        os.chmod(planted, 0o777)
        os.chown(planted, attacker, attacker)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the victim's daemon: no XDG_RUNTIME_DIR
            os.close(read)
            code = 0
            try:
                os.setgid(victim)
                os.setuid(victim)
                _prepare_socket(default_socket({}))
            except SocketDirUnsafe as exc:
                os.write(write, str(exc).encode()[:4000])
                code = 3
            except BaseException as exc:  # noqa: BLE001 - reported to the parent through the exit code
                os.write(write, repr(exc).encode()[:4000])
                code = 4
            os._exit(code)
        os.close(write)
        message = b""
        while chunk := os.read(read, 4096):
            message += chunk
        os.close(read)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 3, message.decode()
        assert f"owned by uid {attacker}" in message.decode() and "XDG_RUNTIME_DIR" in message.decode()
        assert list(planted.iterdir()) == []  # no socket served from the attacker's directory
    finally:
        for p in planted.iterdir():
            p.unlink()
        planted.rmdir()


# issue 30 finding 9 (a)
def test_shared_memory_files_go_to_the_daemons_own_directory_of_a_shared_sticky_one(tmp_path: Path) -> None:
    private = _dir(tmp_path / "private", 0o700)
    assert files_dir(private) == private
    shared = _dir(tmp_path / "shm", 0o1777)
    own = files_dir(shared)
    assert own == shared / f"ckptd-user-{os.geteuid()}" and stat.S_IMODE(own.stat().st_mode) == 0o750
    assert files_dir(shared) == own  # the next start takes it again
    with pytest.raises(ShmDirUnsafe, match="sticky"):
        files_dir(_dir(tmp_path / "open", 0o777))


# issue 30 finding 9 (a)
@pytest.mark.parametrize("planted", ["another user's directory", "a link", "a group-writable directory"])
def test_the_daemons_shared_memory_directory_made_by_someone_else_is_refused(tmp_path: Path, planted: str) -> None:
    shared = _dir(tmp_path / "shm", 0o1777)
    own = shared / f"ckptd-user-{os.geteuid()}"
    if planted == "a link":
        _dir(tmp_path / "elsewhere", 0o777, OTHER_UID)
        own.symlink_to(tmp_path / "elsewhere")
    elif planted == "another user's directory":
        _dir(own, 0o777, OTHER_UID)
    else:
        _dir(own, 0o770, OTHER_UID)
    with pytest.raises(ShmDirUnsafe, match="Remove it"):
        files_dir(shared)
    assert os.path.lexists(own)


# issue 30 finding 9 (a)
@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_files_are_never_created_through_a_link_or_into_a_planted_file(tmp_path: Path, planted: str) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "ckptd-1-job-s0-g1-r0"
    path.symlink_to(victim) if planted == "symlink" else path.write_text("")
    with pytest.raises(FileExistsError):
        create_file(path, 0o660)
    assert victim.read_text() == "precious"
    fd = create_file(tmp_path / "new", 0o660)
    os.close(fd)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o660


# issue 30 finding 9 (a)
def test_a_planted_staging_file_fails_the_load_and_receives_nothing(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    staging = StagingFiles(tmp_path)
    path = staging.path("job", 1, "model-00001-of-00001.safetensors")
    path.symlink_to(victim)
    with pytest.raises(Precondition, match="not the one this daemon created"):
        staging.open(str(path))
    path.unlink()
    fd = staging.open(str(path))  # made here: its other ranges reopen it
    os.close(fd)
    path.unlink()
    path.symlink_to(victim)  # swapped after it was made
    with pytest.raises(Precondition, match="not the one this daemon created"):
        staging.open(str(path))
    assert staging.detach(path) is None  # not its file any more: left as it is
    assert os.path.islink(path) and victim.read_text() == "precious"


# issue 30 finding 9 (a)
def test_a_replica_part_is_not_received_through_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    store = ReplicaStore(tmp_path, 1 << 20)
    record = FileRecord("model-00001-of-00001.safetensors", 16, "xxh3-64:0000000000000000", 0)
    receipt = store.offer("job", 1, 5, [record], {record.name: (Unit(0, record.size, 0),)})
    assert isinstance(receipt, Receipt)
    part = receipt.parts[record.name]
    part.symlink_to(victim)
    with pytest.raises(FileExistsError):
        ReplicaStore.create_parts(receipt)
    assert victim.read_text() == "precious" and os.path.islink(part)  # nothing written, nothing removed


def test_the_file_system_of_the_shared_memory_directory_is_known(tmp_path: Path) -> None:
    """A new user's probe: `--shm-dir` with a typo made a directory on the disk and served from it
    without a word; the daemon now warns when the directory is not on a file system in memory."""
    from ckptd.daemon.app.server import MEMORY_FILE_SYSTEMS, mount_of, shm_dir_notice

    assert mount_of(Path("/dev/shm"))[0] in MEMORY_FILE_SYSTEMS
    kind, _ = mount_of(tmp_path)
    assert kind  # whatever it is (ext4, overlay, or a tmpfs /tmp): known from /proc/mounts
    assert mount_of(Path("/proc/self")) == ("proc", mount_of(Path("/proc"))[1])
    on_disk = shm_dir_notice("ext4", "rw,relatime")
    assert on_disk is not None and on_disk[0] == logging.WARNING and "is on ext4, not a file system in memory" in on_disk[1]
    small_pages = shm_dir_notice("tmpfs", "rw,nosuid,nodev")
    assert small_pages is not None and small_pages[0] == logging.INFO and "huge=always" in small_pages[1]
    assert shm_dir_notice("tmpfs", "rw,huge=always") is None
    unknown = shm_dir_notice("", "")  # /proc/mounts unreadable: not warned about
    assert unknown is not None and unknown[0] == logging.INFO
