"""The commit rule of a step, stated once: a step is visible (committed) exactly when its index
(format.INDEX_NAME) is, so the index is published last and removed first.

Publishing, in this order (`StepCommit`; the stages are `publish_rank`'s):

1. data files, each written under a temporary name, synced, closed and published
   (PartWriter.publish), or linked (StepWriting.link_file); then the step synced
   (`StepCommit.parts_published`), so that no data file can be lost once a later name is durable;
2. the small files (extra.json, the adapter copy...), written in place, each synced; then the
   step synced;
3. the index, atomically (readers see it whole or not at all): the commit;
4. the job's `latest`, a hint for other tools (this step, or the newest committed one).

Deleting goes the other way: the index first (the step is invisible from then on), then the
rest. A POSIX step does it in one rename of its directory
(StepJanitor.remove_step); the bucket (remote/catalog.py) deletes the index object first, and
its uploads (remote/upload.py, remote/objects.py) publish in `publish_rank` order, the index
last, only once every other file is there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

from ckptd.daemon.storage.base import StepCatalog, StepWriting
from ckptd.format.index import INDEX_NAME
from ckptd.format.units import is_data_file

DATA, SMALL, INDEX = 0, 1, 2  # the publishing stages of a step's files, in order

Latest = Literal["this", "newest"]  # what `latest` names once a step is committed (StepCommit.point_latest)


def publish_rank(name: str) -> int:
    """The stage at which file `name` of a step is published: DATA, SMALL, or INDEX (last)."""
    if name == INDEX_NAME:
        return INDEX
    return DATA if is_data_file(name) else SMALL


@dataclass(frozen=True)
class StepCommit:
    """The commit of step `step` of `job` on one storage: the writer, the coordinator, `ckptd
    import` and the restore from a bucket each publish a step through it (see the module
    docstring for the order). Blocking."""

    writing: StepWriting
    catalog: StepCatalog
    job: str
    step: int

    def parts_published(self) -> None:
        """Stage 1 done: the data files published so far are durable."""
        self.writing.sync_step(self.job, self.step)

    def commit(self, files: Mapping[str, bytes], latest: Latest = "this") -> None:
        """Stages 2 to 4: `publish(files)`, then `point_latest(latest)`."""
        self.publish(files)
        self.point_latest(latest)

    def publish(self, files: Mapping[str, bytes]) -> None:
        """Stages 2 and 3: the small files of `files` (each synced, not atomic), the step
        synced, then `files[INDEX_NAME]` atomically: the commit. KeyError when `files` holds
        no index."""
        index = files[INDEX_NAME]
        self.writing.ensure_step(self.job, self.step)
        for name in sorted(files, key=publish_rank):
            if name != INDEX_NAME:
                self.writing.write_small(self.job, self.step, name, files[name], atomic=False)
        self.writing.sync_step(self.job, self.step)
        self.writing.write_small(self.job, self.step, INDEX_NAME, index)

    def point_latest(self, latest: Latest = "this") -> None:
        """Stage 4, once the step is committed: the job's `latest` names this step, or (`newest`)
        the job's newest committed step by the indexes' created_at (a step committed after
        another node's, or restored from a bucket, may be older than the newest here)."""
        newest = self.catalog.latest_step(self.job) if latest == "newest" else None
        self.writing.write_latest(self.job, self.step if newest is None else newest)
