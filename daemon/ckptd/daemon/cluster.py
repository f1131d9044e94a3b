"""Several nodes: the coordinator's side of a save, and the links between daemons.

A save across nodes (docs/architecture.md §12):
1. Each node's daemon gathers its local ranks (BeginSave), then joins the save at the
   coordinator (node 0) with its ranks' fingerprints, and their tensor metadata the first time.
   The coordinator answers every node once all ranks of the job have joined, with the plan's
   input: every rank's metadata (unless the node already planned from the same input) and the
   node of each rank. Every node computes the same plan from it (plan.make_save_plan is pure).
2. Each node copies and writes its part (pipeline.write_node_files), then reports its manifest.
3. When every node that joined has reported, the coordinator checks that the manifests hold
   each tensor exactly once, writes the index (the commit) and `latest`, and answers each
   node's report with the outcome; on node-local roots each node then writes the same index.
   A node that reports a failure, or stops answering, aborts the step everywhere: nobody
   writes an index and every node removes what it wrote.

Daemons authenticate each other with a shared token in the call metadata (PEER_TOKEN_KEY),
compared in constant time by the peer servicer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import grpc

from ckptd.common.boxes import Box
from ckptd.daemon.checks import tensor_specs
from ckptd.daemon.errors import Aborted, InvalidRequest, Precondition, Unavailable
from ckptd.daemon.format import FileRecord, FragmentRecord, QuantRecord, step_dir_name
from ckptd.daemon.peer_tls import PeerTls
from ckptd.daemon.pipeline import IncompleteStep, NodeManifest, step_files, write_step_files
from ckptd.daemon.plan import PlanError, SavePlan, TensorSpec, make_save_plan
from ckptd.daemon.storage import FILE_MODE, Storage, read_file
from ckptd.wire import MESSAGE_SIZE_OPTIONS
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import peer_pb2 as ppb
from ckptd.wire.v1 import peer_pb2_grpc as ppb_grpc

log = logging.getLogger(__name__)

PEER_TOKEN_KEY = "ckptd-peer-token"
ROOT_ID_FILE = ".ckptd-root-id"
LIVENESS_PERIOD_S = 1.0
LIVENESS_FAILURES = 3  # consecutive failed checks before a writing node counts as gone
FETCH_CHUNK = 4 * 2**20
INVENTORY_TIMEOUT_S = 3.0  # a peer that does not answer within this counts as absent for a load
RECENT_SAVES = 16


def root_id(root: Path) -> str:
    """The storage root's id, created on first use; daemons that share a root read the same id."""
    path = root / ROOT_ID_FILE
    try:
        # FILE_MODE (0640) whatever the umask; O_EXCL | O_NOFOLLOW: a link planted there is not followed
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        os.fchmod(fd, FILE_MODE)
    except FileExistsError:
        return read_file(path, 4096).decode("ascii", "replace").strip()
    with os.fdopen(fd, "w") as f:
        f.write(uuid.uuid4().hex + "\n")
        f.flush()
        os.fsync(f.fileno())
    return read_file(path, 4096).decode("ascii", "replace").strip()


