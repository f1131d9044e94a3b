"""Housekeeping of a POSIX storage root: the recycle bin, start-up recovery, gc of what failed
saves left, prepared parts. Functions of `Storage` (posix.py), which delegates to them."""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd.format.index import INDEX_NAME, LATEST, PREPARED_NAME, parse_step_dir_name
from ckptd.daemon.storage.fs import (
    DELETING_PREFIX,
    TMP_MARK,
    ForeignEntry,
    foreign_entries,
    foreign_reason,
    lkind,
    make_dir,
    make_dirs,
    open_dir,
    own_entry,
    real_dir_at,
    real_file_at,
    remove_own_tree,
    tree_bytes,
    unlink_own,
)

if TYPE_CHECKING:
    from ckptd.daemon.storage.posix import Storage

log = logging.getLogger(__name__)


def recycle_files(bin_dir: Path, doomed: Path) -> None:
    """Move the data files of `doomed` (a step directory renamed away) into the job's recycle
    bin, in place of the daemon's own files there. Whatever else is in the bin (foreign_reason)
    stays, with a warning; a bin that is not a directory is not used."""
    try:
        make_dir(bin_dir, exist_ok=True)
        bin_fd = open_dir(bin_dir)
    except ForeignEntry as exc:
        log.warning("not recycling the files of %s: %s", doomed, exc)
        return
    try:
        dev = os.fstat(bin_fd).st_dev
        taken = set()
        for name in os.listdir(bin_fd):
            try:
                why = foreign_reason(os.stat(name, dir_fd=bin_fd, follow_symlinks=False), dev)
                if why is None:
                    os.unlink(name, dir_fd=bin_fd)
                    continue
            except FileNotFoundError:
                continue
            log.warning("leaving %s in the recycle bin alone: it is %s, which the daemon did not make", bin_dir / name, why)
            taken.add(name)
        free = (name for name in (f"{i:05d}" for i in range(1 << 30)) if name not in taken)
        for f in sorted(doomed.glob("*.safetensors")):
            if foreign_reason(os.lstat(f), dev) is None:
                os.replace(f, next(free), dst_dir_fd=bin_fd)
    finally:
        os.close(bin_fd)


