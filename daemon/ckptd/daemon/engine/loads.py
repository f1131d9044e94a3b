"""Loads: find the step in the tiers, plan where each requested box's bytes are
(plan/load_plan.py), have the tiers stage what the rank cannot read itself into shared memory,
and lease what it reads until LoadDone. The tiers (engine/tiers.py) are asked in their order:
which holds the step (the root, the peers' roots, the bucket), whether one holds it whole in
memory (HELD), and which files each holds; a file is staged by the tier its location names.

A lease (engine/load_leases.py) keeps a held snapshot (and staging files) from being reused or
removed while a rank reads it; it ends at LoadDone, when the client that planned it ends, or
after LOAD_LEASE_S.

A replaced node's daemon stages its own part of a step before its ranks ask (`prefetch`, started
by engine/prefetch.py): whole files, by the same tiers and checks as a load's reads, which a load
of the step then waits for instead of staging them again. How long staged files stay for loads
that have not come yet (a prefetch's, the node's other ranks') is engine/staging_holds.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Awaitable, Callable, Mapping, Sequence

from ckptd.daemon.engine.broadcast import Broadcast
from ckptd.daemon.engine.context import Engine
from ckptd.daemon.engine.load_leases import LoadLeases
from ckptd.daemon.engine.requests import PlanLoad
from ckptd.daemon.engine.root import Root
from ckptd.daemon.engine.sessions import JobState
from ckptd.daemon.engine.staging_holds import StagingHolds
from ckptd.daemon.engine.single_flight import SingleFlight
from ckptd.daemon.engine.staging import StagingFiles
from ckptd.daemon.engine.tiers import Snapshot, StagingTarget, StepCopy, Tier, Tiers, locate
from ckptd.daemon.memo import IdentityMemo
from ckptd.daemon.errors import Exhausted, NotFound, Precondition, Unavailable
from ckptd.format.file_plan import SHM_SOURCE, PlannedPieces, StagedRead, extras_source, rank_extras
from ckptd.format.index import EXTRA_JSON, CheckpointIndex, FileRecord, FormatError
from ckptd.daemon.plan.load_plan import (
    NO_ROUTES,
    BroadcastRoutes,
    LoadPlan,
    Location,
    MemoryPlan,
    MemoryPlans,
    TierName,
    file_locations,
    file_sources,
    incomplete_message,
    load_tier,
    needs_decoding,
    plan_digest,
    plan_pieces,
)
from ckptd.daemon.plan.save_plan import TensorSpec
from ckptd.daemon.records import PeerInventory

log = logging.getLogger(__name__)

EXTRAS_KEPT = 4  # steps whose parsed extra.json loads keep (a restarted daemon's ranks all read the same step's)
ELSEWHERE = -1  # a planned load's node for the files this root lacks, until the peers say which node has them (Loads._plan)
STAGE_ROOM_WAIT_S = 30.0  # seconds a load waits for saves in flight to leave room under --shm-budget for its staging files
Sources = tuple[dict[str, int], dict[str, TierName]]  # Loads._file_sources' answer: file -> node, file -> replica tier
FETCH, READ_ONCE = "broadcast-fetch", "broadcast-read-once"  # the load broadcast's routes among a load's staged reads (beside the tiers)


class DecodingNeeds:
    """needs_decoding of (index, wanted), kept while both are the very same objects: a rank's
    every load of a step asks it again, and it walks every wanted tensor (about 1.5 ms of the
    event loop at 4,000 tensors, per rank and load). Holds the last `size`; the indexes only
    weakly (IdentityMemo): an index the engine's cache dropped is not kept alive here (16
    parsed indexes of 2,000 tensors each grew the daemon by ~10 MB in tests/bench/soak.py)."""

    def __init__(self, size: int = 16) -> None:
        self._memo: IdentityMemo[tuple[bool, bool]] = IdentityMemo(size)

    def of(self, index: CheckpointIndex, wanted: Sequence[TensorSpec]) -> tuple[bool, bool]:
        return self._memo.get((index, wanted), lambda: needs_decoding(index, wanted))


class Loads:
    """PlanLoad and LoadDone; the leases of loads in progress (retention keeps their steps)."""

    def __init__(self, engine: Engine, abort_left_behind: Callable[[JobState, int, int | None, str], Awaitable[None]], tiers: Tiers, root: Root) -> None:
        self.engine = engine
        self._abort_left_behind = abort_left_behind  # Saves.abort_left_behind
        self._tiers = tiers
        self._root = root  # tiers[ROOT]: where a located step's index is read unless a tier names another copy
        self._copies: dict[tuple[str, int], StepCopy] = {}  # steps being loaded that this root lacks (a replaced node): their copy
        self.leases = LoadLeases()
        self._fetches: dict[tuple[str, int, str, int], asyncio.Task[None]] = {}
        self._whole: dict[tuple[str, int, str], asyncio.Task[None]] = {}  # (job, step, file) -> its prefetch (the whole file)
        self._holds = StagingHolds(engine.spawn, self._release_staging)  # staging files kept for loads not come yet
        self._prefetched: dict[tuple[str, int], Sources] = {}  # (job, step) -> where its prefetch staged each file from
        self._planning: dict[tuple[str, int], int] = {}  # (job, step) -> loads being planned: their staging files must stay
        self._memory_plans = MemoryPlans()
        self._decoding = DecodingNeeds()
        self._extras_read: OrderedDict[tuple[str, int, str], dict[int, Any]] = OrderedDict()  # (job, step, checksum) -> every rank's extras
        self._extras_reading: SingleFlight[tuple[str, int, str], dict[int, Any]] = SingleFlight()
        self.staging = StagingFiles(engine.config.shm_dir)
        self.broadcast = Broadcast(engine)

    async def plan(self, request: PlanLoad) -> LoadPlan:
        """Where the bytes of each wanted tensor box are (for the request's rank of its run: its
        open saves are abandoned, another run's never). direct_read: the rank reads committed
        files in this node's root itself; else this daemon copies the needed fragments into
        shared memory first (once however many local ranks want them), for ranks that cannot
        see the root. decodes / decodes_frames: the client decodes quantized codes and residuals
        / codes in zstd frames; a client that cannot is refused (Precondition) before any bytes
        are fetched or staged for it."""
        job, step = request.job, request.step
        engine = self.engine
        state = engine.jobs.get(job)
        if state is not None:
            await self._abort_left_behind(state, request.rank, None, request.run)
        if step is None and state is not None:
            await self._wait_for_writes(state)
        located = await locate(self._tiers.all, job, step)
        if located is None:
            where = engine.storage.location
            raise NotFound(f"job {job!r} has no committed checkpoint in {where}" if step is None else f"step {step} of job {job!r} is not committed in {where}")
        step = located.step
        if located.copy is not None:
            self._copies[(job, step)] = located.copy
        else:
            self._copies.pop((job, step), None)
        index = await self._index(job, step)
        coded, framed = self._decoding.of(index, request.wanted)
        if coded and not request.decodes:
            raise Precondition(
                f"step {step} of job {job!r} is compressed (quantized optimizer state or master-weight residuals) and this "
                "client cannot decode it; upgrade the ckptd client, or load an uncompressed step"
            )
        if framed and not request.decodes_frames:
            raise Precondition(f"step {step} of job {job!r} stores quantized codes in zstd frames, which this client cannot read; upgrade the ckptd client")
        if state is not None:
            state.lineage = index.generation  # the compounding guard of this job's next saves
        self._planning[(job, step)] = self._planning.get((job, step), 0) + 1
        try:
            return await self._plan(request, step, index)
        finally:
            self._planning[(job, step)] -= 1
            if not self._planning[(job, step)]:
                del self._planning[(job, step)]
            self._release_staging(job, step)

    async def _plan(self, request: PlanLoad, step: int, index: CheckpointIndex) -> LoadPlan:
        """The plan of a load of `step` (the request's, or the newest found), from its `index`."""
        job, rank, wanted, direct_read = request.job, request.rank, request.wanted, request.direct_read
        held = next((h for h in (t.snapshot(job, step) for t in self._tiers) if h is not None), None)
        memo_key = (job, rank, direct_read, request.strict, tuple(request.kinds), held.key if held is not None else None)
        memo = self._memory_plans.get(memo_key, held, wanted, step)
        if memo is not None:
            return await self._lease(request, step, held, index, memo, memo.plan_id)
        data_files = [f for f in index.files if f.name.endswith(".safetensors")]
        storage = self.engine.storage

        def local_path(file: str) -> str | None:
            path = storage.files.local_path(job, step, file) if direct_read else None
            return None if path is None else str(path)

        def staging_path(file: str) -> str:
            return str(self.staging.path(job, step, file))

        where: dict[str, int] = {}
        tiers: dict[str, TierName] = {}
        if self.engine.cluster is None:
            locations = file_locations(data_files, self.engine.node, where, local_path, staging_path)
            planned = plan_pieces(index, wanted, request.kinds, request.strict, held, locations, rank)
        else:  # first planned with the files this root lacks staged from nodes not known yet: which files the load reads
            sizes = (await self._root.files(index, {})).get(self.engine.node, {})
            lacking = {f.name: ELSEWHERE for f in data_files if sizes.get(f.name) != f.size}
            first = file_locations(data_files, self.engine.node, lacking, local_path, staging_path)
            planned = plan_pieces(index, wanted, request.kinds, request.strict, held, first, rank)
            needed = [f for f in data_files if f.name in files_read(planned, first)]
            where, tiers = prefetched_sources(self._prefetched.get((job, step)), lambda file: self._whole.get((job, step, file)), needed) or await self._file_sources(index, needed, sizes)
            locations = file_locations(data_files, self.engine.node, where, local_path, staging_path, tiers)
            if all((locations[f.name].path, locations[f.name].staged) == (first[f.name].path, first[f.name].staged) for f in needed):  # the same paths: only the nodes staged from differ
                planned = replace(planned, reads=tuple(StagedRead(r.file, locations[r.file].node, r.offset, r.nbytes) for r in planned.reads))
            else:
                planned = plan_pieces(index, wanted, request.kinds, request.strict, held, locations, rank)
        routes = self.broadcast.routes(index, where, files_read(planned, locations) - set(tiers)) if where else NO_ROUTES  # replicas in memory stay
        if routes.fetch or routes.read_once:  # load broadcast: the same pieces, read from other places
            where = {**where, **routes.fetch}
            locations = file_locations(data_files, self.engine.node, where, lambda f: None if f in routes.read_once else local_path(f), staging_path, tiers)
            planned = plan_pieces(index, wanted, request.kinds, request.strict, held, locations, rank)
        await self._stage_all(index, planned.reads, locations, routes)
        planned = replace(planned, pieces=self.staging.checked_pieces(planned.pieces))
        plan_id = ""
        if held is not None and planned.pieces and not planned.compared and all(p.source == SHM_SOURCE for p in planned.pieces):
            plan_id = plan_digest(planned.pieces)
            self._memory_plans.put(memo_key, MemoryPlan(held, held.layout, wanted, planned.pieces, planned.missing, planned.unexpected, plan_id))
        return await self._lease(request, step, held, index, planned, plan_id)

    async def _lease(
        self, request: PlanLoad, step: int, held: Snapshot | None, index: CheckpointIndex, found: PlannedPieces | MemoryPlan, plan_id: str
    ) -> LoadPlan:
        """The plan of a load with this rank's extras (file_plan.rank_extras), leased (the held
        snapshot stays until LoadDone). found: its pieces and the tensors missing and unexpected."""
        job, rank = request.job, request.rank
        # the held snapshot has the extras of this node's ranks; others (more ranks than at save
        # time, or ranks of other nodes) come from extra.json
        in_memory = held.extras if held is not None else None
        source = extras_source(rank, index.world_size)
        extras_by_rank = in_memory if in_memory is not None and source in in_memory else await self._extras(job, step)
        extras = rank_extras(extras_by_rank, rank, index.world_size)
        state = self.engine.jobs.get(job)
        if state is not None:
            state.pool.mark_used()  # a load is use: the job is not idle (engine/memory.py)
        load_id = self.leases.add(job, step, held, request.client, rank, local_ranks(request, self.engine.cluster is None))
        self.expire_leases()
        tier = "memory" if plan_id else load_tier(found.pieces, held)  # a plan id: every piece is from memory
        self.engine.metrics.loads.labels(tier).inc()
        extras_json = self.engine.extras_texts.text((job, step, rank), extras)
        return LoadPlan(load_id, step, found.pieces, extras, found.missing, found.unexpected, tier, index.generation, plan_id, extras_json)

    async def _wait_for_writes(self, state: JobState) -> None:
        """A restarted trainer asking for the newest step gets the one every rank already handed
        over, not an older one: wait for snapshots that are being written."""
        for session in state.writing():
            try:
                await asyncio.wait_for(session.finished.wait(), session.timeout_s)
            except asyncio.TimeoutError:
                log.warning("step %s of job %s still not written after %s s; loading an older step", session.step, session.job, session.timeout_s)

    async def _file_sources(
        self, index: CheckpointIndex, needed: Sequence[FileRecord], sizes: Mapping[str, int]
    ) -> tuple[dict[str, int], dict[str, TierName]]:
        """Several nodes: which node to read each `needed` data file of the step from, and the
        tier of those read from a replica in memory (load_plan.file_sources over what each tier
        holds: memory here, memory on a peer, disk here, disk on a peer; `sizes`: this root's
        files). Checked before any byte is served, so a load either finds one complete copy of
        what it reads on the nodes present or fails with every missing tensor and the node that
        wrote it. Peers are asked only when neither this root nor this daemon's memory holds a
        needed file (nodes come and go between loads; a node with every file reads without
        waiting for a peer that may be down), first those the tiers expect to hold the lacking files (their writers and
        the writers' buddies: a few nodes, not every node of a large job), then, only if those
        lack some, all the others."""
        cluster, node = self.engine.cluster, self.engine.node
        assert cluster is not None
        inventories: dict[int, PeerInventory] = {}
        unreachable: dict[int, str] = {}
        chosen, missing = await self._choose(index, needed, sizes, inventories)
        if missing:  # neither this root nor this daemon's memory holds them
            first = set().union(*(tier.peers_holding({f.node for f in missing}) for tier in self._tiers))
            others = [n for n in range(cluster.nodes) if n != node]
            for ask in ([n for n in others if n in first], [n for n in others if n not in first]):
                answers = await asyncio.gather(*(cluster.inventory(n, index.job, index.step) for n in ask))
                for other, answer in zip(ask, answers):
                    if isinstance(answer, str):
                        unreachable[other] = answer
                    else:
                        inventories[other] = answer
                chosen, missing = await self._choose(index, needed, sizes, inventories)
                if not missing:
                    break
        if missing:
            raise Precondition(incomplete_message(index, missing, unreachable, cluster.describe))
        in_memory = (TierName.REPLICA_HERE, TierName.REPLICA_PEER)
        return {name: n for name, (_, n) in chosen.items()}, {name: t for name, (t, _) in chosen.items() if t in in_memory}

    async def _choose(
        self, index: CheckpointIndex, needed: Sequence[FileRecord], sizes: Mapping[str, int], inventories: Mapping[int, PeerInventory]
    ) -> tuple[dict[str, tuple[TierName, int]], list[FileRecord]]:
        """load_plan.file_sources of the `needed` files over what each tier holds, the peers'
        `inventories` given: (tier, node) per file, and the files nobody holds."""
        node = self.engine.node
        held: dict[TierName, Mapping[int, Mapping[str, int]]] = {TierName.ROOT: {node: sizes}}
        for tier in self._tiers:
            if tier is not self._root:
                held[tier.name] = await tier.files(index, inventories)
        disk = {**held.get(TierName.ROOT, {}), **held.get(TierName.PEER_DISK, {})}
        memory = {**held.get(TierName.REPLICA_HERE, {}), **held.get(TierName.REPLICA_PEER, {})}
        return file_sources(needed, node, disk, memory)

    async def _stage_all(self, index: CheckpointIndex, reads: Sequence[StagedRead], locations: dict[str, Location], routes: BroadcastRoutes = NO_ROUTES) -> None:
        """Perform a load's staged reads, each tier's at once (tiers[location.tier].stage, or the
        load broadcast's `routes`); made once however many local ranks ask (the reads already
        under way are waited for), removed once no load of the step uses them (_release_staging)."""
        paths = {name: location.path for name, location in locations.items()}
        target = StagingTarget(paths, self.staging.open, lambda file, offset: self.staging.mark_checked(paths[file], offset))
        by_tier: dict[TierName | str, list[StagedRead]] = {}
        waits: list[asyncio.Task[None]] = []
        for read in reads:
            task = self._whole.get((index.job, index.step, read.file))
            if task is None or (task.done() and task.exception() is not None):  # no prefetch of the whole file, or it failed
                task = self._fetches.get((index.job, index.step, read.file, read.offset))
            if task is None or (task.done() and task.exception() is not None):
                self.staging.unmark(paths[read.file], read.offset)
                route = FETCH if read.file in routes.fetch else READ_ONCE if read.file in routes.read_once else locations[read.file].tier
                by_tier.setdefault(route, []).append(read)
            elif task not in waits:
                waits.append(task)
        for name, todo in by_tier.items():
            task = asyncio.get_running_loop().create_task(self._stage_counted(index, name, todo, target, routes))
            for read in todo:
                self._fetches[(index.job, index.step, read.file, read.offset)] = task
            await asyncio.shield(task)
        for task in waits:
            await asyncio.shield(task)

    async def _stage_counted(self, index: CheckpointIndex, route: TierName | str, reads: Sequence[StagedRead], target: StagingTarget, routes: BroadcastRoutes) -> None:
        """Stage `reads` by `route` once the budget has room for their bytes (ArenaMemory.stage_room)."""
        await self.engine.memory.stage_room(index.job, index.step, sum(r.nbytes for r in reads), STAGE_ROOM_WAIT_S)
        await (
            self.broadcast.fetch(index, reads, target, routes) if route == FETCH
            else self._stage_own(index, reads, target) if route == READ_ONCE
            else self._stage(self._tiers[TierName(route)], index, reads, target)
        )

    async def prefetch(self, job: str, step: int) -> int:
        """Stage this node's own data files of `step` whole, before its ranks ask, when this root
        lacks them (a replaced node): from where a load would read them (a replica in a peer's
        memory first, checked as it arrives), into the staging files a load of the step uses.
        Returns the bytes staged (0: the root has them, or they are being prefetched already).
        Raises what a load would (NotFound, Precondition, Unavailable)."""
        key = (job, step)
        located = await locate(self._tiers.all, job, step)
        if located is None or located.step != step:
            raise NotFound(f"step {step} of job {job!r} is not committed on any node reached")
        if located.copy is not None:
            self._copies[key] = located.copy
        index = await self._index(job, step)
        node = self.engine.node
        data_files = [f for f in index.files if f.name.endswith(".safetensors")]
        sizes = (await self._root.files(index, {})).get(node, {})
        lacking = [f for f in data_files if f.node == node and sizes.get(f.name) != f.size]
        if not lacking or key in self._holds or self._loading(key):
            return 0
        self._holds.prefetching(key)
        staged = False
        try:
            where, tiers = await self._file_sources(index, lacking, sizes)
            if self._loading(key):  # a load came meanwhile: it stages what it reads
                return 0
            try:  # only free memory: no other job's snapshot given back, no wait
                await self.engine.memory.stage_room(job, step, sum(f.size for f in lacking), 0.0, evict=False)
            except Exhausted as exc:
                log.info("no prefetch of this node's part of step %s of job %s (its ranks' loads stage it): %s", step, job, exc)
                return 0
            locations = file_locations(data_files, node, where, lambda file: None, lambda file: str(self.staging.path(job, step, file)), tiers)
            paths = {name: location.path for name, location in locations.items()}
            target = StagingTarget(paths, self.staging.open, lambda file, offset: self.staging.mark_whole(paths[file]))
            by_tier: dict[TierName, list[StagedRead]] = {}
            for f in lacking:
                by_tier.setdefault(locations[f.name].tier, []).append(StagedRead(f.name, locations[f.name].node, 0, f.size))
            tasks = []
            for name, reads in by_tier.items():
                task = asyncio.get_running_loop().create_task(self._stage(self._tiers[name], index, reads, target))
                tasks.append(task)
                for read in reads:
                    self.staging.unmark(paths[read.file], 0)
                    self._whole[(job, step, read.file)] = task
            # the step's extras read from a peer meanwhile (kept for the ranks' loads); every task
            # ended, whatever failed, before anything is released
            outcomes = await asyncio.shield(asyncio.gather(*tasks, self._extras(job, step), return_exceptions=True))
            failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
            if failed is not None:
                raise failed
            staged = True
            self._prefetched[key] = (where, tiers)
        finally:
            if staged:
                self._holds.prefetched(key)
            else:  # what did arrive is not kept: a load stages what it reads
                self._holds.drop(key)
                self._release_staging(job, step)
        return sum(f.size for f in lacking)

    def _loading(self, key: tuple[str, int]) -> bool:
        """Whether a load of (job, step) is being planned or staged here."""
        return key in self._planning or any(k[:2] == key for k in self._fetches)

    async def _stage(self, tier: Tier, index: CheckpointIndex, reads: Sequence[StagedRead], target: StagingTarget) -> None:
        """Stage `reads` through `tier`; what it could not (a replica lost or damaged since the
        load was planned) from the disk of the node that wrote the files, which fails the load
        only when that fails too."""
        for missed in await tier.stage(index, reads, target):
            source = missed.source
            log.warning("step %s of job %s: %s; reading node %s's part from its disk instead", index.step, index.job, missed.cause, source,
                        extra={"job": index.job, "step": index.step})
            disk = self._tiers[TierName.ROOT if source == self.engine.node else TierName.PEER_DISK]
            try:
                await disk.stage(index, [StagedRead(r.file, source, r.offset, r.nbytes) for r in missed.reads], target)
            except (Unavailable, Precondition) as exc:
                raise Unavailable(f"{missed.cause}; and reading node {source}'s part from its disk failed too: {exc}") from None

    async def _stage_own(self, index: CheckpointIndex, reads: Sequence[StagedRead], target: StagingTarget) -> None:
        """Stage this root's own `reads` through the broadcast's blocks (read once, shared with
        the peers' fetches); a file missing, unreadable or short is the root's Precondition."""
        try:
            await self.broadcast.stage_own(index, reads, target)
        except (FormatError, OSError) as exc:
            problem = f"{reads[0].file if reads else ''}: {exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)
            raise Precondition(await self._root.damaged(index.job, index.step, problem)) from None

    def _copy(self, job: str, step: int) -> StepCopy:
        """Where the step's index and extras are read: this root, or the copy of the tier that
        found the step when this root lacks it (the peers' roots)."""
        return self._copies.get((job, step), self._root)

    async def _index(self, job: str, step: int) -> CheckpointIndex:
        return await self._copy(job, step).index(job, step)

    async def _extras(self, job: str, step: int) -> dict[int, Any]:
        """Every rank's extras from the step's extra.json, its bytes checked against the index
        first (a file the index does not list is not part of the step: no extras). Read once for
        the ranks that load the step together and kept for the next loads (EXTRAS_KEPT steps),
        by the file's checksum in the index: never another file's. Extras are never changed in place."""
        record = (await self._index(job, step)).file(EXTRA_JSON)
        if record is None:
            return {}
        key = (job, step, record.checksum)
        known = self._extras_read.get(key)
        if known is not None:
            self._extras_read.move_to_end(key)
            return known
        return await self._extras_reading.run(key, lambda: self._copy(job, step).extras(job, step, record), lambda extras: self._keep_extras(key, extras))

    def _keep_extras(self, key: tuple[str, int, str], extras: dict[int, Any]) -> None:
        self._extras_read[key] = extras
        while len(self._extras_read) > EXTRAS_KEPT:
            del self._extras_read[next(iter(self._extras_read))]

    def done(self, load_id: str) -> None:
        """LoadDone: the rank has read what it needed."""
        lease = self.leases.pop(load_id)  # its snapshot released: idle now, it may be reused or given back
        if lease is None:
            return
        if any(self._staging_of(lease.job, lease.step)):  # files staged: kept for the node's other ranks
            self._holds.load_done((lease.job, lease.step), lease.rank, lease.local_ranks)
        self._release_staging(lease.job, lease.step)

    def drop_kept_staging(self) -> bool:
        """Memory is short: remove the staging files only a hold keeps (late ranks stage again); whether any went."""
        before = self.engine.memory.staging_bytes()
        for job, step in self._holds.end_waiting():
            self._release_staging(job, step)
        return self.engine.memory.staging_bytes() < before

    def _release_staging(self, job: str, step: int) -> None:
        """Remove the step's staging files (shared memory, else held until shutdown) once no load
        plans or reads them and no hold keeps them (engine/staging_holds.py); later loads stage again."""
        if (job, step) in self._planning or (job, step) in self._holds or self.leases.reading(job, step):
            return
        keys, whole = self._staging_of(job, step)
        if any(not self._fetches[k].done() for k in keys) or any(not self._whole[k].done() for k in whole):  # fetches run inside plan() or a hold: not expected
            return
        for key in keys:
            del self._fetches[key]
        for file_key in whole:
            del self._whole[file_key]
        self._prefetched.pop((job, step), None)
        self._holds.forget((job, step))
        for file in {key[2] for key in keys} | {key[2] for key in whole}:  # a fetch per range, many ranges per file
            detached = self.staging.detach(self.staging.path(job, step, file))
            if detached is not None:  # its pages freed off the loop: LoadDone answers at once
                self.engine.spawn(asyncio.to_thread(self.staging.free, detached))
        self.engine.memory.staging_removed(job, step)

    def _staging_of(self, job: str, step: int) -> tuple[list[tuple[str, int, str, int]], list[tuple[str, int, str]]]:
        """The step's staging: its loads' fetches (a range each) and its prefetched files."""
        return [k for k in self._fetches if k[:2] == (job, step)], [k for k in self._whole if k[:2] == (job, step)]

    def client_gone(self, job: str, client: str) -> None:
        """A client of `job` ended (exited, maybe mid-load): the loads it did not finish are done."""
        for load_id in self.leases.of_client(job, client):
            self.done(load_id)

    def expire_leases(self) -> None:
        for load_id in self.leases.expired():
            self.done(load_id)

    def leased_steps(self, job: str) -> set[int]:
        """The steps of `job` that loads are reading (retention keeps them)."""
        self.expire_leases()
        return self.leases.steps(job)

    def close(self) -> None:
        self.staging.close()


def local_ranks(request: PlanLoad, single_node: bool) -> int:
    """How many of the job's ranks load through this daemon: the rank's local world; every rank
    on a single node; 1 when a rank of a cluster does not say (an older client)."""
    if request.local_world_size:
        return request.local_world_size
    return request.world_size if single_node else 1


def files_read(planned: PlannedPieces, locations: Mapping[str, Location]) -> set[str]:
    """The data files a planned load reads (its pieces' and staged reads' files)."""
    by_path = {location.path: name for name, location in locations.items()}
    return {by_path[p.path] for p in planned.pieces if p.path in by_path} | {r.file for r in planned.reads}


def prefetched_sources(known: Sources | None, prefetch_of: Callable[[str], "asyncio.Task[None] | None"], needed: Sequence[FileRecord]) -> Sources | None:
    """Where a prefetch staged each `needed` file from (`known`: what _file_sources answered it;
    `prefetch_of(file)`: its staging task), when it staged every one of them and none failed: a
    load of the step then asks no peer. None otherwise."""
    if known is None:
        return None
    for f in needed:
        task = prefetch_of(f.name)
        if f.name not in known[0] or task is None or (task.done() and task.exception() is not None):
            return None
    return {f.name: known[0][f.name] for f in needed}, {f.name: known[1][f.name] for f in needed if f.name in known[1]}
