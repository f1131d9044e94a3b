"""Replicas this daemon holds in memory for other nodes (the replica tiers REPLICA_HERE and REPLICA_PEER, docs/architecture.md §9).

A buddy keeps, per (job, node), the data files of the newest committed step that node pushed
(tiers/replicas.py), byte for byte as the node wrote them, as files in --shm-dir (a tmpfs:
memory). A loading node reads them by file name and byte range, as it reads a step's files.

A replica is servable only once complete: its files are received under `.part` names, every
byte checked as it arrives against the index's checksums (the units the offering node sends
with its offer: header, tensors, chunks; units.UnitCheck), each file against the size that
the index records, renamed, and then listed at once (`publish`). A receipt that ends any other
way (a short stream, bytes that do not match, a newer offer from the same node, the daemon
stopping) is abandoned: its files are
removed and its memory released. Nothing here survives the process: a restarted daemon holds
no replicas, and the files of a dead daemon are removed at start like its arenas
(arena.remove_stale_arenas: same name prefix).

Budget (--replica-memory): what is held plus what is being received stays under the limit. An
offer that does not fit first evicts the offering node's older replica of the same job (the new
one replaces it anyway), then replicas of other jobs, the least recently received first (a job
that stopped committing keeps nothing warm for ever); if it still does not fit it is refused:
that step stays durable but is not recoverable from memory. Other nodes' parts of the same job
are never evicted for it: each node's newest part is worth as much as any other's.

State changes run on the event loop. File work (creating, receiving, checking and renaming a
receipt's files; opening a replica's files to serve them) runs in a bulk connection's thread,
on a receipt that only that thread touches until it is published or abandoned.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from ckptd.common.sizes import human_bytes
from ckptd.daemon.errors import NotFound
from ckptd.format.index import FileRecord
from ckptd.format.units import Unit, UnitCheck
from ckptd.daemon.handoff.arena import ARENA_PREFIX
from ckptd.daemon.metrics import Metrics
from ckptd.daemon.private_dirs import create_file

log = logging.getLogger(__name__)

Key = tuple[str, int]  # (job, the node whose part it is)


class Refused(Exception):
    """An offer the store does not take; the message says why and what to change."""


class Damaged(Exception):
    """Received bytes that are not the file the index describes."""


@dataclass(eq=False)
class Replica:
    """A node's part of one committed step, complete and checked, held in memory."""

    job: str
    node: int
    step: int
    files: tuple[FileRecord, ...]
    paths: dict[str, Path]  # file name -> its bytes in shared memory
    nbytes: int
    received_at: float = field(default_factory=time.time)

    def size_of(self, name: str) -> int | None:
        return next((f.size for f in self.files if f.name == name), None)


@dataclass(eq=False)
class Receipt:
    """A replica being received: its files under temporary names until published."""

    job: str
    node: int
    step: int
    files: tuple[FileRecord, ...]
    parts: dict[str, Path]  # file name -> where it is received
    paths: dict[str, Path]  # file name -> its name once published
    nbytes: int
    checks: dict[str, UnitCheck] = field(default_factory=dict)  # file name -> the check of its bytes as they arrive (units tiling it)
    cancelled: bool = False  # superseded or stopping: abandoned when its transfer ends

    @property
    def key(self) -> Key:
        return (self.job, self.node)


