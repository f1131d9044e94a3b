"""The replica tiers (REPLICA_HERE, REPLICA_PEER): each node's part of its newest committed step, held in the memory of buddy daemons
(docs/architecture.md §9), and when a step is *recoverable*.

After a commit, each node offers its data files of the step (the bytes as written) to its
buddies, nodes i+1..i+r (mod n) for r = --replicas (`buddies`): whichever one node is lost,
every node's part is still in memory somewhere. A buddy that takes the offer (its budget:
tiers/replica_store.py) answers with a ticket for its bulk port (tiers/bulk.py); the node sends the
files there from a thread, at most at --replica-bandwidth, and the buddy says whether it checked
and published them. A newer commit of the job cancels a push under way. The node then tells
node 0 which buddies hold its part; node 0 reports the step recoverable (log, metric, `ckptd
status`) once every node that wrote data files of it has its part held by another node too.

The other roles of a daemon: take offers (`offer`), serve ranges of what it holds to loading
nodes (`read`), and fetch ranges from a holder into staging files for its own loads (`fetch`,
`copy_local`). All byte moving runs in threads, off the event loop.

Every byte of a replica is checked against the step's index twice, as it passes (nothing is
read back to be checked): by the buddy as it arrives (the offer carries each file's checksum
units; a file that does not match is not kept) and by a loading node as it is staged (the
ranges read are widened to whole units first, and cut only between units).
A copy found damaged when loaded is named as the holder's (log, error, metric
`ckptd_replica_damaged_total{where="load"}`) and the load reads those ranges from the disk of
the node that wrote them instead (engine/loads.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterator, Mapping, Protocol, Sequence

from ckptd.common.sizes import human_bytes
from ckptd.daemon.engine.context import Engine
from ckptd.daemon.errors import InvalidRequest, Precondition, Unavailable
from ckptd.format.index import CheckpointIndex, FileRecord, FormatError
from ckptd.format.units import Unit, UnitCheck, file_units
from ckptd.daemon.plan.load_plan import TierName
from ckptd.daemon.records import BulkAnswer, JobReplicas, ReplicaStatus
from ckptd.daemon.tiers.bulk import (
    BUFFER_BYTES,
    BulkError,
    BulkServer,
    Pacer,
    connect,
    move_into_file,
    recv_into_file,
    recv_status,
    send_chunks,
    send_file_ranges,
    send_status,
    split_evenly,
    tls_contexts,
)
from ckptd.daemon.tiers.replica_ranges import Range, cut_ranges, merge_ranges, units_in, units_within, widen_to_units
from ckptd.daemon.tiers.replica_store import Damaged, Receipt, Refused, ReplicaStore, close_fds, open_ranges

log = logging.getLogger(__name__)

PUSH_SLICE_BYTES = 8 * 2**20  # read from storage and sent per step of a push
FETCH_STREAMS = 4  # connections a load's fetch from one holder uses at most (and no more than this host's cores)
STREAM_MIN_BYTES = 32 * 2**20  # ... each with at least this much to move
PUBLISH_TIMEOUT_S = 30.0
STEPS_TRACKED = 4  # node 0: recent steps per job whose parts it tracks
HOLDERS_CHECK_S = 5.0  # node 0: how often the holders of a recoverable step are asked whether they still keep it

class ReplicaCalls(Protocol):
    """The Peer calls of the replica tiers (replica_links.ReplicaLinks; the engine speaks no gRPC)."""

    def host_of(self, node: int) -> str:
        """The host of a node's --peers entry (its bulk port listens there too)."""

    async def offer(self, node: int, job: str, step: int, files: Sequence[FileRecord], units: Mapping[str, Sequence[Unit]]) -> BulkAnswer | str:
        """Offer this node's part of a committed step to `node` (with each file's checksum units):
        its answer, or why it did not answer."""

    async def read(self, node: int, job: str, step: int, source: int, ranges: Sequence[tuple[str, int, int]]) -> BulkAnswer:
        """A ticket to receive ranges of the replica of `source`'s part that `node` holds (Unavailable: none)."""

    async def held(self, job: str, step: int, holders: Sequence[int], error: str) -> str:
        """Tell node 0 which nodes hold this node's part of a committed step; "" or why it did not answer."""

    async def held_parts(self) -> list[tuple[str, int, tuple[int, ...]]] | str:
        """Ask node 0 where this node's parts of the jobs' newest steps are held: (job, step,
        holders) each, or why it did not answer."""


