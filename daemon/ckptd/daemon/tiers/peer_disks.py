"""Committed steps that this node's root does not have, read from the peers that recorded them.

A replaced node (its memory and disk lost, its daemon started on an empty root) still serves the
loads of its ranks: with node-local roots every node records the index and the small files of
each committed step (engine/commit.py), so the newest step, its index and its extra.json come
from a peer; the data files come from wherever the load planner finds them (a replica in a
peer's memory, a peer's disk: engine/loads.py). Nothing of the step is written into this root:
it is read, for loads only.
"""

from __future__ import annotations

import asyncio
import logging

from ckptd.daemon.engine.context import Engine
from ckptd.daemon.errors import CkptdError, NotFound, Precondition, Unavailable
from ckptd.format.index import INDEX_NAME, CheckpointIndex, FileRecord, FormatError, check_small_file
from ckptd.daemon.records import PeerInventory

log = logging.getLogger(__name__)

HOLDERS_KEPT = 64


class PeerSteps:
    """The peers' committed steps, for a node whose root lacks them (several nodes only)."""

    def __init__(self, engine: Engine) -> None:
        assert engine.cluster is not None
        self.engine = engine
        self.cluster = engine.cluster
        self._holders: dict[tuple[str, int], int] = {}  # a node found to have the step committed (asked again when it fails)

    async def _answers(self, job: str, step: int, newest: bool) -> dict[int, PeerInventory]:
        """Every other node's inventory of the step, by node (those that answered)."""
        others = [n for n in range(self.cluster.nodes) if n != self.cluster.node]
        replies = await asyncio.gather(*(self.cluster.inventory(n, job, step, newest=newest) for n in others))
        return {n: r for n, r in zip(others, replies) if not isinstance(r, str)}

    async def newest(self, job: str) -> int | None:
        """The job's newest committed step as node 0 records it (the node that commits), else as
        the first other node that answers records it; None when none has one."""
        answers = await self._answers(job, 0, newest=True)
        for node in sorted(answers):
            if answers[node].newest is not None:
                log.info("job %s has no step in this root; node %s's newest committed step is %s", job, node, answers[node].newest)
                return answers[node].newest
        return None

    async def holder(self, job: str, step: int, fresh: bool = False) -> int | None:
        """A node (the lowest) whose root has the step committed, remembered for the next calls
        (fresh: ask again); None when no node that answers has."""
        known = self._holders.get((job, step))
        if known is not None and not fresh:
            return known
        answers = await self._answers(job, step, newest=False)
        found = next((n for n in sorted(answers) if answers[n].committed), None)
        if found is None:
            self._holders.pop((job, step), None)
        else:
            self._holders[(job, step)] = found
            while len(self._holders) > HOLDERS_KEPT:
                del self._holders[next(iter(self._holders))]
        return found

    async def _fetch(self, job: str, step: int, name: str) -> tuple[int, bytes]:
        """A small file of the step from the node remembered to hold it, else (or when that
        fails) from a node asked again; (that node, the bytes)."""
        node = await self.holder(job, step)
        if node is None:
            raise NotFound(f"step {step} of job {job!r} is committed neither in this node's root nor on a node that answers")
        try:
            return node, await self.cluster.fetch_bytes(node, job, step, name)
        except CkptdError:
            node = await self.holder(job, step, fresh=True)
            if node is None:
                raise NotFound(f"step {step} of job {job!r} is committed neither in this node's root nor on a node that answers") from None
            return node, await self.cluster.fetch_bytes(node, job, step, name)

    async def index(self, job: str, step: int) -> CheckpointIndex:
        """The step's index from a peer that committed it (cached like a local index); NotFound
        when no node that answers has it."""
        cached = self.engine.indexes.get((job, step))
        if cached is not None:
            return cached
        node = -1
        try:
            node, data = await self._fetch(job, step, INDEX_NAME)
            index = CheckpointIndex.of_step(data, job, step, f"{self.cluster.describe(node)}'s {INDEX_NAME}")
        except (Unavailable, FormatError) as exc:
            raise Precondition(f"step {step} of job {job!r} is not in this node's root, and its index could not be read from {self.cluster.describe(node)}: {exc}") from None
        self.engine.indexes.put((job, step), index)
        return index

    async def small_file(self, job: str, step: int, record: FileRecord) -> bytes:
        """A small file of the step (extra.json) from a peer that committed it, checked against its index record."""
        node = -1
        try:
            node, data = await self._fetch(job, step, record.name)
            check_small_file(record, data)
        except (Unavailable, FormatError) as exc:
            raise Precondition(f"step {step} of job {job!r}: {record.name} could not be read from {self.cluster.describe(node)}: {exc}") from None
        return data