def recycled_files(bin_dir: Path, root: Path) -> list[tuple[Path, int]]:
    """The recycle bin's files with their sizes, largest first (the caller takes them with
    open_recycled, which checks each again). Only the daemon's own files count (lstat, never
    stat: a regular file of its uid with one link, on the root's file system); anything else
    there (a link, a FIFO, a hard link, a file of another user) is left where it is, with a
    warning naming it, and so is a bin that is itself a link."""
    try:
        bin_fd = open_dir(bin_dir)
    except FileNotFoundError:
        return []
    except ForeignEntry as exc:
        log.warning("not recycling: %s", exc)
        return []
    files = []
    try:
        dev = os.stat(root).st_dev
        for name in os.listdir(bin_fd):
            try:
                st = os.stat(name, dir_fd=bin_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            why = foreign_reason(st, dev)
            if why is None:
                files.append((bin_dir / name, st.st_size))
            else:
                log.warning("leaving %s in the recycle bin alone: it is %s, which the daemon did not make", bin_dir / name, why)
    finally:
        os.close(bin_fd)
    return sorted(files, key=lambda f: -f[1])


def tidy_committed(step_dir: Path) -> list[Path]:
    """Remove from a committed step directory what only an unfinished write leaves there: the
    daemon's temporary files and a node's prepared marker (a member that died between writing
    node 0's index and removing its marker). Only regular files of the daemon's uid; returns them."""
    removed = []
    for q in step_dir.iterdir():
        if q.name.startswith(TMP_MARK) or q.name == PREPARED_NAME:
            st = q.lstat()
            if stat.S_ISREG(st.st_mode) and own_entry(st):
                q.unlink()
                removed.append(q)
    return removed


def prepared_steps(storage: "Storage") -> list[tuple[str, int]]:
    """(job, step) of step directories that hold a node's prepared part but no index."""
    found = []
    for job in storage.jobs():
        for p in storage.job_dir(job).iterdir():
            step = parse_step_dir_name(p.name)
            if step is not None and real_dir_at(p) and real_file_at(p / PREPARED_NAME) and not os.path.lexists(p / INDEX_NAME):
                found.append((job, step))
    return sorted(found)


def leftovers(storage: "Storage", job: str, busy: set[int], min_age_s: float = 0.0, dry_run: bool = False) -> list[tuple[Path, int, str, int]]:
    """Remove (unless `dry_run`) what a crash or a failed save left in a job's directory while
    the daemon runs: step directories without an index (not in `busy`, the steps being saved,
    nor a node's prepared part), temporary files and half-deleted steps, unchanged for at
    least `min_age_s` seconds. Returns (path, step or -1, reason, bytes) of each."""
    job_dir = storage.job_dir(job)
    if not real_dir_at(job_dir):
        if os.path.lexists(job_dir):
            log.warning("gc leaves %s alone: it is %s, not a job directory the daemon made", job_dir, lkind(job_dir))
        return []
    found = []
    now = time.time()
    for p in sorted(job_dir.iterdir()):
        step = parse_step_dir_name(p.name)
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            log.warning("gc leaves %s alone: a symbolic link, which the daemon did not make", p)
            continue
        age = now - st.st_mtime
        if age < min_age_s:
            continue
        if p.name.startswith(DELETING_PREFIX) or p.name.startswith(TMP_MARK):
            found.append((p, -1, "temporary"))
        elif step is not None and stat.S_ISDIR(st.st_mode):
            if real_file_at(p / INDEX_NAME):
                found += [(q, step, "temporary") for q in sorted(p.iterdir()) if q.name.startswith(TMP_MARK) and own_entry(q.lstat())]
            elif step not in busy and not os.path.lexists(p / PREPARED_NAME) and not os.path.lexists(p / INDEX_NAME):
                found.append((p, step, "uncommitted"))
    out = []
    for path, step, reason in found:
        size = tree_bytes(path)
        if not dry_run:
            left = remove_own_tree(path)
            if left:
                log.warning("gc left %s in place: it holds %d entries the daemon did not write (logged above)", path, len(left))
                continue
            log.info("gc removed %s leftover %s", reason, path)
        elif foreign_entries(path):
            continue
        out.append((path, step, reason, size))
    return out


def clean_uncommitted(storage: "Storage", others: list[str], min_age_s: float) -> list[Path]:
    """Remove what a crash left: step directories without an index, temporary files and
    half-deleted steps (only what the daemon wrote: remove_own_tree). Then rewrite each
    job's `latest` from the committed steps where it does not name the newest. What cannot
    be changed (a read-only root, a foreign `latest`) is logged, not raised: the daemon
    starts and serves loads; saves fail naming the cause.

    The root is made (DIR_MODE) when missing. `others`: the other nodes' daemons that serve
    this root now (a shared root, RootLock.others). Then a step without an index may be one
    they are writing: only leftovers unchanged for `min_age_s` seconds (the save timeout) are
    removed, as `ckptd gc` does (`leftovers`), and `latest` is left to them."""
    make_dirs(storage.root)
    if others:
        log.warning(
            "start-up recovery of %s skipped for what changed in the last %.0f s: other nodes' daemons serve this root (%s), "
            "so a step without an index may be one they are writing; older leftovers are removed, as `ckptd gc` does",
            storage.root, min_age_s, "; ".join(others),
        )
        swept = []
        for job in storage.jobs():
            try:
                swept += [path for path, _, _, _ in leftovers(storage, job, set(), min_age_s)]
            except OSError as exc:  # a read-only root: the daemon still starts and serves loads
                log.error("cannot remove the leftovers of job %s: %s", job, exc)
        return swept
    removed = []
    for job in storage.jobs():
        job_dir = storage.job_dir(job)
        for p in job_dir.iterdir():
            if p.is_symlink():  # not followed, not removed
                if p.name != LATEST:
                    log.warning("leaving %s alone: a symbolic link, which the daemon did not make", p)
                continue
            stale = p.name.startswith(DELETING_PREFIX) or p.name.startswith(TMP_MARK)
            step = parse_step_dir_name(p.name)
            is_dir = real_dir_at(p)
            if step is not None and is_dir and not os.path.lexists(p / INDEX_NAME):
                stale = not os.path.lexists(p / PREPARED_NAME)  # prepared: resolved with the coordinator
            try:
                if step is not None and is_dir and real_file_at(p / INDEX_NAME):
                    removed += tidy_committed(p)
                if stale and not remove_own_tree(p):
                    removed.append(p)
            except OSError as exc:  # a read-only root: the daemon still starts and serves loads
                log.error("cannot remove the leftover %s: %s", p, exc)
        latest = storage.latest_step(job)
        try:
            if latest is not None and storage.latest_named(job) != latest:
                storage.write_latest(job, latest)
            elif latest is None and os.path.lexists(job_dir / LATEST):
                unlink_own(job_dir / LATEST)
        except OSError as exc:  # ForeignEntry, or a read-only root: saves will fail, naming it; loads work
            log.error("cannot update the `latest` of job %s: %s", job, exc)
    for p in removed:
        log.info("removed uncommitted leftover %s", p)
    return removed


@dataclass(frozen=True)
class UncommittedStep:
    """A step directory without an index (an interrupted or in-flight save), for `ckptd ls --all`."""

    step: int
    path: Path
    mtime: float
    nbytes: int
    files: int


def uncommitted_steps(storage: "Storage", job: str) -> list[UncommittedStep]:
    """Storage.uncommitted_steps: step directories of `job` without an index (links not followed)."""
    job_dir = storage.job_dir(job)
    found = []
    for p in sorted(job_dir.iterdir()) if real_dir_at(job_dir) else []:
        step = parse_step_dir_name(p.name)
        if step is None or not real_dir_at(p) or storage.is_committed(job, step):
            continue
        found.append(UncommittedStep(step, p, p.stat().st_mtime, tree_bytes(p), sum(1 for _ in p.iterdir())))
    return found