def buddies(node: int, nodes: int, replicas: int) -> tuple[int, ...]:
    """The nodes that hold `node`'s part in memory: the next `replicas` nodes, wrapping around
    (at most nodes - 1: a node is never its own buddy). Any `replicas` nodes lost, every
    node's part is still held by a node that is not lost (tests/daemon/test_replicas.py)."""
    return tuple((node + k) % nodes for k in range(1, min(replicas, nodes - 1) + 1))


@dataclass
class PushState:
    """This node's newest push of a job's part (ckptd status)."""

    step: int
    holders: tuple[int, ...] = ()
    error: str = ""
    done: bool = False


@dataclass
class _StepParts:
    needed: frozenset[int]  # the nodes that wrote data files of the step
    holders: dict[int, tuple[int, ...]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)


class Recoverability:
    """Node 0: where each node's part of a job's recent steps is held, and the newest step
    whose every part is held by another node too (recoverable from memory)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._steps: dict[str, OrderedDict[int, _StepParts]] = {}
        self.recoverable: dict[str, int] = {}  # job -> newest recoverable step
        self.problems: dict[str, str] = {}  # job -> why its newest reported step is not recoverable

    def report(self, job: str, step: int, needed: frozenset[int], node: int, holders: Sequence[int], error: str) -> None:
        steps = self._steps.setdefault(job, OrderedDict())
        parts = steps.setdefault(step, _StepParts(needed))
        while len(steps) > STEPS_TRACKED:
            steps.popitem(last=False)
        parts.holders[node] = tuple(holders)
        if error:
            parts.errors[node] = error
        if all(parts.holders.get(n) for n in parts.needed):
            current = self.recoverable.get(job)
            order = list(steps)
            if current is None or current not in steps or order.index(current) <= order.index(step):
                if current != step:
                    where = ", ".join(f"node {n} -> {list(parts.holders[n])}" for n in sorted(parts.needed))
                    log.info("step %s of job %s is recoverable from memory: every node's part is held by another node (%s)", step, job, where, extra={"job": job, "step": step})
                self.recoverable[job] = step
                self.problems.pop(job, None)
                self.engine.metrics.recoverable_step.labels(job).set(step)
        elif not holders:
            self.problems[job] = f"step {step}: node {node}'s part is held by no other node ({error or 'no buddy'})"
            log.warning("step %s of job %s is not recoverable from memory: %s; it is durable on disk", step, job, self.problems[job], extra={"job": job, "step": step})

    def parts_of(self, node: int) -> list[tuple[str, int, tuple[int, ...]]]:
        """(job, step, holders) of `node`'s part of each job's newest reported step, for the jobs
        that `node` wrote data files of that step of and whose part other nodes hold, by job
        name. Not only recoverable steps: a replaced node's own part is still held when the part
        it held for another node went with it (which makes the step not recoverable)."""
        parts = []
        for job, steps in sorted(self._steps.items()):
            step = max(steps)
            held = steps[step]
            if node in held.needed and held.holders.get(node):
                parts.append((job, step, held.holders[node]))
        return parts

    async def recheck(self, holds: Callable[[int, str, int, int], Awaitable[str]], newest: Callable[[str], int | None]) -> None:
        """Ask the holders of each job's recoverable step whether they still keep the parts (a
        buddy lost or restarted since holds nothing); a part that no holder keeps makes the step
        not recoverable. `holds(holder, job, step, node)`: "" when `holder` keeps node's part of
        the step, else why not. `newest(job)`: the job's newest commit here (None: unknown); once
        a newer step is committed its pushes replace the replicas of this one, which is no loss:
        the newer step's reports decide."""
        for job, step in list(self.recoverable.items()):
            if newest(job) not in (None, step):
                continue
            tracked = self._steps.get(job)
            parts = tracked.get(step) if tracked is not None else None
            if parts is None:
                continue
            for node in sorted(parts.needed):
                holders = parts.holders.get(node, ())
                answers = await asyncio.gather(*(holds(h, job, step, node) for h in holders))
                parts.holders[node] = tuple(h for h, why in zip(holders, answers) if not why)
                if not parts.holders[node] and self.recoverable.get(job) == step:
                    why = "; ".join(f"node {h} {w}" for h, w in zip(holders, answers))
                    del self.recoverable[job]
                    self.problems[job] = f"step {step}: node {node}'s part is no longer held by another node ({why})"
                    self.engine.metrics.recoverable_step.labels(job).set(-1)
                    log.warning("step %s of job %s is no longer recoverable from memory: %s; it is durable on disk", step, job,
                                self.problems[job], extra={"job": job, "step": step})
                    break


