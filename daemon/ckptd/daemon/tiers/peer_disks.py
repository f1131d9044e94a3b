"""The PEER_DISK tier (engine/tiers.py): the peers' roots. Their data files are staged for this
node's loads (Peers.fetch), and committed steps that this node's root does not have are read
from the peers that recorded them.

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
import os
from typing import Any, Callable, Collection, Mapping, Sequence

from ckptd.daemon.engine.context import Engine
from ckptd.daemon.engine.single_flight import SingleFlight
from ckptd.daemon.engine.tiers import Listing, Located, StagingTarget, Tier, Unstaged
from ckptd.daemon.errors import CkptdError, NotFound, Precondition, Unavailable
from ckptd.format.index import INDEX_NAME, CheckpointIndex, FileRecord, FormatError, check_small_file, parse_extra_json, step_dir_name
from ckptd.daemon.plan.load_plan import TierName
from ckptd.format.file_plan import StagedRead
from ckptd.daemon.records import PeerInventory, StepSummary

log = logging.getLogger(__name__)

HOLDERS_KEPT = 64


class PeerDisks(Tier):
    """The peers' roots (several nodes only): their files, and their committed steps for a node
    whose root lacks them."""

    name = TierName.PEER_DISK

    def __init__(self, engine: Engine) -> None:
        assert engine.cluster is not None
        self.engine = engine
        self.cluster = engine.cluster
        self._holders: dict[tuple[str, int], int] = {}  # a node found to have the step committed (asked again when it fails)
        self._asking_node0: SingleFlight[str, PeerInventory | str] = SingleFlight()  # by job: a node's ranks loading at once ask node 0 once

    async def _answers(self, job: str, step: int, newest: bool, wanted: Callable[[PeerInventory], bool]) -> dict[int, PeerInventory]:
        """The other nodes' inventories of the step, by node (those that answered): the lowest
        other node's first (node 0, which commits, records every step), and every other node's
        only when that one does not answer or its answer is not `wanted`: a replaced node of a
        10,000-node job asks one peer, not all of them, on each load."""
        others = [n for n in range(self.cluster.nodes) if n != self.cluster.node]
        answers: dict[int, PeerInventory] = {}
        for ask in (others[:1], others[1:]):
            replies = await asyncio.gather(*(self.cluster.inventory(n, job, step, newest=newest) for n in ask))
            answers.update({n: r for n, r in zip(ask, replies) if not isinstance(r, str)})
            if any(wanted(a) for a in answers.values()):
                break
        return answers

    async def newest(self, job: str, found: Located | None) -> Located | None:
        """The job's newest step as node 0 records it (the node that commits), so that every
        node's ranks load the same step. On a node other than 0 whose root has a step (`found`):
        node 0's newest when it differs (this root lags: it has not recorded node 0's last commit
        yet, or it was restored from an older copy; or node 0's root is the older one); this
        root's when node 0 does not answer. When no tier before found a step (a replaced node,
        on an empty root): node 0's newest, else the first other node's that answers; None when
        none has one."""
        if found is not None:
            return await self._node0_newest(job, found) if self.cluster.node != 0 else None
        answers = await self._answers(job, 0, newest=True, wanted=lambda a: a.newest is not None)
        for node in sorted(answers):
            step = answers[node].newest
            if step is not None:
                log.info("job %s has no step in this root; node %s's newest committed step is %s", job, node, step)
                return Located(step, self)
        return None

    async def listing(self, job: str, rows: Listing) -> Listing:
        """On a node other than 0 with a root of its own: `rows` ending with node 0's newest step,
        what a load without a step restores on every node (`newest`), so that latest() and List
        answer that step on every node: added (read from a peer, where: node 0) when this root
        has not recorded it yet, moved last when this root holds newer steps than node 0 has.
        `rows` as they are when node 0 does not answer or has no step."""
        if self.cluster.node == 0:
            return rows
        newest = await self._node0s_newest(job)
        if not isinstance(newest, int) or (rows and rows[-1][0].step == newest):
            return rows
        here = next((row for row in rows if row[0].step == newest), None)
        if here is None:
            try:
                summary = StepSummary.of(await self.index(job, newest))
            except CkptdError as exc:
                log.warning("job %s: node 0's newest step %s is not listed: %s", job, newest, exc)
                return rows
            here = (summary, f"{self.cluster.describe(0)}: {job}/{step_dir_name(newest)}", False)
        return [*(row for row in rows if row[0].step != newest), here]

    async def _node0s_newest(self, job: str) -> int | None | str:
        """Node 0's newest committed step of `job` in a root other than this node's; None for a
        shared root or when node 0 has none (a root it lost); why, when node 0 does not answer.
        A node's ranks asking at once ask node 0 once."""
        answer = await self._asking_node0.run(job, lambda: self.cluster.inventory(0, job, 0, newest=True))
        if isinstance(answer, str) or answer.root_id == self.cluster.root_id:
            return answer if isinstance(answer, str) else None
        return answer.newest

    async def _node0_newest(self, job: str, found: Located) -> Located | None:
        """Node 0's newest step of `job` where it is not `found`'s (PeerDisks.newest); None: keep `found`."""
        newest = await self._node0s_newest(job)
        if isinstance(newest, str):
            log.warning("job %s: node 0 does not answer (%s); loading this root's newest step %s", job, newest, found.step)
            return None
        if newest is None or newest == found.step:
            return None  # a shared root, a root node 0 lost (it takes this node's newest), or the same step
        log.warning("job %s: node 0's newest committed step is %s, this root's %s: loading step %s, as node 0's ranks do", job, newest, found.step, newest)
        if await self.engine.committed(job, newest):
            return Located(newest)
        return Located(newest, self)

    async def locate(self, job: str, step: int) -> Located | None:
        """A step this root lacks that a peer committed: read from there (nothing is written here)."""
        return Located(step, self) if await self.holder(job, step) is not None else None

    async def files(self, index: CheckpointIndex, inventories: Mapping[int, PeerInventory]) -> Mapping[int, Mapping[str, int]]:
        return {node: answer.sizes for node, answer in inventories.items()}

    def peers_holding(self, writers: Collection[int]) -> set[int]:
        """A file is in the root of the node that wrote it (node-local roots)."""
        return {w for w in writers if 0 <= w < self.cluster.nodes and w != self.cluster.node}

    async def stage(self, index: CheckpointIndex, reads: Sequence[StagedRead], target: StagingTarget) -> Sequence[Unstaged]:
        """Fetch each range of a peer's file (read.node) into its staging file."""
        for read in reads:
            fd = await asyncio.to_thread(target.open, target.paths[read.file])
            try:
                await self.cluster.fetch(read.node, index.job, index.step, read.file, read.offset, read.nbytes, fd)
            finally:
                os.close(fd)
            self.engine.metrics.load_staged_bytes.labels(self.name.value).inc(read.nbytes)
        return ()

    async def holder(self, job: str, step: int, fresh: bool = False) -> int | None:
        """A node (the lowest) whose root has the step committed, remembered for the next calls
        (fresh: ask again); None when no node that answers has."""
        known = self._holders.get((job, step))
        if known is not None and not fresh:
            return known
        answers = await self._answers(job, step, newest=False, wanted=lambda a: a.committed)
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

        async def read() -> CheckpointIndex:
            node = -1
            try:
                node, data = await self._fetch(job, step, INDEX_NAME)
                return CheckpointIndex.of_step(data, job, step, f"{self.cluster.describe(node)}'s {INDEX_NAME}")
            except (Unavailable, FormatError) as exc:
                raise Precondition(
                    f"step {step} of job {job!r} is not in this node's root, and its index could not be read from {self.cluster.describe(node)}: {exc}"
                ) from None

        return await self.engine.indexes.read((job, step), read, source="peers")

    async def extras(self, job: str, step: int, record: FileRecord) -> dict[int, Any]:
        """Every rank's extras from the extra.json of a peer that committed the step, checked
        against its index record."""
        node = -1
        try:
            node, data = await self._fetch(job, step, record.name)
            check_small_file(record, data)
        except (Unavailable, FormatError) as exc:
            raise Precondition(f"step {step} of job {job!r}: {record.name} could not be read from {self.cluster.describe(node)}: {exc}") from None
        try:
            return parse_extra_json(data, record)
        except FormatError as exc:
            raise Precondition(f"step {step} of job {job!r}: a peer's {record.name}: {exc}") from None