def plan_key(fingerprints: dict[int, str], node_of_rank: dict[int, int]) -> str:
    """What a plan depends on: every rank's metadata fingerprint and node, in rank order."""
    h = hashlib.sha256()
    for rank in sorted(fingerprints):
        h.update(f"{rank}|{fingerprints[rank]}|{node_of_rank[rank]}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class JoinResult:
    save_id: str
    plan_key: str
    node_of_rank: tuple[int, ...]
    specs: tuple[tuple[TensorSpec, ...], ...] | None  # every rank's, None when the plan key was known
    shared_root: bool


@dataclass(frozen=True)
class Outcome:
    committed: bool
    error: str = ""
    step_files: dict[str, bytes] = field(default_factory=dict)  # for nodes with their own root
    # False: nobody who saw the save decided it (the coordinator did not answer, or restarted and
    # knows no such save): node 0 may have committed the step before it went away, so a node's
    # written part must stay until node 0's root says (Service.resolve_prepared)
    decided: bool = True


@dataclass
class _GlobalSave:
    job: str
    step: int
    world_size: int
    save_id: str
    timeout_s: float
    metric: float | None
    created: float = field(default_factory=time.monotonic)
    fingerprints: dict[int, str] = field(default_factory=dict)  # rank -> fingerprint
    node_of_rank: dict[int, int] = field(default_factory=dict)
    root_ids: dict[int, str] = field(default_factory=dict)  # node -> root id
    planned: asyncio.Event = field(default_factory=asyncio.Event)
    plan: SavePlan | None = None
    key: str = ""
    error: str = ""
    refused: bool = False  # the metadata itself is bad (INVALID_ARGUMENT)
    manifests: dict[int, NodeManifest] = field(default_factory=dict)
    extras: dict[int, Any] = field(default_factory=dict)
    model_files: dict[str, bytes] = field(default_factory=dict)
    decided: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None

    @property
    def nodes(self) -> set[int]:
        return set(self.root_ids)


class PeerLinks:
    """gRPC channels to the other daemons, with the token on every call."""

    def __init__(self, peers: Sequence[str], token: str, tls: PeerTls | None = None) -> None:
        self.peers = tuple(peers)
        self.tls = tls
        self._metadata = ((PEER_TOKEN_KEY, token),)
        self._channels: dict[int, grpc.aio.Channel] = {}

    def _channel(self, node: int) -> grpc.aio.Channel:
        channel = self._channels.get(node)
        if channel is None:
            options = [
                *MESSAGE_SIZE_OPTIONS,
                # a restarted peer is reachable again within a second, not after gRPC's
                # default backoff of up to two minutes
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.min_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ]
            if self.tls is None:
                channel = grpc.aio.insecure_channel(self.peers[node], options=options)
            else:
                channel = grpc.aio.secure_channel(self.peers[node], self.tls.channel_credentials(), options=options)
            self._channels[node] = channel
        return channel

    def stub(self, node: int) -> ppb_grpc.PeerStub:
        return ppb_grpc.PeerStub(self._channel(node))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def saving(self, node: int, job: str, step: int, timeout_s: float = 2.0) -> bool | None:
        """Whether node's daemon is saving `step` of `job`; None when it does not answer."""
        try:
            reply = await self.stub(node).Inventory(ppb.InventoryRequest(job=job, step=step), timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError:
            return None
        return reply.in_flight

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


class Coordinator:
    """Node 0's part: one barrier and one commit per save of a job's step across nodes."""

    def __init__(self, storage: Storage, links: PeerLinks, own_root_id: str, on_commit: Callable[[str], Awaitable[None]]) -> None:
        self.storage = storage
        self.links = links
        self.root_id = own_root_id
        self.on_commit = on_commit  # retention for the job, after each commit
        self._specs: dict[tuple[int, str], tuple[TensorSpec, ...]] = {}
        self._plans: dict[str, SavePlan] = {}
        self._saves: dict[tuple[str, int], _GlobalSave] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    async def join(
        self,
        job: str,
        step: int,
        node: int,
        world_size: int,
        fingerprints: dict[int, str],
        specs: dict[int, tuple[TensorSpec, ...]],
        known_plans: Sequence[str],
        node_root_id: str,
        timeout_s: float,
        metric: float | None,
    ) -> JoinResult:
        """Add `node`'s ranks to the save of `step`; returns when every rank has joined."""
        for rank, fingerprint in fingerprints.items():
            if not 0 <= rank < world_size:
                raise InvalidRequest(f"rank {rank} is not in [0, world_size={world_size})")
            if rank in specs:
                self._specs[(rank, fingerprint)] = specs[rank]
            elif (rank, fingerprint) not in self._specs:
                raise Precondition("unknown fingerprint: send the tensor metadata with this request")
        save = self._saves.get((job, step))
        if save is None or save.decided.is_set():
            save = _GlobalSave(job, step, world_size, uuid.uuid4().hex, timeout_s, metric)
            self._saves.pop((job, step), None)  # re-inserted: `_saves` is in the order saves began
            self._saves[(job, step)] = save
            self._forget_old(job)
            self._spawn(self._join_deadline(save))
        if save.world_size != world_size:
            raise InvalidRequest(f"node {node} says job {job!r} has {world_size} ranks, other nodes say {save.world_size}")
        if node in save.root_ids:
            raise InvalidRequest(f"node {node} joined the save of step {step} twice")
        for rank in fingerprints:
            if rank in save.fingerprints:
                raise InvalidRequest(f"rank {rank} is served by node {save.node_of_rank[rank]} and by node {node}; each rank talks to its own node's daemon")
        save.root_ids[node] = node_root_id
        for rank, fingerprint in fingerprints.items():
            save.fingerprints[rank] = fingerprint
            save.node_of_rank[rank] = node
        if len(save.fingerprints) == world_size:
            self._spawn(self._plan(save))
        await save.planned.wait()
        if save.error:
            raise (InvalidRequest if save.refused else Aborted)(save.error)
        assert save.plan is not None
        known = save.key in known_plans
        return JoinResult(
            save_id=save.save_id,
            plan_key=save.key,
            node_of_rank=tuple(save.node_of_rank[r] for r in range(world_size)),
            specs=None if known else tuple(self._specs[(r, save.fingerprints[r])] for r in range(world_size)),
            shared_root=all(rid == self.root_id for rid in save.root_ids.values()),
        )

    async def _plan(self, save: _GlobalSave) -> None:
        try:
            save.key = plan_key(save.fingerprints, save.node_of_rank)
            plan = self._plans.get(save.key)
            if plan is None:
                specs = [self._specs[(r, save.fingerprints[r])] for r in range(save.world_size)]
                nodes = [save.node_of_rank[r] for r in range(save.world_size)]
                plan = await asyncio.to_thread(make_save_plan, specs, nodes)
                self._plans[save.key] = plan
            save.plan = plan
            self._spawn(self._watch_writers(save))
        except PlanError as exc:
            save.refused = True
            await self._abort(save, str(exc))
        finally:
            save.planned.set()

    async def _join_deadline(self, save: _GlobalSave) -> None:
        try:
            await asyncio.wait_for(save.planned.wait(), save.timeout_s)
        except asyncio.TimeoutError:
            missing = sorted(set(range(save.world_size)) - set(save.fingerprints))
            await self._abort(
                save,
                f"ranks {_short(missing)} never joined the save of step {save.step} within {save.timeout_s:.0f} s "
                f"(nodes that joined: {sorted(save.nodes)})",
            )
            save.planned.set()

    async def report(
        self,
        job: str,
        step: int,
        save_id: str,
        node: int,
        manifest: NodeManifest | None,
        error: str,
        extras: dict[int, Any],
        model_files: dict[str, bytes],
    ) -> Outcome:
        """Take node's manifest (or its failure); returns the step's outcome once it is decided."""
        save = self._saves.get((job, step))
        if save is None or save.save_id != save_id:
            return Outcome(False, f"the coordinator knows no save {save_id} of step {step} (it restarted or the save was aborted)", decided=False)
        if node not in save.nodes:
            raise InvalidRequest(f"node {node} did not join the save of step {step}")
        if not save.decided.is_set():
            if manifest is None:
                await self._abort(save, f"node {node} failed: {error or 'no reason given'}")
            else:
                save.manifests[node] = manifest
                save.extras.update(extras)
                save.model_files.update(model_files)
                if set(save.manifests) == save.nodes:
                    await self._commit(save)
        await save.decided.wait()
        assert save.outcome is not None
        return save.outcome

    async def _commit(self, save: _GlobalSave) -> None:
        assert save.plan is not None
        shared = all(rid == self.root_id for rid in save.root_ids.values())
        try:
            files = await asyncio.to_thread(self._write_commit, save, shared)
        except (IncompleteStep, OSError) as exc:
            log.exception("committing step %s of job %s failed", save.step, save.job)
            await self._abort(save, f"the coordinator could not commit: {exc}")
            return
        save.outcome = Outcome(True, step_files={} if shared else files)
        save.decided.set()
        log.info("committed step %s of job %s across nodes %s", save.step, save.job, sorted(save.nodes))
        await self.on_commit(save.job)

    def _write_commit(self, save: _GlobalSave, shared: bool) -> dict[str, bytes]:
        assert save.plan is not None
        manifests = [save.manifests[n] for n in sorted(save.manifests)]
        quantization = merged_quantization({m.node: m.quantization for m in manifests})
        _, files = step_files(
            save.job, save.step, save.plan, manifests, save.extras, save.model_files, save.metric, quantization=quantization
        )
        if shared:
            step_dir = self.storage.step_dir(save.job, save.step)
            for manifest in manifests:
                for record in manifest.files:
                    _check_file(step_dir / record.name, record, manifest.node)
        write_step_files(self.storage, save.job, save.step, files)
        self.storage.write_latest(save.job, save.step)
        return files

    async def _abort(self, save: _GlobalSave, reason: str) -> None:
        if save.decided.is_set():
            return
        save.error = save.error or reason
        save.outcome = Outcome(False, reason)
        save.decided.set()
        log.warning("save of step %s of job %s aborted on every node: %s", save.step, save.job, reason)
        try:
            await asyncio.to_thread(self.storage.remove_step, save.job, save.step)
        except OSError as exc:
            log.error("could not remove the aborted step %s of job %s: %s", save.step, save.job, exc)

    async def _watch_writers(self, save: _GlobalSave) -> None:
        """Abort the save when a node that has not reported stops answering, or answers but no
        longer has the save (its daemon restarted)."""
        failures: dict[int, int] = {}
        while not save.decided.is_set():
            await asyncio.sleep(LIVENESS_PERIOD_S)
            for node in sorted(save.nodes - set(save.manifests) - {0}):
                if save.decided.is_set():
                    return
                saving = await self.links.saving(node, save.job, save.step)
                failures[node] = 0 if saving else failures.get(node, 0) + 1
                if failures[node] >= LIVENESS_FAILURES:
                    what = "stopped answering" if saving is None else "lost the save (its daemon restarted)"
                    await self._abort(save, f"node {node} ({self.links.peers[node]}) {what} while writing step {save.step}")
                    return

    def deciding(self, job: str, step: int) -> bool:
        """Whether the save of `step` is under way here (joined, neither committed nor aborted)."""
        save = self._saves.get((job, step))
        return save is not None and not save.decided.is_set()

    def _forget_old(self, job: str) -> None:
        # the earliest begun, not the lowest steps: a rolled-back job's newest save has a low step
        done = [step for (j, step), s in list(self._saves.items()) if j == job and s.decided.is_set()]
        for step in done[:-RECENT_SAVES]:
            self._saves.pop((job, step), None)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def merged_quantization(records: dict[int, dict[str, Any] | None]) -> dict[str, Any] | None:
    """The index's quantization record of a step written by several nodes, from each node's
    record (node -> record; None: that node wrote it losslessly with a lossless lineage).

    Nodes decide from their own config (which SIGHUP can change on one of them), so they may
    disagree. The compounding guard must see the deepest lineage, so the record of the node
    with the highest generation is kept (the lowest such node on a tie); a disagreement is
    logged. Each fragment's own codec stays exact in its record either way. Pure."""
    present = {node: r for node, r in records.items() if r is not None}
    if not present:
        return None
    node = min(present, key=lambda n: (-int(present[n].get("generation", 0)), n))
    if any(r != present[node] for r in records.values()):
        log.warning(
            "nodes saved this step with different compression (%s); the index records node %d's, the deepest lineage",
            "; ".join(f"node {n}: {records[n]}" for n in sorted(records)), node,
        )
    return present[node]


def _check_file(path: Path, record: FileRecord, node: int) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise IncompleteStep(f"{path.name}, written by node {node}, is not in the shared root") from None
    if size != record.size:
        raise IncompleteStep(f"{path.name}, written by node {node}, has {size} bytes, its manifest says {record.size}")


def _short(values: Sequence[int], limit: int = 16) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


# ------------------------------------------------------------------ wire conversions


def meta_of(spec: TensorSpec) -> pb.TensorMeta:
    return pb.TensorMeta(
        name=spec.name, kind=spec.kind, dtype=spec.dtype, shape=spec.shape,
        box=pb.Box(offsets=spec.box.offsets, lengths=spec.box.lengths), aliases=spec.aliases,
    )


def manifest_to_wire(manifest: NodeManifest) -> tuple[list[ppb.FileEntry], list[ppb.StoredFragment]]:
    files = [ppb.FileEntry(name=f.name, size=f.size, checksum=f.checksum) for f in manifest.files]
    fragments = [
        ppb.StoredFragment(
            name=name, file=f.file, key=f.key, box=pb.Box(offsets=f.box.offsets, lengths=f.box.lengths),
            dtype=f.dtype, offset=f.offset, nbytes=f.nbytes, checksum=f.checksum,
            chunk_bytes=f.chunk_bytes, chunk_xxh3=f.chunk_xxh3,
            quant_json=json.dumps(f.quant.to_json()) if f.quant is not None else "",
        )
        for name, f in manifest.fragments
    ]
    return files, fragments


def manifest_from_wire(
    node: int, files: Sequence[ppb.FileEntry], fragments: Sequence[ppb.StoredFragment], quantization_json: str = ""
) -> NodeManifest:
    """Raises InvalidRequest for malformed quantization records."""
    try:
        quantization = json.loads(quantization_json) if quantization_json else None
        records = tuple(
            (
                f.name,
                FragmentRecord(
                    f.file, f.key, Box(tuple(f.box.offsets), tuple(f.box.lengths)), f.dtype, f.offset, f.nbytes, f.checksum,
                    f.chunk_bytes, f.chunk_xxh3,
                    QuantRecord.from_json(json.loads(f.quant_json)) if f.quant_json else None,
                ),
            )
            for f in fragments
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InvalidRequest(f"node {node}'s manifest has a malformed quantization record: {exc}") from None
    if quantization is not None and not isinstance(quantization, dict):
        raise InvalidRequest(f"node {node}'s quantization record must be a JSON object")
    return NodeManifest(node, tuple(FileRecord(f.name, f.size, f.checksum, node) for f in files), records, quantization)


class Cluster:
    """This node's view of the other nodes: the coordinator (in process on node 0, over gRPC
    elsewhere) and the peers' inventories and files."""

    def __init__(
        self, node: int, peers: Sequence[str], token: str, storage: Storage, on_commit: Callable[[str], Awaitable[None]], tls: PeerTls | None = None
    ) -> None:
        self.node = node
        self.links = PeerLinks(peers, token, tls)
        self.storage = storage
        self.root_id = ""
        self._on_commit = on_commit
        self.coordinator: Coordinator | None = None

    def start(self) -> None:
        """Read (or create) the root's id; node 0 becomes the coordinator."""
        self.root_id = root_id(self.storage.root)
        if self.node == 0:
            self.coordinator = Coordinator(self.storage, self.links, self.root_id, self._on_commit)

    @property
    def nodes(self) -> int:
        return len(self.links.peers)

    def describe(self, node: int) -> str:
        return f"node {node} ({self.links.peers[node]})" if 0 <= node < self.nodes else f"node {node}"

    async def join_save(
        self,
        job: str,
        step: int,
        world_size: int,
        fingerprints: dict[int, str],
        specs: dict[int, tuple[TensorSpec, ...]],
        known_plans: Sequence[str],
        timeout_s: float,
        metric: float | None,
    ) -> JoinResult:
        if self.coordinator is not None:
            return await self.coordinator.join(
                job, step, self.node, world_size, fingerprints, specs, known_plans, self.root_id, timeout_s, metric
            )
        request = ppb.JoinSaveRequest(
            job=job, step=step, node=self.node, world_size=world_size, fingerprints=fingerprints,
            tensors=[ppb.RankTensors(rank=r, fingerprint=fingerprints[r], tensors=[meta_of(s) for s in specs[r]]) for r in sorted(specs)],
            known_plans=list(known_plans), timeout_s=timeout_s, metric=metric or 0.0, has_metric=metric is not None,
            root_id=self.root_id,
        )
        reply = await self._call_coordinator(self.links.stub(0).JoinSave, request, timeout_s + 30)
        specs_out = None
        if reply.tensors:
            by_rank = {t.rank: tuple(tensor_specs(t.tensors)) for t in reply.tensors}
            if sorted(by_rank) != list(range(world_size)):
                raise Aborted(f"the coordinator sent metadata for ranks {sorted(by_rank)}, expected 0..{world_size - 1}")
            specs_out = tuple(by_rank[r] for r in range(world_size))
        node_of_rank = tuple(reply.node_of_rank[r] for r in range(world_size))
        return JoinResult(reply.save_id, reply.plan_key, node_of_rank, specs_out, reply.shared_root)

    async def report(
        self, job: str, step: int, save_id: str, manifest: NodeManifest | None, error: str, extras: dict[int, str], model_files: dict[str, bytes]
    ) -> Outcome:
        """Report this node's part; returns the outcome. extras: rank -> JSON text."""
        if self.coordinator is not None:
            return await self.coordinator.report(
                job, step, save_id, self.node, manifest, error, {r: json.loads(t) for r, t in extras.items()}, model_files
            )
        files, fragments = manifest_to_wire(manifest) if manifest is not None else ([], [])
        request = ppb.ReportManifestRequest(
            job=job, step=step, save_id=save_id, node=self.node, ok=manifest is not None, error=error,
            files=files, fragments=fragments, extras_json=extras,
            model_files={k: v.decode() for k, v in model_files.items()},
            quantization_json=json.dumps(manifest.quantization) if manifest is not None and manifest.quantization is not None else "",
        )
        try:
            reply = await self.links.stub(0).ReportManifest(request, metadata=self.links.metadata)
        except grpc.RpcError as exc:
            return Outcome(False, f"the coordinator {self.describe(0)} did not answer: {exc.details() or exc.code().name}", decided=False)
        return Outcome(reply.committed, reply.error, dict(reply.step_files))

    async def _call_coordinator(self, method: Any, request: Any, timeout_s: float) -> Any:
        try:
            return await method(request, timeout=timeout_s, metadata=self.links.metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            details = exc.details() or code.name
            if code == grpc.StatusCode.FAILED_PRECONDITION and "unknown fingerprint" in details:
                raise Precondition(details) from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(details) from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED):
                raise Unavailable(f"the coordinator {self.describe(0)} is not reachable: {details}") from None
            raise Aborted(f"the coordinator {self.describe(0)} refused: {details}") from None

    async def inventory(self, node: int, job: str, step: int) -> tuple[str, bool, dict[str, int], bool] | str:
        """(root id, has the index, {data file: size}, saving it now) of a peer, or why it did not answer."""
        try:
            reply = await self.links.stub(node).Inventory(
                ppb.InventoryRequest(job=job, step=step), timeout=INVENTORY_TIMEOUT_S, metadata=self.links.metadata, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            return exc.details() or exc.code().name
        return reply.root_id, reply.committed, {f.name: f.size for f in reply.files}, reply.in_flight

    async def fetch(self, node: int, job: str, step: int, file: str, offset: int, nbytes: int, out_fd: int) -> None:
        """Copy bytes [offset, offset + nbytes) of a peer's step file to the same offset of out_fd."""
        request = ppb.FetchRequest(job=job, step=step, file=file, offset=offset, nbytes=nbytes)
        position = offset
        try:
            async for chunk in self.links.stub(node).Fetch(request, timeout=3600, metadata=self.links.metadata):
                await asyncio.to_thread(os.pwrite, out_fd, chunk.data, position)
                position += len(chunk.data)
        except grpc.RpcError as exc:
            raise Unavailable(f"fetching {file} of {step_dir_name(step)} from {self.describe(node)} failed: {exc.details() or exc.code().name}") from None
        if position != offset + nbytes:
            raise Unavailable(f"{self.describe(node)} sent {position - offset} of {nbytes} bytes of {file}")

    async def fetch_bytes(self, node: int, job: str, step: int, file: str, limit: int = 256 * 2**20) -> bytes:
        """A whole small file of a peer's committed step (the index, extra.json, ...)."""
        request = ppb.FetchRequest(job=job, step=step, file=file, offset=0, nbytes=0)
        parts: list[bytes] = []
        try:
            async for chunk in self.links.stub(node).Fetch(request, timeout=600, metadata=self.links.metadata):
                parts.append(chunk.data)
                if sum(map(len, parts)) > limit:
                    raise Unavailable(f"{file} of {step_dir_name(step)} on {self.describe(node)} is larger than {limit} bytes")
        except grpc.RpcError as exc:
            raise Unavailable(f"fetching {file} of {step_dir_name(step)} from {self.describe(node)} failed: {exc.details() or exc.code().name}") from None
        return b"".join(parts)

    async def close(self) -> None:
        await self.links.close()