class Replication:
    """The replica tiers on this daemon: pushing its parts, holding and serving others', fetching for loads."""

    def __init__(self, engine: Engine, store: ReplicaStore, calls: ReplicaCalls) -> None:
        self.engine = engine
        self.store = store
        self.calls = calls
        config = engine.config
        tls = tls_contexts(*config.peer_tls_files) if config.peer_tls_files is not None else None
        self._client_tls: ssl.SSLContext | None = tls[1] if tls is not None else None
        self.bulk: BulkServer | None = None
        if engine.cluster is not None and config.replicas > 0:
            self.bulk = BulkServer(config.peers[config.node_rank].rpartition(":")[0], config.replica_port, tls[0] if tls is not None else None, engine.metrics,
                                   config.background_priority)
        self.pushes: dict[str, PushState] = {}
        self._cancels: dict[str, threading.Event] = {}
        self.recoverability = Recoverability(engine)
        self._watching = False  # node 0: the holders of recoverable steps are being checked

    def start(self) -> None:
        """Open the bulk port (several nodes with --replicas > 0)."""
        if self.bulk is not None:
            self.bulk.start()
            log.info("replicas: bulk port %s:%s; node %s's parts go to nodes %s", self.bulk.host, self.bulk.port, self.engine.node, list(self._buddies()))

    def close(self) -> None:
        for cancel in self._cancels.values():
            cancel.set()
        if self.bulk is not None:
            self.bulk.close()
        self.store.close()

    def status(self) -> ReplicaStatus:
        """What `ckptd status` shows of the replica tiers."""
        recoverability = self.recoverability
        jobs = []
        for job in sorted(set(self.pushes) | set(recoverability.recoverable) | set(recoverability.problems)):
            push = self.pushes.get(job)
            jobs.append(
                JobReplicas(
                    job, push.step if push else -1, push.holders if push else (), push.error if push else "", push is not None and not push.done,
                    recoverability.recoverable.get(job, -1), recoverability.problems.get(job, ""),
                )
            )
        held = tuple((r.job, r.node, r.step, r.nbytes) for r in self.store.held.values())
        return ReplicaStatus(self.store.nbytes, self.store.limit, held, tuple(jobs), self.bulk.status() if self.bulk is not None else None)

    def _buddies(self) -> tuple[int, ...]:
        cluster = self.engine.cluster
        return () if cluster is None else buddies(cluster.node, cluster.nodes, self.engine.config.replicas)

    # ---- pushing this node's part after a commit

    def committed(self, job: str, step: int, index: CheckpointIndex) -> None:
        """A step was committed here: push this node's data files of it to its buddies in the
        background (cancelling an older push of the job)."""
        if self.bulk is None or not self._buddies():
            return
        node = self.engine.node
        files = tuple(f for f in index.files if f.node == node and f.name.endswith(".safetensors"))
        if not files:
            return
        needed = frozenset(f.node for f in index.files if f.name.endswith(".safetensors"))
        older = self._cancels.get(job)
        if older is not None:
            older.set()
        try:
            units = file_units(index)
        except FormatError as exc:  # a buddy checks every byte it holds: without checksums, nothing is pushed
            self.pushes[job] = PushState(step, error=f"not pushed: {exc}", done=True)
            log.warning("step %s of job %s: this node's part is not held in memory by another node: %s", step, job, exc, extra={"job": job, "step": step})
            return
        cancel = self._cancels[job] = threading.Event()
        self.pushes[job] = PushState(step)
        self.engine.spawn(self._push(job, step, files, {f.name: units[f.name] for f in files}, needed, cancel))

    async def _push(
        self, job: str, step: int, files: tuple[FileRecord, ...], units: Mapping[str, tuple[Unit, ...]], needed: frozenset[int], cancel: threading.Event
    ) -> None:
        cluster = self.engine.cluster
        assert cluster is not None
        holders, errors = [], []
        for buddy in self._buddies():
            error = await self._push_to(buddy, job, step, files, units, cancel)
            if cancel.is_set():
                self.engine.metrics.replica_pushes.labels("cancelled").inc()
                return
            if error:
                errors.append(f"{cluster.describe(buddy)}: {error}")
            else:
                holders.append(buddy)
        state = self.pushes[job] = PushState(step, tuple(holders), "; ".join(errors), done=True)
        nbytes = human_bytes(sum(f.size for f in files))
        self.engine.metrics.replica_pushes.labels("failed" if errors else "ok").inc()
        if errors:
            log.warning(
                "step %s of job %s: this node's part (%s) is not held in memory by %s; the step is durable on disk, and a loss of this node restores it from there",
                step, job, nbytes, state.error, extra={"job": job, "step": step},
            )
        if holders:
            log.info("step %s of job %s: this node's part (%s) is held in memory by nodes %s", step, job, nbytes, holders, extra={"job": job, "step": step})
        await self._report(job, step, needed, tuple(holders), state.error)

    async def _push_to(
        self, buddy: int, job: str, step: int, files: tuple[FileRecord, ...], units: Mapping[str, tuple[Unit, ...]], cancel: threading.Event
    ) -> str:
        """Offer and send the files to one buddy; "" when it holds them, else why not."""
        answer = await self.calls.offer(buddy, job, step, files, units)
        if isinstance(answer, str):
            return f"did not answer ({answer})"
        if answer.held:
            return ""
        if not answer.accepted:
            return f"refused it: {answer.reason}"
        try:
            sent = await asyncio.to_thread(self._send, self.calls.host_of(buddy), answer.port, answer.ticket, job, step, files, cancel)
        except BulkError as exc:
            return f"the transfer failed: {exc}"
        self.engine.metrics.replica_pushed_bytes.inc(sent)
        return ""

    def _send(self, host: str, port: int, ticket: bytes, job: str, step: int, files: tuple[FileRecord, ...], cancel: threading.Event) -> int:
        """(thread) Send the files' bytes, read from storage, at the configured rate; the bytes sent."""
        storage = self.engine.storage
        pacer = Pacer(self.engine.config.replica_bandwidth, cancel)

        def chunks() -> Iterator[bytes]:
            for record in files:
                offset = 0
                while offset < record.size:
                    n = min(pacer.slice_bytes(PUSH_SLICE_BYTES), record.size - offset)
                    try:
                        yield storage.files.read_range(job, step, record.name, offset, n)
                    except (OSError, FormatError) as exc:
                        raise BulkError(f"cannot read {record.name} of step {step}: {exc}") from None
                    offset += n

        sock = connect(host, port, ticket, self._client_tls)
        try:
            sent = send_chunks(sock, chunks(), pacer)
            ok, reason = recv_status(sock)
        except OSError as exc:
            raise BulkError(str(exc)) from None
        finally:
            sock.close()
        if not ok:
            raise BulkError(f"the buddy did not keep it: {reason}")
        return sent

    async def _report(self, job: str, step: int, needed: frozenset[int], holders: tuple[int, ...], error: str) -> None:
        cluster = self.engine.cluster
        assert cluster is not None
        if cluster.node == 0:
            self.recoverability.report(job, step, needed, 0, holders, error)
            self._watch_holders()
            return
        problem = await self.calls.held(job, step, holders, error)
        if problem:
            log.warning("step %s of job %s: could not tell node 0 where this node's part is held: %s", step, job, problem)

    async def held_report(self, job: str, step: int, node: int, holders: Sequence[int], error: str) -> None:
        """Node 0: another node's part of a committed step is held by `holders`."""
        try:
            index = await self.engine.index(job, step)
        except (Precondition, OSError) as exc:
            log.info("step %s of job %s: node %s's replica report is ignored (%s)", step, job, node, exc)
            return
        needed = frozenset(f.node for f in index.files if f.name.endswith(".safetensors"))
        self.recoverability.report(job, step, needed, node, holders, error)
        self._watch_holders()

    def _watch_holders(self) -> None:
        """Node 0 (on the loop): while a step is recoverable, check every HOLDERS_CHECK_S that
        its holders still keep the parts (Recoverability.recheck)."""
        if self._watching or not self.recoverability.recoverable:
            return
        self._watching = True

        async def watch() -> None:
            try:
                while self.recoverability.recoverable:
                    await asyncio.sleep(HOLDERS_CHECK_S)
                    await self.recoverability.recheck(self._holds, lambda job: self.pushes[job].step if job in self.pushes else None)
            finally:
                self._watching = False

        self.engine.spawn(watch())

    async def _holds(self, holder: int, job: str, step: int, node: int) -> str:
        """"" when `holder` keeps node's part of the step in memory, else why not."""
        if holder == self.engine.node:
            held = any(source == node for source, _, _ in self.store.files_of(job, step))
            return "" if held else "no longer holds it (made room for another part)"
        cluster = self.engine.cluster
        assert cluster is not None
        answer = await cluster.inventory(holder, job, step)
        if isinstance(answer, str):
            return f"does not answer ({answer})"
        if any(source == node for source, _, _ in answer.replicas):
            return ""
        return "no longer holds it (its daemon restarted, or it made room for another part)"

    # ---- holding other nodes' parts

    def offer(self, job: str, step: int, node: int, files: Sequence[FileRecord], units: Mapping[str, tuple[Unit, ...]]) -> BulkAnswer:
        """A node offers its part of a committed step (`units`: each file's checksum units, every
        byte is checked on arrival): a ticket to send it, or why not."""
        if self.bulk is None:
            return BulkAnswer(False, f"node {self.engine.node} holds no replicas (--replicas 0)")
        try:
            receipt = self.store.offer(job, node, step, files, units)
        except Refused as exc:
            return BulkAnswer(False, str(exc))
        if receipt is None:
            return BulkAnswer(True, held=True)
        loop = asyncio.get_running_loop()
        ticket = self.bulk.issue(lambda sock: self._receive(sock, receipt, loop), on_expire=lambda: self._drop(receipt, loop))
        return BulkAnswer(True, port=self.bulk.port, ticket=ticket)

    def _receive(self, sock: socket.socket, receipt: Receipt, loop: asyncio.AbstractEventLoop) -> None:
        """(bulk thread) Receive a pushed part into its receipt's files, check and publish it, and
        tell the sender. Anything short of that abandons the receipt: nothing partial is served."""
        fds: list[int] = []
        try:
            fds = self.store.create_parts(receipt)
            buffer = memoryview(bytearray(BUFFER_BYTES))
            for record, fd in zip(receipt.files, fds):
                recv_into_file(sock, fd, 0, record.size, buffer, receipt.checks[record.name])
            self.store.check_and_rename(receipt, fds)
            published = asyncio.run_coroutine_threadsafe(self._publish(receipt), loop).result(PUBLISH_TIMEOUT_S)
            if not published:
                raise Refused("a newer offer from the same node replaced it")
        except Exception as exc:  # whatever stopped it, the receipt is dropped: nothing partial is served
            if not isinstance(exc, (Refused, Damaged, BulkError, OSError)):
                log.exception("receiving node %s's part of step %s of job %r failed", receipt.node, receipt.step, receipt.job)
            if isinstance(exc, Damaged):
                self.engine.metrics.replica_damaged.labels("arrival").inc()
            log.warning("node %s's part of step %s of job %r was not kept: %s", receipt.node, receipt.step, receipt.job, exc)
            self._drop(receipt, loop)
            try:
                send_status(sock, False, str(exc))
            except OSError as send_error:
                log.info("could not tell node %s why: %s", receipt.node, send_error)
            return
        finally:
            close_fds(fds)
        send_status(sock, True)

    async def _publish(self, receipt: Receipt) -> bool:
        return self.store.publish(receipt)

    def _drop(self, receipt: Receipt, loop: asyncio.AbstractEventLoop) -> None:
        """(any thread) Remove an unpublished receipt's files and forget it on the loop."""
        ReplicaStore.remove_receipt_files(receipt)
        if not loop.is_closed():
            loop.call_soon_threadsafe(self.store.abandon, receipt)

    # ---- serving what this daemon holds

    async def read(self, job: str, step: int, source: int, ranges: Sequence[tuple[str, int, int]]) -> BulkAnswer:
        """A ticket to receive ranges (file, offset, nbytes) of the replica of `source`'s part."""
        if self.bulk is None:
            raise Precondition(f"node {self.engine.node} holds no replicas (--replicas 0)")
        replica = self.store.replica(job, source, step)
        for name, offset, nbytes in ranges:
            size = replica.size_of(name)
            if size is None:
                raise InvalidRequest(f"{name} is not a file of node {source}'s part of step {step} of job {job!r}")
            if offset < 0 or nbytes <= 0 or offset + nbytes > size:
                raise InvalidRequest(f"bytes [{offset}, +{nbytes}) are not inside {name} ({size} bytes)")
        opened = await asyncio.to_thread(open_ranges, replica, ranges)
        fds = [fd for fd, _, _ in opened]
        ticket = self.bulk.issue(lambda sock: self._serve(sock, opened), on_expire=lambda: close_fds(fds))
        return BulkAnswer(True, port=self.bulk.port, ticket=ticket)

    def _serve(self, sock: socket.socket, opened: list[tuple[int, int, int]]) -> None:
        try:
            self.engine.metrics.replica_served_bytes.inc(send_file_ranges(sock, opened))
        finally:
            close_fds(fd for fd, _, _ in opened)

    # ---- reading for this daemon's loads

    async def fetch(
        self, holder: int, job: str, step: int, source: int, reads: Sequence[Range], units: Mapping[str, Sequence[Unit]]
    ) -> None:
        """Receive ranges of the replica of `source`'s part that `holder` holds into staging
        files (same offsets): widened to whole checksum units (`units`: the step's, by file),
        merged, in up to FETCH_STREAMS connections of their own, every staged unit checked as it
        arrives (those between merged reads too: units_within). Unavailable when the holder does not serve them, or they do not match (the
        message names the holder's copy as damaged)."""
        cluster = self.engine.cluster
        assert cluster is not None
        reads, _ = widen_to_units(reads, units)
        whole = merge_ranges(reads)
        checks = units_within(whole, units)  # the units between merged reads too: every byte written is checked
        total = sum(r[2] for r in whole)
        streams = max(1, min(FETCH_STREAMS, os.cpu_count() or 1, total // STREAM_MIN_BYTES))  # a receiving thread per stream
        merged = cut_ranges(whole, -(-total // streams), units=units)
        checked = units_in(merged, checks)
        groups = split_evenly([r[2] for r in merged], streams)

        async def stream(group: list[int]) -> str | None:
            ranges = [merged[i] for i in group]
            answer = await self.calls.read(holder, job, step, source, [(f, o, n) for f, o, n, _ in ranges])
            try:
                return await asyncio.to_thread(
                    self._receive_ranges, self.calls.host_of(holder), answer.port, answer.ticket, ranges, [checked[i] for i in group]
                )
            except (BulkError, OSError) as exc:
                raise Unavailable(f"reading node {source}'s part of step {step} of job {job!r} from the memory of {cluster.describe(holder)} failed: {exc}") from None

        started = time.monotonic()
        problems = await asyncio.gather(*(stream(g) for g in groups))
        problem = next((p for p in problems if p is not None), None)
        if problem is not None:
            self.engine.metrics.replica_damaged.labels("load").inc()
            raise Unavailable(
                f"the copy of node {source}'s part of step {step} of job {job!r} held in the memory of {cluster.describe(holder)} is damaged: {problem}"
            )
        seconds = time.monotonic() - started
        self.engine.metrics.load_staged_bytes.labels(TierName.REPLICA_PEER.value).inc(total)
        log.info(
            "staged %s of node %s's part of step %s of job %s from the memory of %s in %.3f s (%.2f GB/s, %s ranges in %s connections)",
            human_bytes(total), source, step, job, cluster.describe(holder), seconds, total / max(seconds, 1e-9) / 1e9, len(merged), len(groups),
            extra={"job": job, "step": step},
        )

    def _receive_ranges(self, host: str, port: int, ticket: bytes, ranges: Sequence[Range], checked: Sequence[tuple[Unit, ...]]) -> str | None:
        """(thread) Receive the ranges into their staging files, each checked against its units
        (`checked`, by range) as it arrives: None, or what is wrong with the first unit that does
        not match ("FILE: bytes [a, b) do not match ...")."""
        sock = connect(host, port, ticket, self._client_tls)
        problem = None
        try:
            buffer = memoryview(bytearray(min(BUFFER_BYTES, max(r[2] for r in ranges))))
            for (file, offset, nbytes, fd), units in zip(ranges, checked):
                check = UnitCheck(units, offset)
                recv_into_file(sock, fd, offset, nbytes, buffer, check)
                found = check.problem()
                if problem is None and found is not None:
                    problem = f"{file}: {found}"
        finally:
            sock.close()
        return problem

    def copy_local(
        self, job: str, step: int, source: int, file: str, offset: int, nbytes: int, out_fd: int, units: Mapping[str, Sequence[Unit]]
    ) -> None:
        """(thread) Copy a range of a replica this daemon holds into a staging file, widened to
        whole checksum units and checked as `fetch` does, as it passes (bulk.move_into_file: no
        copy_file_range, which would leave the staged bytes to be read back to be checked).
        NotFound when the replica is gone; Unavailable when it ends short or the copy is damaged
        (named as this node's)."""
        replica = self.store.replica(job, source, step)
        (widened,), checks = widen_to_units([(file, offset, nbytes, out_fd)], units)
        _, offset, nbytes, _ = widened
        check = UnitCheck([unit for _, _, unit in checks], offset)
        ((fd, _, _),) = open_ranges(replica, [(file, offset, nbytes)])
        try:
            buffer = memoryview(bytearray(min(BUFFER_BYTES, nbytes)))
            done = move_into_file(lambda view, at: os.preadv(fd, [view], at), out_fd, offset, nbytes, buffer, check)
        finally:
            os.close(fd)
        if done < nbytes:
            raise Unavailable(f"node {source}'s replica of {file} ends before byte {offset + nbytes}")
        problem = check.problem()
        if problem is not None:
            self.engine.metrics.replica_damaged.labels("load").inc()
            raise Unavailable(
                f"the copy of node {source}'s part of step {step} of job {job!r} held in the memory of this node (node {self.engine.node}) is damaged: {file}: {problem}"
            )
        self.engine.metrics.load_staged_bytes.labels(TierName.REPLICA_HERE.value).inc(nbytes)
