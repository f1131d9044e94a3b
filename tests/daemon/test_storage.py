"""storage.py: the write-back hint and the staging copy (the rest of Storage is exercised
through the pipeline and retention tests)."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from ckptd.format.index import INDEX_NAME, PREPARED_NAME, CheckpointIndex, FormatError
from ckptd.daemon import storage as storage_module
from ckptd.daemon.storage import posix_janitor
from ckptd.daemon.storage import ROOT_ID_FILE, ForeignEntry, RecycledFile, Storage, is_job_dir, is_storage_root, open_for_reading, read_file, start_writeback, write_small_file
from ckptd.daemon.storage.fs import new_file



def _prepared(storage: Storage, job: str, step: int, fresh: bool = True) -> Path:
    """The directory of a step just prepared (StepWriting.prepare_step)."""
    storage.writing.prepare_step(job, step, fresh)
    return storage.tree.step_dir(job, step)

def test_start_writeback_is_taken_and_leaves_the_bytes_as_written(tmp_path: Path) -> None:
    path = tmp_path / "data"
    data = os.urandom(3 * 4096 + 17)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o640)
    try:
        os.pwrite(fd, data, 0)
        taken = [start_writeback(fd, 0, len(data)), start_writeback(fd, 4096, 100)]  # the second: inside, not page aligned
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    if sys.platform == "linux":  # the hint exists here: a broken binding would silently do nothing
        assert taken == [True, True]


def test_start_writeback_refused_is_a_debug_message_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    read_end, write_end = os.pipe()  # sync_file_range refuses pipes (ESPIPE)
    try:
        with caplog.at_level(logging.DEBUG, logger="ckptd.daemon.storage"):
            assert start_writeback(write_end, 0, 10) is False
    finally:
        os.close(read_end)
        os.close(write_end)
    assert any("sync_file_range" in r.getMessage() and "fsync" in r.getMessage() for r in caplog.records)


def _step_file(root: Path, data: bytes) -> Storage:
    storage = Storage(root)
    step_dir = storage.tree.step_dir("job", 1)
    step_dir.mkdir(parents=True)
    (step_dir / "data.safetensors").write_bytes(data)
    return storage


def test_copy_range_copies_to_the_same_offset(tmp_path: Path) -> None:
    data = os.urandom(3 * 2**20 + 5)
    storage = _step_file(tmp_path / "root", data)
    out = tmp_path / "staging"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o640)
    try:
        storage.files.copy_range("job", 1, "data.safetensors", fd, 1000, 2**20 + 3)
        storage.files.copy_range("job", 1, "data.safetensors", fd, 2 * 2**20, 2**20 + 5)  # a second range, to the end
    finally:
        os.close(fd)
    staged = out.read_bytes()
    assert staged[1000 : 1000 + 2**20 + 3] == data[1000 : 1000 + 2**20 + 3]
    assert staged[2 * 2**20 :] == data[2 * 2**20 :]
    assert staged[:1000] == bytes(1000)  # nothing outside the ranges


def test_copy_range_of_a_short_file_says_where_it_ends(tmp_path: Path) -> None:
    storage = _step_file(tmp_path / "root", b"x" * 100)
    fd = os.open(tmp_path / "staging", os.O_WRONLY | os.O_CREAT, 0o640)
    try:
        with pytest.raises(FormatError, match="ends at byte 100, before the 50 bytes its index gives from 80"):
            storage.files.copy_range("job", 1, "data.safetensors", fd, 80, 50)
    finally:
        os.close(fd)


# Issue 20, findings 2 and 3: nothing under the root is followed as a link or trusted by its name
# alone, and modes are 0640 / 0750 whatever the umask.


@pytest.fixture
def umask_007() -> Iterator[None]:
    """The umask of the shipped systemd unit (UMask=0007) while the test runs."""
    old = os.umask(0o007)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _committed_step(storage: Storage, job: str, step: int, data: bytes) -> Path:
    """A committed step of `job` with one data file (another job's shard, for the link to aim at)."""
    step_dir = _prepared(storage, job, step)
    (step_dir / "model-00001-of-00001.safetensors").write_bytes(data)
    write_small_file(step_dir / INDEX_NAME, b"{}")
    return step_dir / "model-00001-of-00001.safetensors"


def _recycled_bin(storage: Storage, job: str, sizes: list[int]) -> Path:
    """The job's recycle bin holding files of `sizes`, made the daemon's way (a step removed)."""
    step_dir = _prepared(storage, job, 99)
    for i, size in enumerate(sizes):
        (step_dir / f"model-{i:05d}.safetensors").write_bytes(b"r" * size)
    storage.janitor.remove_step(job, 99, recycle=True)
    return storage.tree.recycle_dir(job)


def _only(bin_dir: Path) -> Path:
    """The one entry of the bin (its name is the daemon's to choose)."""
    (entry,) = bin_dir.iterdir()
    return entry


def test_take_recycled_accepts_only_the_daemons_own_regular_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    storage = Storage(tmp_path / "root")
    victim = _committed_step(storage, "a", 1, b"A" * 5000)
    before = victim.read_bytes()
    bin_dir = _recycled_bin(storage, "b", [3000])
    own = _only(bin_dir)
    (bin_dir / "link").symlink_to(victim)
    os.link(victim, bin_dir / "hard")  # nlink 2: another job's committed shard
    os.mkfifo(bin_dir / "fifo")
    (bin_dir / "dir").mkdir()
    with caplog.at_level(logging.WARNING, logger="ckptd.daemon.storage"):
        assert storage.writing.take_recycled("b") == [RecycledFile(str(own), 3000)]
    warned = " ".join(r.getMessage() for r in caplog.records)
    for name, what in (("link", "a symbolic link"), ("hard", "2 hard links"), ("fifo", "a FIFO"), ("dir", "a directory")):
        assert f"{bin_dir / name} in the recycle bin alone: it is " in warned and what in warned, (name, warned)
    assert sorted(p.name for p in bin_dir.iterdir()) == sorted([own.name, "dir", "fifo", "hard", "link"])  # all left in place
    assert victim.read_bytes() == before and os.readlink(bin_dir / "link") == str(victim)


def test_a_recycle_bin_that_is_a_link_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    storage = Storage(tmp_path / "root")
    victim = _committed_step(storage, "a", 1, b"A" * 5000)
    before = victim.read_bytes()
    _prepared(storage, "b", 1)
    storage.tree.recycle_dir("b").symlink_to(victim.parent)  # another job's committed step as the bin
    with caplog.at_level(logging.WARNING, logger="ckptd.daemon.storage"):
        assert storage.writing.take_recycled("b") == []
        step_dir = _prepared(storage, "b", 2)
        (step_dir / "model-00001-of-00001.safetensors").write_bytes(b"B" * 100)
        storage.janitor.remove_step("b", 2, recycle=True)  # the bin is not emptied, nothing moves into it
    assert "not directory the daemon made" not in caplog.text and f"{storage.tree.recycle_dir('b')} is a symbolic link" in caplog.text
    assert storage.tree.recycle_dir("b").is_symlink()
    assert sorted(p.name for p in victim.parent.iterdir()) == [INDEX_NAME, victim.name] and victim.read_bytes() == before


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo"])
def test_open_recycled_never_opens_truncates_or_moves_a_foreign_entry(tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    storage = Storage(tmp_path / "root")
    victim = _committed_step(storage, "a", 1, b"A" * 5000)
    before = victim.read_bytes()
    bin_dir = _recycled_bin(storage, "b", [])
    entry = bin_dir / "00000"
    if kind == "symlink":
        entry.symlink_to(victim)
    elif kind == "hardlink":
        os.link(victim, entry)
    else:
        os.mkfifo(entry)
    dest = _prepared(storage, "b", 2) / ".tmp-model.safetensors.1"
    with caplog.at_level(logging.WARNING, logger="ckptd.daemon.storage"):
        assert storage_module.open_recycled(entry, dest) is None  # e.g. swapped in after take_recycled looked
    assert f"leaving {entry} in the recycle bin alone" in caplog.text
    assert os.path.lexists(entry) and not os.path.lexists(dest)
    assert victim.read_bytes() == before


def test_open_recycled_takes_the_daemons_own_file_as_a_0640_file(tmp_path: Path, umask_007: None) -> None:
    storage = Storage(tmp_path / "root")
    own = _only(_recycled_bin(storage, "b", [4096]))
    os.chmod(own, 0o660)  # as an older version under UMask=0007 left it
    dest = _prepared(storage, "b", 2) / ".tmp-model.safetensors.1"
    fd = storage_module.open_recycled(own, dest)
    assert fd is not None
    try:
        os.pwrite(fd, b"new", 0)
    finally:
        os.close(fd)
    assert not own.exists() and dest.read_bytes()[:4] == b"newr" and _mode(dest) == 0o640


def test_open_recycled_takes_a_file_the_bin_trim_unlinked_meanwhile_as_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Found by an attacker's probe: under many back-to-back saves the daemon's own trim of the
    bin unlinked a file another save had just opened, which was then warned about as "a file
    with 0 hard links, which the daemon did not make". It is gone, as if never found: quietly."""
    storage = Storage(tmp_path / "root")
    own = _only(_recycled_bin(storage, "b", [4096]))
    dest = _prepared(storage, "b", 2) / ".tmp-model.safetensors.1"
    real_open = os.open

    def open_then_trimmed(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        fd = real_open(path, flags, mode, dir_fd=dir_fd)
        if path == own.name:
            os.unlink(path, dir_fd=dir_fd)  # the trim, between the open and the checks
        return fd

    monkeypatch.setattr(os, "open", open_then_trimmed)
    with caplog.at_level(logging.WARNING, logger="ckptd.daemon.storage"):
        assert storage_module.open_recycled(own, dest) is None
    assert "leaving" not in caplog.text and not os.path.lexists(dest)


def test_create_file_does_not_follow_a_link_and_replaces_only_its_own_leftover(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    link = tmp_path / "link"
    link.symlink_to(victim)
    with pytest.raises(OSError, match="is a symbolic link, which the daemon did not make"):
        storage_module.create_file(link)
    os.link(victim, tmp_path / "hard")
    with pytest.raises(OSError, match="is a file with 2 hard links"):
        storage_module.create_file(tmp_path / "hard")
    assert victim.read_bytes() == b"keep" and link.is_symlink()
    leftover = tmp_path / "leftover"
    leftover.write_bytes(b"old attempt")
    os.close(storage_module.create_file(leftover))
    assert leftover.read_bytes() == b""


# issue 30 review: the one "new file, never through a link" of the daemon (fs.create_file,
# private_dirs.create_file and the node lock all make theirs with it)
def test_new_file_has_its_mode_whatever_the_umask_and_never_goes_through_a_link(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        fd = new_file(tmp_path / "shm-file", 0o660, access=os.O_RDWR)
    finally:
        os.umask(old)
    try:
        os.pwrite(fd, b"abc", 0)
        assert os.pread(fd, 3, 0) == b"abc"  # read-write when asked
    finally:
        os.close(fd)
    assert _mode(tmp_path / "shm-file") == 0o660
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (tmp_path / "link").symlink_to(victim)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in ("link", "victim"):
            with pytest.raises(FileExistsError):
                new_file(name, 0o640, dir_fd)
    finally:
        os.close(dir_fd)
    assert victim.read_bytes() == b"keep" and (tmp_path / "link").is_symlink()


def test_write_small_file_neither_writes_through_nor_replaces_a_link(tmp_path: Path, umask_007: None) -> None:
    storage = Storage(tmp_path / "root")
    victim = _committed_step(storage, "a", 1, b"A" * 100)
    before = victim.read_bytes()
    _prepared(storage, "b", 1)
    latest = storage.tree.job_dir("b") / "latest"
    latest.symlink_to(victim)
    with pytest.raises(ForeignEntry, match=f"{latest} is a symbolic link, which the daemon did not make: it is not replaced"):
        storage.writing.write_latest("b", 1)
    assert victim.read_bytes() == before and os.readlink(latest) == str(victim)
    assert sorted(p.name for p in latest.parent.iterdir()) == ["latest", "step-00000001"]  # no temporary file left
    latest.unlink()
    storage.writing.write_latest("b", 1)
    assert not latest.is_symlink() and latest.read_text() == "step-00000001\n" and _mode(latest) == 0o640
    linked_dir = storage.tree.job_dir("c")
    linked_dir.symlink_to(victim.parent)  # a job directory that is a link: not written into
    with pytest.raises(OSError, match="is a symbolic link, not a directory the daemon made"):
        storage.writing.write_latest("c", 1)
    assert sorted(p.name for p in victim.parent.iterdir()) == [INDEX_NAME, victim.name]


def test_modes_are_0640_and_0750_whatever_the_umask(tmp_path: Path, umask_007: None) -> None:
    storage = Storage(tmp_path / "root")
    step_dir = _committed_step(storage, "job", 1, b"x").parent
    storage.writing.write_latest("job", 1)
    storage.janitor.mark_prepared("job", 1, "save", 0)
    _recycled_bin(storage, "job", [10])
    assert _mode(storage.tree.job_dir("job")) == 0o750 and _mode(step_dir) == 0o750 and _mode(storage.tree.recycle_dir("job")) == 0o750
    for name in (INDEX_NAME, PREPARED_NAME):
        assert _mode(step_dir / name) == 0o640, name
    assert _mode(storage.tree.job_dir("job") / "latest") == 0o640
    for path in (storage.tree.job_dir("job"), storage.tree.recycle_dir("job")):
        os.chmod(path, 0o770)  # as an older version made them under UMask=0007
    _recycled_bin(storage, "job", [10])
    assert _mode(storage.tree.job_dir("job")) == 0o750 and _mode(storage.tree.recycle_dir("job")) == 0o750


def test_a_step_directory_that_is_a_link_is_neither_followed_nor_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    storage = Storage(tmp_path / "root")
    victim = _committed_step(storage, "a", 1, b"A" * 100)
    uncommitted = _prepared(storage, "a", 2)
    (uncommitted / ".tmp-x.1").write_bytes(b"a's temporary file")
    storage.janitor.mark_prepared("a", 2, "save", 1)  # a node's prepared part: kept by a's clean-up
    _prepared(storage, "b", 1)
    _prepared(storage, "b", 7)
    for step, target in ((5, victim.parent), (6, uncommitted)):
        storage.tree.step_dir("b", step).symlink_to(target)
    (storage.tree.job_dir("b") / ".tmp-planted.1").symlink_to(victim)
    (storage.tree.job_dir("b") / ".deleting-step-00000007").symlink_to(victim.parent)
    with caplog.at_level(logging.WARNING, logger="ckptd.daemon.storage"):
        storage.janitor.remove_step("b", 5, recycle=True)
        storage.janitor.remove_step("b", 7)  # its `.deleting-` name is taken by a link to a's step
        with pytest.raises(OSError, match="is a symbolic link, not a step directory the daemon made"):
            _prepared(storage, "b", 6)
        storage.janitor.unmark_prepared("b", 6)
        storage.janitor.discard_part("b", 6, [".tmp-x.1"], shared=True)
        storage.janitor.leftovers("b", set())
        storage.janitor.clean_uncommitted()
    assert "leaving " in caplog.text and "symbolic link" in caplog.text
    for step in (5, 6):
        assert storage.tree.step_dir("b", step).is_symlink(), step
    assert (storage.tree.job_dir("b") / ".tmp-planted.1").is_symlink() and (storage.tree.job_dir("b") / ".deleting-step-00000007").is_symlink()
    assert sorted(p.name for p in victim.parent.iterdir()) == [INDEX_NAME, victim.name] and victim.read_bytes() == b"A" * 100
    assert not os.path.lexists(storage.tree.step_dir("b", 7))  # removed under another name
    assert sorted(p.name for p in uncommitted.iterdir()) == [".tmp-x.1", PREPARED_NAME]  # nothing removed through the link


def test_a_job_directory_that_is_a_link_is_not_a_job(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "root")
    _committed_step(storage, "a", 1, b"A")
    storage.tree.job_dir("b").symlink_to(storage.tree.job_dir("a"))
    assert storage.catalog.jobs() == ["a"]
    with pytest.raises(OSError, match="is a symbolic link, not a directory the daemon made"):
        _prepared(storage, "b", 2)
    assert sorted(p.name for p in storage.tree.job_dir("a").iterdir()) == ["step-00000001"]


def test_recycling_leaves_foreign_entries_in_the_bin_and_takes_other_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = Storage(tmp_path / "root")
    victim = _committed_step(storage, "a", 1, b"A" * 100)
    bin_dir = _recycled_bin(storage, "b", [7])
    first = _only(bin_dir)
    first.unlink()
    first.symlink_to(victim)
    monkeypatch.setattr(posix_janitor.time, "time_ns", lambda: 0xABC)  # the names the next removal would take
    os.mkfifo(bin_dir / "abc-00000")
    _recycled_bin(storage, "b", [5, 6])  # the next step removed: its two files go in beside them
    assert os.readlink(first) == str(victim) and stat.S_ISFIFO(os.lstat(bin_dir / "abc-00000").st_mode)
    assert sorted((p.name, p.stat().st_size) for p in bin_dir.iterdir() if p.name not in (first.name, "abc-00000")) == [("abc-00001", 5), ("abc-00002", 6)]
    assert victim.read_bytes() == b"A" * 100


def test_the_bin_never_reuses_a_name_a_save_may_be_taking(tmp_path: Path) -> None:
    """Found in review: the bin was emptied and refilled under the same names (00000, ...); a save
    that had opened 00000 before and renamed it after moved the new file instead, found another
    inode than it had checked, and failed ("is not the daemon's file"). Each refill's names are new."""
    storage = Storage(tmp_path / "root")
    first = _only(_recycled_bin(storage, "b", [7]))
    second = _only(_recycled_bin(storage, "b", [9]))
    assert second.name != first.name and not first.exists()


def test_copy_range_and_read_index_do_not_follow_links(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "root")
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 100)
    step_dir = _prepared(storage, "job", 1)
    (step_dir / "data.safetensors").symlink_to(secret)
    (step_dir / INDEX_NAME).symlink_to(secret)
    fd = os.open(tmp_path / "staging", os.O_WRONLY | os.O_CREAT, 0o640)
    try:
        with pytest.raises(OSError, match="is a symbolic link"):
            storage.files.copy_range("job", 1, "data.safetensors", fd, 0, 10)
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="is a symbolic link"):
        storage.files.read_index("job", 1)
    assert (tmp_path / "staging").read_bytes() == b""


def test_a_planted_step_directory_link_is_not_listed_loaded_or_deleted_through(tmp_path: Path) -> None:
    """Issue 20: committed_steps / is_committed followed `step-00000099 -> /elsewhere`."""
    storage = Storage(tmp_path / "root")
    victim = _committed_step(storage, "a", 1, b"A" * 100)  # a committed step elsewhere: what the link aims at
    _committed_step(storage, "b", 1, b"B")
    storage.tree.step_dir("b", 99).symlink_to(victim.parent)
    storage.tree.step_dir("b", 98).symlink_to(tmp_path)  # no index there at all
    (storage.tree.step_dir("b", 1) / "x").mkdir()
    assert storage.catalog.committed_steps("b") == [1] and storage.catalog.commit_order("b") == [1] and storage.catalog.latest_step("b") == 1
    assert not storage.catalog.is_committed("b", 99) and storage.catalog.is_committed("b", 1)
    with pytest.raises(ForeignEntry, match="is a symbolic link, not a directory the daemon made"):
        storage.files.read_index("b", 99)
    with pytest.raises(ForeignEntry, match="step-00000099 is a symbolic link"):
        storage.tree.open_step_file("b", 99, victim.name)
    storage.janitor.remove_step("b", 99, recycle=True)
    assert storage.tree.step_dir("b", 99).is_symlink() and sorted(p.name for p in victim.parent.iterdir()) == [INDEX_NAME, victim.name]
    assert victim.read_bytes() == b"A" * 100


@pytest.mark.parametrize("kind", ["symlink", "fifo", "dir"])
def test_open_for_reading_neither_follows_nor_blocks(tmp_path: Path, kind: str) -> None:
    """A link, a FIFO (which a blocking open would wait on forever) or a directory where a file
    is read raises ForeignEntry naming it; a regular file is read."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"secret")
    path = tmp_path / "file"
    {"symlink": lambda: path.symlink_to(secret), "fifo": lambda: os.mkfifo(path), "dir": lambda: path.mkdir()}[kind]()
    with pytest.raises(ForeignEntry, match=f"{path} is a "):
        open_for_reading(path)
    with pytest.raises(ForeignEntry, match=f"{path} is a "):
        read_file(path)
    assert read_file(secret) == b"secret"
    with pytest.raises(OSError, match="larger than the 3 bytes"):
        read_file(secret, limit=3)


def test_retention_leaves_a_committed_step_that_holds_what_the_daemon_did_not_write(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "root")
    victim = tmp_path / "victim"
    victim.write_bytes(b"v")
    shard = _committed_step(storage, "a", 1, b"A")
    (shard.parent / "planted").symlink_to(victim)
    with pytest.raises(ForeignEntry, match=r"step directory .*step-00000001 is not deleted: it holds what the daemon did not write: .*planted \(a symbolic link\)"):
        storage.janitor.remove_step("a", 1, recycle=True)
    assert storage.catalog.committed_steps("a") == [1] and shard.read_bytes() == b"A"
    (shard.parent / "planted").unlink()
    storage.janitor.remove_step("a", 1, recycle=True)
    assert storage.catalog.committed_steps("a") == [] and victim.read_bytes() == b"v"

    # an uncommitted attempt: the daemon's own files go, the foreign one stays, and a save of that step says why it cannot start
    step_dir = _prepared(storage, "a", 2)
    (step_dir / "own.safetensors").write_bytes(b"x")
    os.mkfifo(step_dir / "fifo")
    storage.janitor.remove_step("a", 2)
    assert sorted(p.name for p in step_dir.iterdir()) == ["fifo"]
    with pytest.raises(ForeignEntry, match=r"step-00000002 holds what the daemon did not write: .*fifo \(a FIFO\)"):
        _prepared(storage, "a", 2)
    assert storage.janitor.leftovers("a", set()) == [] and stat.S_ISFIFO(os.lstat(step_dir / "fifo").st_mode)


def test_the_root_id_file_is_0640_and_never_followed(tmp_path: Path, umask_007: None) -> None:
    """Issue 20: cluster.root_id wrote 0644 (umask permitting) and opened without O_NOFOLLOW."""
    from ckptd.daemon.storage import ROOT_ID_FILE

    os.umask(0)
    root = tmp_path / "root"
    root.mkdir()
    first = Storage(root).catalog.root_id()
    assert len(first) == 32 and Storage(root).catalog.root_id() == first and _mode(root / ROOT_ID_FILE) == 0o640
    other = tmp_path / "other"
    other.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"not an id\n")
    (other / ROOT_ID_FILE).symlink_to(victim)
    with pytest.raises(ForeignEntry, match="is a symbolic link"):
        Storage(other).catalog.root_id()
    assert victim.read_bytes() == b"not an id\n" and os.readlink(other / ROOT_ID_FILE) == str(victim)


def test_daemons_starting_at_once_on_a_new_shared_root_read_one_root_id(tmp_path: Path) -> None:
    """The id was made with O_EXCL and then written in place: a daemon starting at the same
    moment could read it empty, take the shared root for a root of its own and empty the step
    directory the other node was writing (a 2-daemon save failed: "No such file or directory:
    .../.tmp-model-00001-of-00002.safetensors.<pid>"). Six at once, twenty times."""
    import threading

    for trial in range(20):
        root = tmp_path / f"root{trial}"
        root.mkdir()
        barrier = threading.Barrier(6)
        ids: list[str] = []

        def start() -> None:
            barrier.wait()
            ids.append(Storage(root).catalog.root_id())

        threads = [threading.Thread(target=start) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(ids) == 6 and len(set(ids)) == 1 and len(ids[0]) == 32, ids
        assert sorted(p.name for p in root.iterdir()) == [ROOT_ID_FILE]  # no temporary left


def test_an_empty_root_id_is_waited_for_then_refused_naming_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty id file: an older daemon writing it in place (read again until it is written), or
    one that died before writing it (refused: no id is made up, which would split the nodes)."""
    import threading

    from ckptd.daemon.storage import posix_catalog

    monkeypatch.setattr(posix_catalog, "ROOT_ID_WAIT_S", 0.5)
    root = tmp_path / "root"
    root.mkdir()
    (root / ROOT_ID_FILE).write_bytes(b"")
    writer = threading.Timer(0.1, lambda: (root / ROOT_ID_FILE).write_text("a" * 32 + "\n"))
    writer.start()
    assert Storage(root).catalog.root_id() == "a" * 32
    writer.join()
    (root / ROOT_ID_FILE).write_bytes(b"")
    with pytest.raises(OSError, match="is empty: with no daemon running on this root, remove it and start again"):
        Storage(root).catalog.root_id()


def test_peer_fetch_does_not_follow_a_link_in_a_step(tmp_path: Path) -> None:
    """Issue 20: peer_servicer.Fetch opened a step's file with a plain os.open: a shard replaced
    by a link to a host file of the same size was served to the peer. Now it is refused
    (FAILED_PRECONDITION naming the file) and a regular file is served."""
    import asyncio
    from types import SimpleNamespace

    from ckptd.daemon.errors import Precondition
    from ckptd.format.index import CheckpointIndex, FileRecord
    from ckptd.daemon.rpc.peer import PeerServicer
    from ckptd.wire.v1 import peer_pb2 as ppb

    storage = Storage(tmp_path / "root")
    shard = _committed_step(storage, "job", 1, b"D" * 64)
    secret = tmp_path / "secret"
    secret.write_bytes(b"S" * 64)
    index = CheckpointIndex("job", 1, 0.0, 1, (), (FileRecord(shard.name, 64, ""),))

    async def index_of(job: str, step: int) -> CheckpointIndex:
        return index

    async def fetched_range(index: CheckpointIndex, name: str, offset: int, nbytes: int) -> bytes:
        # CheckpointService.fetched_range without load broadcast (whose blocks are read by the same call)
        return await asyncio.to_thread(storage.files.read_range, index.job, index.step, name, offset, nbytes)

    service = SimpleNamespace(cluster=SimpleNamespace(node=0, nodes=2), storage=storage, index=index_of, fetched_range=fetched_range)
    servicer = PeerServicer(service)  # type: ignore[arg-type]

    async def fetch() -> bytes:
        request = ppb.FetchRequest(job="job", step=1, file=shard.name, offset=0, nbytes=0)
        return b"".join([chunk.data async for chunk in servicer.Fetch(request, None)])  # type: ignore[arg-type]

    assert asyncio.run(fetch()) == b"D" * 64
    shard.unlink()
    shard.symlink_to(secret)
    with pytest.raises(Precondition, match=f"{shard} is a symbolic link"):  # FAILED_PRECONDITION on the wire (rpc_errors)
        asyncio.run(fetch())


def test_a_committed_step_loses_its_prepared_marker_and_temporaries_and_keeps_what_is_not_the_daemons(tmp_path: Path) -> None:
    """A member that died between writing node 0's index and removing its marker: start-up
    (clean_uncommitted) and unmark_prepared leave the step as a finished commit, links kept."""
    storage = Storage(tmp_path / "root")
    victim = tmp_path / "victim"
    victim.write_bytes(b"v")

    def interrupted_commit(step: int) -> None:
        step_dir = _prepared(storage, "job", step)
        for name in (INDEX_NAME, PREPARED_NAME, ".tmp-extra.json.123"):
            (step_dir / name).write_bytes(b"{}")
        (step_dir / ".tmp-planted").symlink_to(victim)

    interrupted_commit(1)
    storage.janitor.clean_uncommitted()
    interrupted_commit(2)
    storage.janitor.unmark_prepared("job", 2)
    for step in (1, 2):
        left = sorted(p.name for p in storage.tree.step_dir("job", step).iterdir())
        assert left == [".tmp-planted", INDEX_NAME], (step, left)
    assert victim.read_bytes() == b"v"


# issue 30 finding 9 (c)
def test_the_root_the_daemon_makes_is_0750_whatever_the_umask(tmp_path: Path, umask_007: None) -> None:
    root = tmp_path / "new" / "ckpt"
    Storage(root).janitor.clean_uncommitted()
    assert stat.S_IMODE(root.stat().st_mode) == 0o750 and stat.S_IMODE(root.parent.stat().st_mode) == 0o750
    existing = tmp_path / "operators"  # a root the operator made keeps its mode
    existing.mkdir(mode=0o755)
    os.chmod(existing, 0o755)
    Storage(existing).janitor.clean_uncommitted()
    assert stat.S_IMODE(existing.stat().st_mode) == 0o755


# Commit times come from each index's head (this version's compact index) or, for an index an
# older daemon wrote indented, from the whole file; both order alike. A guard of issue 30's
# compact index (it passes on 7224a82 too), not a finding's test.
def test_the_commit_order_mixes_compact_and_indented_indexes(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "root")
    for step, created, indented in ((1, 30.0, True), (2, 10.0, False), (3, 20.0, True), (4, 40.0, False)):
        data = CheckpointIndex("job", step, created, 1, (), ()).to_json_bytes()
        if indented:
            data = json.dumps(json.loads(data), indent=1).encode()
        write_small_file(_prepared(storage, "job", step) / INDEX_NAME, data)
    assert storage.catalog.commit_order("job") == [2, 3, 1, 4]


# issue 30 review: a node restarting on a root other nodes' daemons serve removes its own old
# leftovers at start-up (as `ckptd gc` does), not nothing; a fresh step may be theirs in flight
def test_start_up_on_a_shared_root_removes_old_leftovers_and_keeps_fresh_ones(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "root"
    other_node = Storage(root)
    other_node.claim(1, "/run/other.sock")
    restarted = Storage(root)
    restarted.claim(0, "/run/this.sock")
    try:
        dead = _prepared(restarted, "job", 3)  # a save of this node's that died with its daemon
        (dead / ".tmp-model-00001-of-00002.safetensors.1").write_bytes(b"x")
        in_flight = _prepared(restarted, "job", 4)  # node 1's save, being written now
        (in_flight / ".tmp-model-00002-of-00002.safetensors.1").write_bytes(b"y")
        long_ago = dead.stat().st_mtime - 3600
        os.utime(dead, (long_ago, long_ago))
        with caplog.at_level(logging.WARNING):
            removed = restarted.janitor.clean_uncommitted(600.0)
        assert [left.where for left in removed] == [str(dead)] and not dead.exists()
        assert (in_flight / ".tmp-model-00002-of-00002.safetensors.1").read_bytes() == b"y"
        assert "start-up recovery" in caplog.text and "skipped" in caplog.text and "node 1" in caplog.text
    finally:
        restarted.release()
        other_node.release()


def test_one_rule_says_what_a_job_directory_and_a_storage_root_are(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "job" / "step-00000001").mkdir(parents=True)
    (root / "job" / "step-00000001" / INDEX_NAME).write_text("{}")
    (root / "fresh").mkdir()
    (root / "fresh" / "latest").write_text("step-00000001\n")
    (root / ".recycle" / "step-00000001").mkdir(parents=True)
    (root / "plain").mkdir()
    (root / "linked").symlink_to(root / "job")
    verdicts = {name: is_job_dir(root / name) for name in ("job", "fresh", ".recycle", "plain", "linked", "job/step-00000001", "missing")}
    assert verdicts == {"job": True, "fresh": True, ".recycle": False, "plain": False, "linked": False, "job/step-00000001": False, "missing": False}
    assert is_storage_root(root) and not is_storage_root(root / "job") and not is_storage_root(root / "plain")
    (root / "plain" / ROOT_ID_FILE).write_text("id\n")
    assert is_storage_root(root / "plain")


@pytest.mark.parametrize("linked", ["step", "job"])
def test_a_step_read_through_a_linked_directory_is_refused_naming_the_link(tmp_path: Path, linked: str) -> None:
    """Found by an attacker's probe: `ckptd verify/inspect/export ROOT/jobE/step-2`, with step-2
    (or jobE) a link to another job's step, read that job's files as jobE's (verify then crashed
    on its listing). The step reader refuses a linked step or job directory as the daemon does."""
    real = tmp_path / "root" / "jobA" / "step-00000002"
    real.mkdir(parents=True)
    (real / INDEX_NAME).write_text("{}")
    if linked == "step":
        (tmp_path / "root" / "jobE").mkdir()
        (tmp_path / "root" / "jobE" / "step-00000002").symlink_to(real)
        reader, link = storage_module.step_at(tmp_path / "root" / "jobE" / "step-00000002"), tmp_path / "root" / "jobE" / "step-00000002"
    else:
        (tmp_path / "root" / "jobL").symlink_to(real.parent)
        reader, link = storage_module.step_at(tmp_path / "root" / "jobL" / "step-00000002"), tmp_path / "root" / "jobL"
    for call in (reader.names, lambda: reader.read_small(INDEX_NAME), lambda: reader.open(INDEX_NAME), lambda: reader.exists(INDEX_NAME)):
        with pytest.raises(ForeignEntry, match=f"{link} is a symbolic link.*give the directory itself"):
            call()
    assert storage_module.step_at(real).read_small(INDEX_NAME) == b"{}"
