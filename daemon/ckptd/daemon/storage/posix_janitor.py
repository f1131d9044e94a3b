"""The janitor of a POSIX storage root (base.StepJanitor): deleting steps (into the recycle
bin), aborted parts, prepared markers, gc of what failed saves left, start-up recovery."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from itertools import count
from pathlib import Path
from typing import Sequence

from ckptd.common.files import real_dir_at, real_file_at
from ckptd.daemon.storage.base import Leftover
from ckptd.daemon.storage.fs import (
    DELETING_PREFIX,
    TMP_MARK,
    ForeignEntry,
    foreign_entries,
    foreign_reason,
    fsync_dir,
    lkind,
    make_dir,
    make_dirs,
    open_dir,
    own_entry,
    remove_own_tree,
    tmp_name,
    tree_bytes,
    unlink_own,
    write_small_file,
)
from ckptd.daemon.storage.posix_catalog import PosixCatalog
from ckptd.daemon.storage.posix_tree import PosixTree
from ckptd.daemon.storage.posix_writing import PosixWriting
from ckptd.daemon.storage.root_lock import NodeClaim
from ckptd.format.index import INDEX_NAME, LATEST, PREPARED_NAME, parse_step_dir_name

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
        # Names never used before: a save taking a file of the bin meanwhile (fs.open_recycled)
        # finds the one it opened gone, never another file under its name (it would fail).
        batch = f"{time.time_ns():x}"
        free = (name for name in (f"{batch}-{i:05d}" for i in count()) if name not in taken)
        for f in sorted(doomed.glob("*.safetensors")):
            if foreign_reason(os.lstat(f), dev) is None:
                os.replace(f, next(free), dst_dir_fd=bin_fd)
    finally:
        os.close(bin_fd)


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


class PosixJanitor:
    """Removal on the root (see base.StepJanitor): only what the daemon wrote ever goes
    (fs.remove_own_tree, fs.foreign_entries); a link is never followed."""

    def __init__(self, tree: PosixTree, catalog: PosixCatalog, writing: PosixWriting, claim: NodeClaim) -> None:
        self.tree, self.catalog, self.writing, self._claim = tree, catalog, writing, claim

    def remove_step(self, job: str, step: int, recycle: bool = False) -> None:
        """Delete a step: rename it away first (one atomic step: its index is invisible before
        any data file goes), then remove the files.

        recycle: keep its data files in the job's recycle bin (replacing what was there), so the
        next save overwrites their blocks instead of allocating new ones (see take_recycled).

        Never deletes what the daemon did not write (foreign_entries: links, FIFOs, other users'
        files; a link is never followed). A committed step holding any of that is left whole and
        ForeignEntry names them (retention logs it and retries at its next pass); of an
        uncommitted step (a failed attempt) the daemon's own files go and the rest stays, logged.
        A step or job directory that is itself a link is left alone, with a warning.
        """
        path = self.tree.step_dir(job, step)
        if not os.path.lexists(path):
            return
        if not real_dir_at(path.parent) or not real_dir_at(path):
            where = path if real_dir_at(path.parent) else path.parent
            log.warning("leaving %s alone: it is %s, not a directory the daemon made", where, lkind(where))
            return
        foreign = foreign_entries(path)
        if foreign and not os.path.lexists(path / INDEX_NAME):
            remove_own_tree(path)  # an attempt that failed: its own files go, the rest stays (logged)
            return
        if foreign:
            shown = ", ".join(f"{p} ({what})" for p, what in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise ForeignEntry(f"step directory {path} is not deleted: it holds what the daemon did not write: {shown}; move that away and it is deleted at the next retention pass or `ckptd gc`")
        doomed = path.with_name(f"{DELETING_PREFIX}{path.name}")
        if os.path.lexists(doomed) and remove_own_tree(doomed):
            doomed = path.with_name(f"{DELETING_PREFIX}{path.name}.{os.getpid()}.{time.monotonic_ns()}")
        try:
            os.replace(path, doomed)
        except FileNotFoundError:  # removed meanwhile (the coordinator's abort and this node's own discard race)
            return
        fsync_dir(path.parent)
        if recycle:
            recycle_files(self.tree.recycle_dir(job), doomed)
        remove_own_tree(doomed)

    def discard_part(self, job: str, step: int, names: Sequence[str], shared: bool) -> None:
        """Remove what this node wrote of an aborted step: the whole step directory of a
        node-local root; in a root shared with other nodes, only `names` and temporary files
        (the coordinator removes the rest), and the directory once it is empty."""
        if not shared:
            self.remove_step(job, step)
            return
        path = self.tree.step_dir(job, step)
        if not real_dir_at(path) or os.path.lexists(path / INDEX_NAME):
            return  # committed after all (a newer attempt), or a link: nothing of it is ours to remove
        for name in names:
            unlink_own(path / name)
            unlink_own(tmp_name(path / name))
        try:
            path.rmdir()
        except OSError:
            pass  # not empty (other nodes' files, removed by the coordinator) or already gone

    def mark_prepared(self, job: str, step: int, save_id: str, node: int) -> None:
        """Record that this node's part of the step is written and fsynced (see PREPARED_NAME)."""
        doc = {"save_id": save_id, "node": node, "step": step}
        write_small_file(self.tree.step_dir(job, step) / PREPARED_NAME, (json.dumps(doc) + "\n").encode())

    def unmark_prepared(self, job: str, step: int) -> None:
        """The step is committed on this node: its prepared marker and any temporary file of an
        earlier, interrupted write of the commit go (only the daemon's own files; a link is left)."""
        path = self.tree.step_dir(job, step)
        if real_dir_at(path):
            tidy_committed(path)

    def prepared_steps(self) -> list[tuple[str, int]]:
        """(job, step) of step directories that hold a node's prepared part but no index."""
        found = []
        for job in self.catalog.jobs():
            for p in self.tree.job_dir(job).iterdir():
                step = parse_step_dir_name(p.name)
                if step is not None and real_dir_at(p) and real_file_at(p / PREPARED_NAME) and not os.path.lexists(p / INDEX_NAME):
                    found.append((job, step))
        return sorted(found)

    def leftovers(self, job: str, busy: set[int], min_age_s: float = 0.0, dry_run: bool = False) -> list[Leftover]:
        """Remove (unless `dry_run`) what a crash or a failed save left in a job's directory while
        the daemon runs: step directories without an index (not in `busy`, the steps being saved,
        nor a node's prepared part), temporary files and half-deleted steps, unchanged for at
        least `min_age_s` seconds."""
        job_dir = self.tree.job_dir(job)
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
        out: list[Leftover] = []
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
            out.append(Leftover(str(path), step, reason, size))
        return out

    def clean_uncommitted(self, min_age_s: float = 0.0) -> list[Leftover]:
        """Remove what a crash left: step directories without an index, temporary files and
        half-deleted steps (only what the daemon wrote: remove_own_tree). Then rewrite each
        job's `latest` from the committed steps where it does not name the newest. What cannot
        be changed (a read-only root, a foreign `latest`) is logged, not raised: the daemon
        starts and serves loads; saves fail naming the cause.

        The root is made (DIR_MODE) when missing. While other nodes' daemons serve this root (a
        shared root, NodeClaim.others), a step without an index may be one
        they are writing: only leftovers unchanged for `min_age_s` seconds (the save timeout) are
        removed, as `ckptd gc` does (`leftovers`), and `latest` is left to them."""
        others = self._claim.others()
        make_dirs(self.tree.root)
        if others:
            log.warning(
                "start-up recovery of %s skipped for what changed in the last %.0f s: other nodes' daemons serve this root (%s), "
                "so a step without an index may be one they are writing; older leftovers are removed, as `ckptd gc` does",
                self.tree.root, min_age_s, "; ".join(others),
            )
            swept: list[Leftover] = []
            for job in self.catalog.jobs():
                try:
                    swept += self.leftovers(job, set(), min_age_s)
                except OSError as exc:  # a read-only root: the daemon still starts and serves loads
                    log.error("cannot remove the leftovers of job %s: %s", job, exc)
            return swept
        removed: list[Leftover] = []
        for job in self.catalog.jobs():
            job_dir = self.tree.job_dir(job)
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
                        removed += [Leftover(str(q), step, "temporary", 0) for q in tidy_committed(p)]
                    if stale and not remove_own_tree(p):
                        removed.append(Leftover(str(p), -1 if step is None else step, "temporary" if step is None else "uncommitted", 0))
                except OSError as exc:  # a read-only root: the daemon still starts and serves loads
                    log.error("cannot remove the leftover %s: %s", p, exc)
            latest = self.catalog.latest_step(job)
            try:
                if latest is not None and self.catalog.latest_named(job) != latest:
                    self.writing.write_latest(job, latest)
                elif latest is None and os.path.lexists(job_dir / LATEST):
                    unlink_own(job_dir / LATEST)
            except OSError as exc:  # ForeignEntry, or a read-only root: saves will fail, naming it; loads work
                log.error("cannot update the `latest` of job %s: %s", job, exc)
        for left in removed:
            log.info("removed uncommitted leftover %s", left.where)
        return removed
