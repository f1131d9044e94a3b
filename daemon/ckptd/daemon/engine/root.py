"""This node's root as a tier (ROOT, engine/tiers.py): the steps committed in it, their index and
small files, and staging ranges of its data files for ranks that cannot read them."""

from __future__ import annotations

import asyncio
import os
from typing import Any, Mapping, Sequence

from ckptd.daemon.engine.context import Engine
from ckptd.daemon.engine.tiers import Located, StagingTarget, Tier, Unstaged
from ckptd.daemon.errors import Precondition
from ckptd.format.index import CheckpointIndex, FileRecord, FormatError, parse_extra_json
from ckptd.daemon.plan.load_plan import TierName
from ckptd.format.file_plan import StagedRead
from ckptd.daemon.records import PeerInventory


class Root(Tier):
    """The storage root of this node (StorageBackend)."""

    name = TierName.ROOT

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def newest(self, job: str, found: Located | None) -> Located | None:
        if found is not None:
            return None
        step = await asyncio.to_thread(self._newest, job)
        return None if step is None else Located(step)

    def _newest(self, job: str) -> int | None:
        catalog = self.engine.storage.catalog
        _refuse_links(catalog.not_followed(job), job, None)
        return catalog.latest_step(job)

    async def locate(self, job: str, step: int) -> Located | None:
        if await self.engine.committed(job, step):
            return Located(step)
        _refuse_links(await asyncio.to_thread(self.engine.storage.catalog.not_followed, job, step), job, step)
        return None

    async def index(self, job: str, step: int) -> CheckpointIndex:
        return await self.engine.index(job, step)

    async def extras(self, job: str, step: int, record: FileRecord) -> dict[int, Any]:
        try:
            data = await asyncio.to_thread(self.engine.storage.files.read_small, job, step, record.name)  # no link followed, no FIFO waited on
            return parse_extra_json(data, record)
        except (OSError, FormatError) as exc:
            problem = f"{record.name} is missing" if isinstance(exc, FileNotFoundError) else str(exc)
            raise Precondition(await self.damaged(job, step, problem)) from None

    async def files(self, index: CheckpointIndex, inventories: Mapping[int, PeerInventory]) -> Mapping[int, Mapping[str, int]]:
        return {self.engine.node: await asyncio.to_thread(self.engine.storage.files.step_file_sizes, index.job, index.step)}

    async def stage(self, index: CheckpointIndex, reads: Sequence[StagedRead], target: StagingTarget) -> Sequence[Unstaged]:
        """Copy each range of this root's files into its staging file (Storage.copy_range);
        Precondition naming the file that is missing, unreadable or short, and what to do."""
        storage = self.engine.storage
        for read in reads:
            fd = await asyncio.to_thread(target.open, target.paths[read.file])
            try:
                await asyncio.to_thread(storage.files.copy_range, index.job, index.step, read.file, fd, read.offset, read.nbytes)
            except (FormatError, OSError) as exc:
                path = f"{storage.catalog.step_location(index.job, index.step)}/{read.file}"
                problem = (
                    f"{path} is missing" if isinstance(exc, FileNotFoundError)
                    else f"cannot read {path}: {exc.strerror or exc}" if isinstance(exc, OSError)
                    else str(exc)
                )
                raise Precondition(await self.damaged(index.job, index.step, problem)) from None
            finally:
                os.close(fd)
            self.engine.metrics.load_staged_bytes.labels(self.name.value).inc(read.nbytes)
        return ()

    async def damaged(self, job: str, step: int, problem: str) -> str:
        """The message for a committed step that cannot be loaded: what, and what to do."""
        storage = self.engine.storage
        older = [s for s in await asyncio.to_thread(storage.catalog.committed_steps, job) if s < step]
        example = f"load(state, step={older[-1]})" if older else "load(state, step=N)"
        return (
            f"step {step} of job {job!r} cannot be loaded: {problem}; load an older step (`{example}`), "
            f"and see what else is damaged with `ckptd verify {storage.catalog.step_location(job, step)}`"
        )


def _refuse_links(found: list[str], job: str, step: int | None) -> None:
    """Precondition when a link (or a file) stands where the job's directory or a step directory
    of it belongs (`found`: StepCatalog.not_followed): the load would otherwise pass over it, and
    a run asking for its newest step would start over, or resume from an older one, without a word."""
    if found:
        asked = "the newest step" if step is None else f"step {step}"
        raise Precondition(f"cannot load {asked} of job {job!r}: " + "; ".join(found))
