"""Load broadcast (docs/architecture.md §13): each byte of a step read from storage once per job
on load, not once per node that needs it.

Data-parallel replicas on several nodes need the same files. Without broadcast every node reads
them from a shared root (the job reads each byte once per replica), and with node-local roots
the writer reads its file once for every node that fetches it. `--load-broadcast auto` (the
default) shares the writer's reads among the nodes that fetch from it anyway (node-local roots:
the second item below); `on` also relays a shared root's files (all items), for storage slower
than the network between the nodes: through the peer service, the relay is slower than a fast
shared file system (tests/bench/bench_broadcast.py: 4x the load time on one VM):

- a file of a shared root that another node of the job wrote is fetched from its writer
  (the Peer service's Fetch) instead of read from storage here; no new round trip: the writer
  is in the index (`FileRecord.node`);
- the writer answers from blocks it read once (engine/read_once.py `ReadOnce`), which also
  stage its own ranks' ranges: its ranks read shared memory, not the root;
- a writer that fails or is slow (FETCH_FLOOR_S + bytes / FETCH_RATE seconds for a range) is
  not waited for: the range is read from the shared root here, and the writer is avoided for
  AVOID_S seconds. A load never hangs on a peer, and is never refused because of one.

It is used only where it helps: a load that reads some file from another node (data-parallel
replicas, a resharding load); a node whose ranks read only its own files reads as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable, Collection, Mapping, Sequence

from ckptd.daemon.engine.context import Engine
from ckptd.daemon.engine.read_once import ReadOnce
from ckptd.daemon.engine.tiers import StagingTarget
from ckptd.daemon.errors import CkptdError, Unavailable
from ckptd.daemon.plan.load_plan import NO_ROUTES, BroadcastRoutes, TierName, broadcast_routes
from ckptd.format.file_plan import StagedRead
from ckptd.format.index import CheckpointIndex, FormatError

log = logging.getLogger(__name__)

FETCH_FLOOR_S = 10.0  # a range's fetch from its writer may take this long, plus:
FETCH_RATE = 50 * 2**20  # bytes/s: the slowest writer worth waiting for
AVOID_S = 60.0  # a writer that failed a fetch is not asked again for this long


class Broadcast:
    """This node's part of load broadcast: the routes of a load, the fetches from writers with
    their fall-back to the shared root, and the blocks it reads once (`read_once`)."""

    def __init__(self, engine: Engine, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.enabled = engine.config.load_broadcast != "off" and engine.cluster is not None
        self.relay_shared = engine.config.load_broadcast == "on"  # a shared root: fetch other nodes' files from them
        self.read_once = ReadOnce(engine.storage.files.read_range, on_read=engine.metrics.load_broadcast_bytes.labels("read").inc)
        self._clock = clock
        self._avoid: dict[int, float] = {}  # writer -> until when (clock seconds) it is not asked

    def routes(self, index: CheckpointIndex, where: Mapping[str, int], needed: Collection[str]) -> BroadcastRoutes:
        """The routes of a load needing `needed` (load_plan.broadcast_routes); NO_ROUTES when off."""
        cluster = self.engine.cluster
        if not self.enabled or cluster is None:
            return NO_ROUTES
        now = self._clock()
        for node in [n for n, until in self._avoid.items() if until <= now]:
            del self._avoid[node]
        files = [f for f in index.files if f.name.endswith(".safetensors")]
        avoid = self._avoid if self.relay_shared else range(cluster.nodes)  # auto: files in this root are read here
        return broadcast_routes(files, self.engine.node, cluster.nodes, where, needed, avoid)

    async def fetch(self, index: CheckpointIndex, reads: Sequence[StagedRead], target: StagingTarget, routes: BroadcastRoutes) -> None:
        """Stage `reads` (of files routes.fetch names) from their writers, each range under a
        deadline; a range its writer fails to send is read from this root (the shared root has
        the file), counted as fall-back bytes."""
        cluster = self.engine.cluster
        assert cluster is not None
        metrics = self.engine.metrics
        for read in reads:
            writer = routes.fetch[read.file]
            fd = await asyncio.to_thread(target.open, target.paths[read.file])
            try:
                if writer not in self._avoid:
                    try:
                        deadline = FETCH_FLOOR_S + read.nbytes / FETCH_RATE
                        await asyncio.wait_for(cluster.fetch(writer, index.job, index.step, read.file, read.offset, read.nbytes, fd), deadline)
                        metrics.load_staged_bytes.labels(TierName.PEER_DISK.value).inc(read.nbytes)
                        continue
                    except (CkptdError, asyncio.TimeoutError) as exc:
                        why = str(exc) or f"no answer within {deadline:.0f} s"
                        self._avoid[writer] = self._clock() + AVOID_S
                        log.warning("step %s of job %s: fetching %s from its writer, %s, failed (%s); reading it from the shared root instead "
                                    "(and not asking that node for %.0f s)", index.step, index.job, read.file, cluster.describe(writer), why, AVOID_S,
                                    extra={"job": index.job, "step": index.step})
                try:
                    await asyncio.to_thread(self.engine.storage.files.copy_range, index.job, index.step, read.file, fd, read.offset, read.nbytes)
                except (FormatError, OSError) as exc:
                    raise Unavailable(f"{read.file} of step {index.step} of job {index.job!r} could be read neither from its writer, "
                                      f"{cluster.describe(writer)}, nor from this node's root ({exc})") from None
                metrics.load_broadcast_bytes.labels("fallback").inc(read.nbytes)
                metrics.load_staged_bytes.labels(TierName.ROOT.value).inc(read.nbytes)
            finally:
                os.close(fd)

    async def stage_own(self, index: CheckpointIndex, reads: Sequence[StagedRead], target: StagingTarget) -> None:
        """Stage this node's own `reads` through the blocks read once (which the peers' fetches
        share). Raises FormatError / OSError as the storage does."""
        for read in reads:
            record = index.file(read.file)
            assert record is not None  # planned from this index
            fd = await asyncio.to_thread(target.open, target.paths[read.file])
            try:
                await self.read_once.stage(index, record, read.offset, read.nbytes, fd)
            finally:
                os.close(fd)
            self.engine.metrics.load_staged_bytes.labels(TierName.ROOT.value).inc(read.nbytes)

    async def serve(self, index: CheckpointIndex, name: str, offset: int, nbytes: int) -> bytes | None:
        """A peer's Fetch of bytes [offset, offset + nbytes) of `name`: from the blocks read once
        when broadcast is on and `name` is a data file of the step, else None (the caller reads
        the root). Raises FormatError (a short file) or OSError as the storage does."""
        record = index.file(name) if self.enabled and name.endswith(".safetensors") else None
        if record is None:
            return None
        data = await self.read_once.read(index, record, offset, nbytes)
        self.engine.metrics.load_broadcast_bytes.labels("served").inc(len(data))
        return data