class ReplicaStore:
    """The replicas this daemon holds for other nodes, and those it is receiving."""

    def __init__(self, shm_dir: Path, limit: int, metrics: Metrics | None = None) -> None:
        self.shm_dir = shm_dir
        self.limit = limit
        self.metrics = metrics
        self.held: dict[Key, Replica] = {}
        self.receiving: dict[Key, Receipt] = {}
        self._prefix = f"{ARENA_PREFIX}{os.getpid()}-replica-"
        self._serial = 0

    @property
    def nbytes(self) -> int:
        """Memory held and reserved for replicas, in bytes."""
        return sum(r.nbytes for r in self.held.values()) + sum(r.nbytes for r in self.receiving.values())

    def offer(self, job: str, node: int, step: int, files: Sequence[FileRecord], units: Mapping[str, tuple[Unit, ...]]) -> Receipt | None:
        """Take an offer of node's part of a committed step: a Receipt to receive it into, or
        None when exactly that replica is held already. `units`: each file's checksum units
        (tiling it: checks.check_replica_units), every byte is checked against them as it arrives
        (the receipt's `checks`, fed by bulk.recv_into_file).
        Raises Refused (counted, logged) when it does not fit in the budget."""
        key = (job, node)
        files = tuple(files)
        held = self.held.get(key)
        if held is not None and held.step == step and held.files == files:
            return None
        need = sum(f.size for f in files)
        where = f"node {node}'s part of step {step} of job {job!r} ({human_bytes(need)})"
        if need > self.limit:
            self._refuse(f"{where} is larger than all of --replica-memory ({human_bytes(self.limit)}); raise --replica-memory on this node")
        older = self.receiving.pop(key, None)
        if older is not None:  # a newer commit of that node: the older receipt stops when its transfer ends
            older.cancelled = True
        if self.nbytes + need > self.limit and held is not None:
            self.evict(key, f"to make room for {where}")
        for other in sorted((r for r in self.held.values() if r.job != job), key=lambda r: r.received_at):
            if self.nbytes + need <= self.limit:
                break
            self.evict((other.job, other.node), f"(the least recently received of another job) to make room for {where}")
        if self.nbytes + need > self.limit:
            others = ", ".join(f"node {r.node}'s step {r.step} of job {r.job!r} ({human_bytes(r.nbytes)})" for r in self.held.values())
            self._refuse(
                f"{where} does not fit in --replica-memory ({human_bytes(self.limit)}, {human_bytes(self.nbytes)} in use: {others or 'replicas being received'}); "
                "raise --replica-memory on this node, or lower --replicas"
            )
        self._serial += 1
        stem = f"{self._prefix}{job}-n{node}-s{step}-r{self._serial}-"
        receipt = Receipt(
            job, node, step, files,
            parts={f.name: self.shm_dir / f"{stem}{f.name}.part" for f in files},
            paths={f.name: self.shm_dir / f"{stem}{f.name}" for f in files},
            nbytes=need,
            checks={f.name: UnitCheck(tuple(units[f.name])) for f in files},
        )
        self.receiving[key] = receipt
        return receipt

    def _refuse(self, reason: str) -> None:
        log.warning("replica refused: %s", reason)
        if self.metrics is not None:
            self.metrics.replica_refused.inc()
        raise Refused(reason)

    def evict(self, key: Key, why: str) -> None:
        """Drop a held replica (its files are removed; a read under way keeps its open files)."""
        replica = self.held.pop(key, None)
        if replica is None:
            return
        log.info("evicted node %s's replica of step %s of job %r (%s) %s", replica.node, replica.step, replica.job, human_bytes(replica.nbytes), why)
        if self.metrics is not None:
            self.metrics.replica_evicted.inc()
        remove_files(replica.paths.values())

    # ---- a receipt's files (the bulk connection's thread)

    @staticmethod
    def create_parts(receipt: Receipt) -> list[int]:
        """Create and reserve (fallocate) the receipt's files; their descriptors, in file order.
        Raises Refused when shared memory is too small for them."""
        fds: list[int] = []
        try:
            for record in receipt.files:
                path = receipt.parts[record.name]
                fd = create_file(path, 0o640)
                fds.append(fd)
                try:
                    if record.size:
                        os.posix_fallocate(fd, 0, record.size)
                except OSError as exc:
                    raise Refused(f"cannot reserve {human_bytes(record.size)} of shared memory in {path.parent}: {exc.strerror}") from None
        except BaseException:
            for fd in fds:
                os.close(fd)
            remove_files([receipt.parts[r.name] for r in receipt.files[: len(fds)]])  # only what it created
            raise
        return fds

    @staticmethod
    def check_and_rename(receipt: Receipt, fds: Sequence[int]) -> None:
        """Check each received file against its index record (size) and its checksum units (the
        receipt's `checks`, fed every byte as it arrived; the header is unit 0, units.file_units),
        and give it its published name. Raises Damaged naming the file and the
        bytes that do not match."""
        for record, fd in zip(receipt.files, fds):
            size = os.fstat(fd).st_size
            if size != record.size:
                raise Damaged(f"{record.name}: {size} bytes received, the index says {record.size}")
            problem = receipt.checks[record.name].problem()
            if problem is not None:
                raise Damaged(f"{record.name} arrived damaged: {problem} (node {receipt.node}'s file or the transfer)")
        for record in receipt.files:
            os.rename(receipt.parts[record.name], receipt.paths[record.name])

    # ---- state (the event loop)

    def publish(self, receipt: Receipt) -> bool:
        """List a complete, checked receipt as the node's replica (replacing its older one);
        False when the receipt was superseded or abandoned meanwhile (then discard its files)."""
        if receipt.cancelled or self.receiving.get(receipt.key) is not receipt:
            return False
        del self.receiving[receipt.key]
        old = self.held.pop(receipt.key, None)
        if old is not None:
            remove_files(old.paths.values())
        self.held[receipt.key] = Replica(receipt.job, receipt.node, receipt.step, receipt.files, dict(receipt.paths), receipt.nbytes)
        if self.metrics is not None:
            self.metrics.replica_received_bytes.inc(receipt.nbytes)
        log.info(
            "holding node %s's part of step %s of job %r in memory (%s, %s files)",
            receipt.node, receipt.step, receipt.job, human_bytes(receipt.nbytes), len(receipt.files),
            extra={"job": receipt.job, "step": receipt.step},
        )
        return True

    def abandon(self, receipt: Receipt) -> None:
        """Forget a receipt that will not be published (its files: `remove_receipt_files`)."""
        receipt.cancelled = True
        if self.receiving.get(receipt.key) is receipt:
            del self.receiving[receipt.key]

    @staticmethod
    def remove_receipt_files(receipt: Receipt) -> None:
        remove_files([*receipt.parts.values(), *receipt.paths.values()])

    # ---- lookups

    def replica(self, job: str, node: int, step: int) -> Replica:
        """The held replica of node's part of the step; NotFound when another step (or none) is held."""
        replica = self.held.get((job, node))
        if replica is None or replica.step != step:
            held = f"it holds step {replica.step}" if replica is not None else "it holds none"
            raise NotFound(f"this daemon holds no replica of node {node}'s part of step {step} of job {job!r} ({held})")
        return replica

    def files_of(self, job: str, step: int) -> list[tuple[int, str, int]]:
        """(node, file name, size) of every replica file held for the step."""
        return [(r.node, f.name, f.size) for r in self.held.values() if r.job == job and r.step == step for f in r.files]

    def close(self) -> None:
        """Drop everything (the daemon stops)."""
        for receipt in self.receiving.values():
            receipt.cancelled = True
        self.receiving.clear()
        for replica in self.held.values():
            remove_files(replica.paths.values())
        self.held.clear()


def open_ranges(replica: Replica, ranges: Sequence[tuple[str, int, int]]) -> list[tuple[int, int, int]]:
    """(fd, offset, nbytes) per (file, offset, nbytes) of a held replica, each file opened once
    (the caller closes the fds: `close_fds`). Raises NotFound when a file went away (evicted)."""
    fds: dict[str, int] = {}
    try:
        for name, _, _ in ranges:
            if name not in fds:
                fds[name] = os.open(replica.paths[name], os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        close_fds(fds.values())
        raise NotFound(f"node {replica.node}'s replica of step {replica.step} of job {replica.job!r} was replaced while being read; load again") from None
    return [(fds[name], offset, nbytes) for name, offset, nbytes in ranges]


def close_fds(fds: Iterable[int]) -> None:
    for fd in set(fds):
        os.close(fd)


def remove_files(paths: Iterable[Path]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
