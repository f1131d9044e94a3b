"""Loads: find the step, plan where each requested box's bytes are (plan/load_plan.py), stage
what the rank cannot read itself into shared memory, and lease what it reads until LoadDone.

A lease keeps a held snapshot (and staging files) from being reused or removed while a rank
reads it; leases expire after LOAD_LEASE_S (a rank that died mid-load).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence

from ckptd.daemon.engine.context import Engine
from ckptd.daemon.engine.sessions import JobState
from ckptd.daemon.engine.staging import StagingFiles
from ckptd.daemon.errors import NotFound, Precondition, Unavailable
from ckptd.format.index import EXTRA_JSON, CheckpointIndex, FormatError, parse_extra_json
from ckptd.format.units import Unit, file_units
from ckptd.daemon.handoff.arena import ArenaSet
from ckptd.daemon.plan.load_plan import (
    LoadPlan,
    Location,
    MemoryPlan,
    MemoryPlans,
    PieceInfo,
    StagedRead,
    Tier,
    extras_source,
    file_locations,
    file_sources,
    incomplete_message,
    load_tier,
    needs_decoding,
    plan_digest,
    plan_pieces,
    rank_extras,
)
from ckptd.daemon.plan.save_plan import TensorSpec
from ckptd.daemon.tiers.peer_disks import PeerSteps
from ckptd.daemon.tiers.replicas import Replication

log = logging.getLogger(__name__)

LOAD_LEASE_S = 3600.0


@dataclass
class LoadLease:
    job: str
    step: int
    arenas: ArenaSet | None
    expires: float  # monotonic seconds


class Loads:
    """PlanLoad and LoadDone; the leases of loads in progress (retention keeps their steps)."""

    def __init__(
        self, engine: Engine, abort_left_behind: Callable[[JobState, int, int | None, str], Awaitable[None]], replication: Replication | None = None
    ) -> None:
        self.engine = engine
        self._abort_left_behind = abort_left_behind  # Saves.abort_left_behind
        self._replication = replication  # tier 0b: replicas held here and on peers (several nodes)
        self._peer_steps = PeerSteps(engine) if engine.cluster is not None else None
        self._remote: set[tuple[str, int]] = set()  # steps being loaded that this root lacks (a replaced node): read from peers
        self.leases: dict[str, LoadLease] = {}
        self._fetches: dict[tuple[str, int, str, int], asyncio.Task[None]] = {}
        self._planning: dict[tuple[str, int], int] = {}  # (job, step) -> loads being planned: their staging files must stay
        self._memory_plans = MemoryPlans()
        self.staging = StagingFiles(engine.config.shm_dir)

    async def plan(
        self,
        job: str,
        rank: int,
        world_size: int,
        step: int | None,
        wanted: Sequence[TensorSpec],
        kinds: Sequence[str],
        strict: bool,
        direct_read: bool = True,
        decodes: bool = True,
        decodes_frames: bool = True,
        run: str = "",
    ) -> LoadPlan:
        """Where the bytes of each wanted tensor box are (for rank `rank` of `run`: its open
        saves are abandoned, another run's never). direct_read: the rank reads committed
        files in this node's root itself; else this daemon copies the needed fragments into
        shared memory first (once however many local ranks want them), for ranks that cannot
        see the root. decodes / decodes_frames: the client decodes quantized codes and residuals
        / codes in zstd frames; a client that cannot is refused (Precondition) before any bytes
        are fetched or staged for it."""
        engine = self.engine
        storage = engine.storage
        remote = False  # the step is not in this root: index and extras come from a peer (PeerSteps)
        state = engine.jobs.get(job)
        if state is not None:
            await self._abort_left_behind(state, rank, None, run)
        if step is None:
            if state is not None:
                await self._wait_for_writes(state)
            step = await asyncio.to_thread(storage.latest_step, job)
            if step is None and self._peer_steps is not None:  # a replaced node, on an empty root
                step = await self._peer_steps.newest(job)
                remote = step is not None
            if not remote and engine.remote is not None and await engine.remote.restore_newest(job):  # the object store's newer step, downloaded
                step = await asyncio.to_thread(storage.latest_step, job)
            if step is None:
                raise NotFound(f"job {job!r} has no committed checkpoint in {storage.location}")
        elif not await engine.committed(job, step):
            remote = self._peer_steps is not None and await self._peer_steps.holder(job, step) is not None
            if not remote and not (engine.remote is not None and await engine.remote.restore_step(job, step)):  # last: the object store
                raise NotFound(f"step {step} of job {job!r} is not committed in {storage.location}")
        if remote:
            self._remote.add((job, step))
        else:
            self._remote.discard((job, step))
        index = await self._index(job, step)
        coded, framed = needs_decoding(index, wanted)
        if coded and not decodes:
            raise Precondition(
                f"step {step} of job {job!r} is compressed (quantized optimizer state or master-weight residuals) and this "
                "client cannot decode it; upgrade the ckptd client, or load an uncompressed step"
            )
        if framed and not decodes_frames:
            raise Precondition(f"step {step} of job {job!r} stores quantized codes in zstd frames, which this client cannot read; upgrade the ckptd client")
        if state is not None:
            state.lineage = index.generation  # the compounding guard of this job's next saves
        self._planning[(job, step)] = self._planning.get((job, step), 0) + 1
        try:
            return await self._plan(job, rank, step, index, state, wanted, kinds, strict, direct_read)
        finally:
            self._planning[(job, step)] -= 1
            if not self._planning[(job, step)]:
                del self._planning[(job, step)]
            self._release_staging(job, step)

    async def _plan(
        self,
        job: str,
        rank: int,
        step: int,
        index: CheckpointIndex,
        state: JobState | None,
        wanted: Sequence[TensorSpec],
        kinds: Sequence[str],
        strict: bool,
        direct_read: bool,
    ) -> LoadPlan:
        held = state.pool.held(step) if state is not None else None
        memo_key = (job, rank, direct_read, strict, tuple(kinds), id(held))
        memo = self._memory_plans.get(memo_key, held, wanted, step)
        if memo is not None:
            return await self._lease(job, rank, step, held, index, memo.pieces, memo.missing, memo.unexpected, memo.plan_id)
        data_files = [f for f in index.files if f.name.endswith(".safetensors")]
        where, tiers = await self._file_sources(index) if self.engine.cluster is not None else ({}, {})
        storage = self.engine.storage

        def local_path(file: str) -> str | None:
            path = storage.local_path(job, step, file) if direct_read else None
            return None if path is None else str(path)

        locations = file_locations(data_files, self.engine.node, where, local_path, lambda f: str(self.staging.path(job, step, f)), tiers)
        planned = plan_pieces(index, wanted, kinds, strict, held, locations, rank)
        await self._stage_all(index, planned.reads, locations)
        plan_id = ""
        if held is not None and planned.pieces and all(p.source == "shm" for p in planned.pieces):
            plan_id = plan_digest(planned.pieces)
            self._memory_plans.put(memo_key, MemoryPlan(held, held.plan, wanted, planned.pieces, planned.missing, planned.unexpected, plan_id))
        return await self._lease(job, rank, step, held, index, planned.pieces, planned.missing, planned.unexpected, plan_id)

    async def _lease(
        self,
        job: str,
        rank: int,
        step: int,
        held: ArenaSet | None,
        index: CheckpointIndex,
        pieces: tuple[PieceInfo, ...],
        missing: tuple[str, ...],
        unexpected: tuple[str, ...],
        plan_id: str,
    ) -> LoadPlan:
        """The plan of a load with this rank's extras (load_plan.rank_extras), leased (the held
        snapshot stays until LoadDone)."""
        # the held snapshot has the extras of this node's ranks; others (more ranks than at save
        # time, or ranks of other nodes) come from extra.json
        in_memory = held.extras if held is not None else None
        source = extras_source(rank, index.world_size)
        extras_by_rank = in_memory if in_memory is not None and source in in_memory else await self._extras(job, step)
        extras = rank_extras(extras_by_rank, rank, index.world_size)
        load_id = uuid.uuid4().hex
        state = self.engine.jobs.get(job)
        if state is not None:
            state.pool.mark_used()  # a load is use: the job is not idle (engine/memory.py)
        if held is not None:
            held.readers += 1
        self.leases[load_id] = LoadLease(job, step, held, time.monotonic() + LOAD_LEASE_S)
        self.expire_leases()
        tier = load_tier(pieces, held)
        self.engine.metrics.loads.labels(tier).inc()
        return LoadPlan(load_id, step, pieces, extras, missing, unexpected, tier, index.generation, plan_id)

    async def _wait_for_writes(self, state: JobState) -> None:
        """A restarted trainer asking for the newest step gets the one every rank already handed
        over, not an older one: wait for snapshots that are being written."""
        for session in state.writing():
            try:
                await asyncio.wait_for(session.finished.wait(), session.timeout_s)
            except asyncio.TimeoutError:
                log.warning("step %s of job %s still not written after %s s; loading an older step", session.step, session.job, session.timeout_s)

    async def _file_sources(self, index: CheckpointIndex) -> tuple[dict[str, int], dict[str, Tier]]:
        """Several nodes: which node to read each data file of the step from, and the tier of
        those read from a replica in memory (load_plan.file_sources: memory here, memory on a
        peer, disk here, disk on a peer). Checked before any byte is served, so a load either
        finds one complete copy on the nodes present or fails with every missing tensor and the
        node that wrote it. The peers are asked on every load that lacks a file here (nodes
        come and go between loads), and only then: a node with every file reads its root
        without waiting for a peer that may be down."""
        cluster, node = self.engine.cluster, self.engine.node
        assert cluster is not None
        data_files = [f for f in index.files if f.name.endswith(".safetensors")]
        writer = {f.name: f.node for f in data_files}

        def replicas(held: Sequence[tuple[int, str, int]]) -> dict[str, int]:
            return {name: size for source, name, size in held if writer.get(name) == source}

        sizes = await asyncio.to_thread(self.engine.storage.step_file_sizes, index.job, index.step)
        disk: dict[int, dict[str, int]] = {node: sizes}
        here = self._replication.store.files_of(index.job, index.step) if self._replication is not None else []
        memory: dict[int, dict[str, int]] = {node: replicas(here)}
        unreachable: dict[int, str] = {}
        if any(sizes.get(f.name) != f.size for f in data_files):
            others = [n for n in range(cluster.nodes) if n != node]
            answers = await asyncio.gather(*(cluster.inventory(n, index.job, index.step) for n in others))
            for other, answer in zip(others, answers):
                if isinstance(answer, str):
                    unreachable[other] = answer
                    continue
                disk[other] = answer.sizes
                memory[other] = replicas(answer.replicas)
        chosen, missing = file_sources(data_files, node, disk, memory)
        if missing:
            raise Precondition(incomplete_message(index, missing, unreachable, cluster.describe))
        return {name: n for name, (_, n) in chosen.items()}, {name: t for name, (t, _) in chosen.items() if t in (Tier.MEMORY_LOCAL, Tier.MEMORY_PEER)}

    async def _stage_all(self, index: CheckpointIndex, reads: Sequence[StagedRead], locations: dict[str, Location]) -> None:
        """Perform a load's staged reads: those of replicas in a peer's memory in one batch per
        holder (merged ranges, parallel connections: Replication.fetch), the others in turn."""
        batches: dict[int, list[StagedRead]] = {}
        units = self._units(index) if any(location.tier in (Tier.MEMORY_LOCAL, Tier.MEMORY_PEER) for location in locations.values()) else {}
        for read in reads:
            if locations[read.file].tier is Tier.MEMORY_PEER and self._replication is not None:
                batches.setdefault(read.node, []).append(read)
            else:
                await self._stage(index, read, locations[read.file], units)
        waits: set[asyncio.Task[None]] = set()
        for holder, batch in batches.items():
            todo = []
            for read in batch:
                task = self._fetches.get((index.job, index.step, read.file, read.offset))
                if task is None or (task.done() and task.exception() is not None):
                    todo.append(read)
                else:
                    waits.add(task)
            if todo:
                task = asyncio.get_running_loop().create_task(self._fetch_replica(index, holder, todo, locations, units))
                for read in todo:
                    self._fetches[(index.job, index.step, read.file, read.offset)] = task
                waits.add(task)
        for task in waits:
            await asyncio.shield(task)

    def _units(self, index: CheckpointIndex) -> dict[str, tuple[Unit, ...]]:
        """The checksum units of the step's data files, by which bytes staged from a replica are
        checked (units.file_units); none when the index's records do not tile its files (logged:
        the ranks still check what they read)."""
        try:
            return file_units(index)
        except FormatError as exc:
            log.warning("step %s of job %s: replicas are staged unchecked: %s", index.step, index.job, exc)
            return {}

    async def _fetch_replica(
        self, index: CheckpointIndex, holder: int, reads: Sequence[StagedRead], locations: dict[str, Location], units: Mapping[str, Sequence[Unit]]
    ) -> None:
        """Receive ranges of replicas that `holder` keeps in memory into their staging files,
        checked against `units`; a holder that cannot serve them, or serves damaged bytes, makes
        them be read from the disk of the node that wrote them."""
        assert self._replication is not None
        writer = {f.name: f.node for f in index.files}
        fds: dict[str, int] = {}
        try:
            for read in reads:
                if read.file not in fds:
                    fds[read.file] = await asyncio.to_thread(self.staging.open, locations[read.file].path)
            by_source: dict[int, list[tuple[str, int, int, int]]] = {}
            for read in reads:
                by_source.setdefault(writer[read.file], []).append((read.file, read.offset, read.nbytes, fds[read.file]))
            for source, ranges in by_source.items():
                try:
                    await self._replication.fetch(holder, index.job, index.step, source, ranges, units)
                except Unavailable as exc:
                    # The holder lost the replica since the load was planned (a newer step replaced
                    # it, its daemon restarted), or its copy is damaged: the node that wrote the
                    # file still has it on disk.
                    log.warning("step %s of job %s: %s; reading node %s's part from its disk instead", index.step, index.job, exc, source,
                                extra={"job": index.job, "step": index.step})
                    await self._stage_from_disk(index, source, [r for r in reads if writer[r.file] == source], locations, exc)
        finally:
            for fd in fds.values():
                os.close(fd)

    async def _stage_from_disk(
        self, index: CheckpointIndex, source: int, reads: Sequence[StagedRead], locations: dict[str, Location], cause: Unavailable | NotFound
    ) -> None:
        """Stage reads of `source`'s files from its root (this node's when it is `source`), into
        the same staging files the replica read was filling."""
        tier = Tier.DISK_LOCAL if source == self.engine.node else Tier.DISK_PEER
        try:
            for read in reads:
                location = Location(tier, source, locations[read.file].path, staged=True)
                await self._fetch_into(location, index, StagedRead(read.file, source, read.offset, read.nbytes))
        except (Unavailable, Precondition) as exc:
            raise Unavailable(f"{cause}; and reading node {source}'s part from its disk failed too: {exc}") from None

    async def _stage(self, index: CheckpointIndex, read: StagedRead, location: Location, units: Mapping[str, Sequence[Unit]]) -> None:
        """Copy a range of a file (this node's, or a peer's) to the same offset of its staging
        file in shared memory; made once however many local ranks ask, removed once no load of
        the step uses it (_release_staging)."""
        key = (index.job, index.step, read.file, read.offset)
        task = self._fetches.get(key)
        if task is None or (task.done() and task.exception() is not None):
            task = asyncio.get_running_loop().create_task(self._fetch_into(location, index, read, units))
            self._fetches[key] = task
        await asyncio.shield(task)

    async def _fetch_into(self, location: Location, index: CheckpointIndex, read: StagedRead, units: Mapping[str, Sequence[Unit]] | None = None) -> None:
        """Stage one read from its location. A replica held here is copied and checked against
        `units`; a damaged one is read from the disk of the node that wrote the file instead."""
        engine = self.engine
        fd = await asyncio.to_thread(self.staging.open, location.path)
        try:
            if location.tier is Tier.MEMORY_LOCAL and self._replication is not None:
                source = next(f.node for f in index.files if f.name == read.file)
                try:
                    await asyncio.to_thread(
                        self._replication.copy_local, index.job, index.step, source, read.file, read.offset, read.nbytes, fd, units or {}
                    )
                except (Unavailable, NotFound) as exc:  # damaged, or replaced by a newer step's since the load was planned
                    log.warning("step %s of job %s: %s; reading node %s's part from its disk instead", index.step, index.job, exc, source,
                                extra={"job": index.job, "step": index.step})
                    await self._stage_from_disk(index, source, [read], {read.file: location}, exc)
            elif read.node == engine.node:
                try:
                    await asyncio.to_thread(engine.storage.copy_range, index.job, index.step, read.file, fd, read.offset, read.nbytes)
                except (FormatError, OSError) as exc:
                    # A data file of the step is missing, unreadable or short: name it and say what
                    # to do, as a damaged extra.json or index does (_extras, Engine.index).
                    path = f"{engine.storage.step_location(index.job, index.step)}/{read.file}"
                    problem = (
                        f"{path} is missing" if isinstance(exc, FileNotFoundError)
                        else f"cannot read {path}: {exc.strerror or exc}" if isinstance(exc, OSError)
                        else str(exc)
                    )
                    raise Precondition(await self._damaged(index.job, index.step, problem)) from None
            else:
                assert engine.cluster is not None
                await engine.cluster.fetch(read.node, index.job, index.step, read.file, read.offset, read.nbytes, fd)
            if location.tier is not Tier.MEMORY_LOCAL:
                engine.metrics.load_staged_bytes.labels(location.tier.value).inc(read.nbytes)
        finally:
            os.close(fd)

    async def _damaged(self, job: str, step: int, problem: str) -> str:
        """The message for a committed step that cannot be loaded: what, and what to do."""
        storage = self.engine.storage
        older = [s for s in await asyncio.to_thread(storage.committed_steps, job) if s < step]
        example = f"load(state, step={older[-1]})" if older else "load(state, step=N)"
        return (
            f"step {step} of job {job!r} cannot be loaded: {problem}; load an older step (`{example}`), "
            f"and see what else is damaged with `ckptd verify {storage.step_location(job, step)}`"
        )

    def _from_peers(self, job: str, step: int) -> PeerSteps | None:
        """The peers' steps when this step is loaded from them (this root lacks it), else None."""
        return self._peer_steps if (job, step) in self._remote else None

    async def _index(self, job: str, step: int) -> CheckpointIndex:
        peers = self._from_peers(job, step)
        return await peers.index(job, step) if peers is not None else await self.engine.index(job, step)

    async def _extras(self, job: str, step: int) -> dict[int, Any]:
        """Every rank's extras from the step's extra.json, its bytes checked against the index
        first (a file the index does not list is not part of the step: no extras)."""
        record = next((f for f in (await self._index(job, step)).files if f.name == EXTRA_JSON), None)
        if record is None:
            return {}
        peers = self._from_peers(job, step)
        if peers is not None:
            data = await peers.small_file(job, step, record)  # checked against the record
            try:
                return parse_extra_json(data, record)
            except FormatError as exc:
                raise Precondition(f"step {step} of job {job!r}: a peer's {EXTRA_JSON}: {exc}") from None
        storage = self.engine.storage
        try:
            data = await asyncio.to_thread(storage.read_small, job, step, EXTRA_JSON)  # no link followed, no FIFO waited on
            return parse_extra_json(data, record)
        except (OSError, FormatError) as exc:
            problem = f"{EXTRA_JSON} is missing" if isinstance(exc, FileNotFoundError) else str(exc)
            raise Precondition(await self._damaged(job, step, problem)) from None

    def done(self, load_id: str) -> None:
        """LoadDone: the rank has read what it needed."""
        lease = self.leases.pop(load_id, None)
        if lease is None:
            return
        if lease.arenas is not None:
            lease.arenas.readers = max(0, lease.arenas.readers - 1)
            state = self.engine.jobs.get(lease.job)
            if state is not None:
                state.pool.mark_used()
                self.engine.memory.settle(state)  # the snapshot may be idle now: reusable, or given back
        self._release_staging(lease.job, lease.step)

    def _release_staging(self, job: str, step: int) -> None:
        """Remove the step's staging files (shared memory) once no load of the step is being
        planned or reading: they would otherwise hold host memory until shutdown. A later load
        of the step fetches again."""
        if (job, step) in self._planning or any(lease.job == job and lease.step == step for lease in self.leases.values()):
            return
        keys = [k for k in self._fetches if k[:2] == (job, step)]
        if any(not self._fetches[k].done() for k in keys):  # fetches run inside plan(): not expected
            return
        for key in keys:
            del self._fetches[key]
            self.staging.remove(self.staging.path(job, step, key[2]))

    def expire_leases(self) -> None:
        now = time.monotonic()
        for load_id, lease in list(self.leases.items()):
            if lease.expires < now:
                self.done(load_id)

    def leased_steps(self, job: str) -> set[int]:
        """The steps of `job` that loads are reading (retention keeps them)."""
        self.expire_leases()
        return {lease.step for lease in self.leases.values() if lease.job == job}

    def close(self) -> None:
        self.staging.close()

