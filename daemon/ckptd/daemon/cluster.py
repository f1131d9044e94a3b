"""The coordinator's side of a save, and the links between daemons.

Every save meets and commits at a coordinator: node 0's with several nodes (over the peer
port for the others), an in-process one with a single node (`SingleNode`): one protocol.

A save across nodes (docs/architecture.md §12):
1. Each node's daemon gathers its local ranks (BeginSave), then joins the save at the
   coordinator (node 0) with its ranks' fingerprints, and their tensor metadata the first time.
   The coordinator answers every node once all ranks of the job have joined, with the plan's
   input: every rank's metadata (unless the node already planned from the same input) and the
   node of each rank, and the save's compression, decided once for all nodes. Every node
   computes the same plan from it (plan.make_save_plan is pure).
2. Each node copies and writes its part (writer.write_node_files), then reports its manifest.
3. When every node that joined has reported, the coordinator checks that the manifests hold
   each tensor exactly once, writes the index (the commit) and `latest`, and answers each
   node's report with the outcome; on node-local roots each node then writes the same index.
   A node that reports a failure, or stops answering, aborts the step everywhere: nobody
   writes an index and every node removes what it wrote.

Daemons authenticate each other with a shared token in the call metadata (PEER_TOKEN_KEY),
checked on every Peer call by rpc_auth.PeerTokenInterceptor. The messages are built and read
in rpc_convert; a failed call to node 0 becomes a domain error in rpc_errors.coordinator_error.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Sequence

import grpc

from ckptd.daemon import rpc_convert
from ckptd.daemon.engine.compression import NO_OPTIONS, Compression, Decide, SaveOptions, lossless_by_default
from ckptd.daemon.errors import Aborted, InvalidRequest, Unavailable, UnknownFingerprint
from ckptd.daemon.format import ADAPTER_WEIGHTS, CheckpointIndex, FileRecord, step_dir_name
from ckptd.daemon.peer_tls import PeerTls
from ckptd.daemon.step_build import IncompleteStep, NodeManifest, adapter_source, step_files
from ckptd.daemon.writer import write_step_files
from ckptd.daemon.plan import PlanError, SavePlan, TensorSpec, make_save_plan
from ckptd.daemon.records import JoinResult, Outcome, PeerInventory
from ckptd.daemon.rpc_auth import PEER_TOKEN_KEY
from ckptd.daemon.rpc_errors import coordinator_error
from ckptd.daemon.storage import StorageBackend
# the manifest's wire conversions live in rpc_convert; re-exported for tests/daemon/test_cluster.py
from ckptd.wire import MESSAGE_SIZE_OPTIONS
from ckptd.wire.v1 import peer_pb2 as ppb
from ckptd.wire.v1 import peer_pb2_grpc as ppb_grpc

log = logging.getLogger(__name__)

LIVENESS_PERIOD_S = 1.0
LIVENESS_FAILURES = 3  # consecutive failed checks before a writing node counts as gone
FETCH_CHUNK = 4 * 2**20
INVENTORY_TIMEOUT_S = 3.0  # a peer that does not answer within this counts as absent for a load
RECENT_SAVES = 16


def plan_key(fingerprints: dict[int, str], node_of_rank: dict[int, int]) -> str:
    """What a plan depends on: every rank's metadata fingerprint and node, in rank order."""
    h = hashlib.sha256()
    for rank in sorted(fingerprints):
        h.update(f"{rank}|{fingerprints[rank]}|{node_of_rank[rank]}\n".encode())
    return h.hexdigest()


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
    options: SaveOptions = NO_OPTIONS  # the ranks' compression options (every node's the same)
    lineage: int = 0  # the deepest lineage of what the nodes' ranks last loaded
    compression: Compression | None = None  # decided when planned
    # the answer's node of each rank and every rank's metadata, made once when planned (not
    # once per joining node: that is nodes x ranks)
    rank_nodes: tuple[int, ...] = ()
    all_specs: tuple[tuple[TensorSpec, ...], ...] = ()
    rank_fingerprints: tuple[str, ...] = ()
    shared_root: bool = False  # every node writes into one root (decided when planned: all have joined)

    @property
    def nodes(self) -> set[int]:
        return set(self.root_ids)


def _slim(save: _GlobalSave) -> None:
    """A decided save only answers late reports: keep its outcome, not what the commit was made
    of (manifests, extras, metadata, the index: ~2 KiB per tensor; issue 30 finding 5)."""
    save.manifests.clear()
    save.extras.clear()
    save.model_files.clear()
    save.all_specs = ()
    if save.outcome is not None:
        files = save.outcome.step_files if save.nodes - {0} else {}
        save.outcome = replace(save.outcome, index=None, step_files=files)


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

    async def ready(self, node: int, within_s: float) -> bool:
        """Wait until the channel to `node` is connected; False when it is not within `within_s`
        seconds. A channel whose last attempt failed (the peer was restarting) fails every call
        at once until its reconnect backoff ends: callers that must reach a peer wait here first."""
        try:
            await asyncio.wait_for(self._channel(node).channel_ready(), within_s)
        except asyncio.TimeoutError:
            return False
        return True

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

    def __init__(
        self,
        storage: StorageBackend,
        links: PeerLinks,
        own_root_id: str,
        on_commit: Callable[[str], Awaitable[None]],
        decide: Decide = lossless_by_default,
    ) -> None:
        self.storage = storage
        self.links = links
        self.root_id = own_root_id
        self.on_commit = on_commit  # retention for the job, after each commit
        self.decide = decide  # each save's compression, from its options and lineage (node 0's settings)
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
        options: SaveOptions = NO_OPTIONS,
        lineage: int = 0,
    ) -> JoinResult:
        """Add `node`'s ranks to the save of `step`; returns when every rank has joined.

        options: the compression its ranks ask for (every node must ask for the same); lineage:
        the quantization generation of what they last loaded. The coordinator decides the
        save's compression from these when it plans the save (JoinResult.compression)."""
        for rank, fingerprint in fingerprints.items():
            if not 0 <= rank < world_size:
                raise InvalidRequest(f"rank {rank} is not in [0, world_size={world_size})")
            if rank in specs:
                self._specs[(rank, fingerprint)] = specs[rank]
            elif (rank, fingerprint) not in self._specs:
                raise UnknownFingerprint()
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
        if save.root_ids and options != save.options:
            raise InvalidRequest(
                f"node {node}'s ranks ask for quantize={options.quantize!r}, master_weights={options.master_weights!r} in step {step} "
                f"but other nodes' ranks asked for quantize={save.options.quantize!r}, master_weights={save.options.master_weights!r}; "
                "every rank must pass the same"
            )
        save.options = options
        save.lineage = max(save.lineage, lineage)
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
            node_of_rank=save.rank_nodes,
            specs=None if known else save.all_specs,
            shared_root=save.shared_root,
            compression=save.compression,
            plan=save.plan,
            fingerprints=save.rank_fingerprints,
        )

    def _shared(self, save: _GlobalSave) -> bool:
        """Whether several nodes write the save into one storage root (equal root ids)."""
        return len(save.root_ids) > 1 and all(rid == self.root_id for rid in save.root_ids.values())

    async def _plan(self, save: _GlobalSave) -> None:
        try:
            save.key = plan_key(save.fingerprints, save.node_of_rank)
            save.all_specs = tuple(self._specs[(r, save.fingerprints[r])] for r in range(save.world_size))
            save.rank_nodes = tuple(save.node_of_rank[r] for r in range(save.world_size))
            save.rank_fingerprints = tuple(save.fingerprints[r] for r in range(save.world_size))
            save.shared_root = self._shared(save)  # once, not per joining node (O(nodes) each)
            plan = self._plans.get(save.key)
            if plan is None:
                plan = await asyncio.to_thread(make_save_plan, save.all_specs, save.rank_nodes)
                self._plans[save.key] = plan
            save.plan = plan
            save.compression = self.decide(save.options, save.lineage)
            if save.nodes - {0}:
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
        if node not in save.root_ids:  # save.root_ids: the nodes that joined (save.nodes builds a set)
            raise InvalidRequest(f"node {node} did not join the save of step {step}")
        if not save.decided.is_set():
            if manifest is None:
                await self._abort(save, f"node {node} failed: {error or 'no reason given'}")
            else:
                save.manifests[node] = manifest
                save.extras.update(extras)
                save.model_files.update(model_files)
                if len(save.manifests) == len(save.root_ids):  # manifests come from joined nodes only: all have reported
                    await self._commit(save)
        await save.decided.wait()
        assert save.outcome is not None
        return save.outcome

    async def _commit(self, save: _GlobalSave) -> None:
        assert save.plan is not None
        shared = self._shared(save)
        try:
            index, files = await asyncio.to_thread(self._write_commit, save, shared)
        except (IncompleteStep, OSError) as exc:
            log.exception("committing step %s of job %s failed", save.step, save.job)
            await self._abort(save, f"the coordinator could not commit: {exc}")
            return
        # the small files are for the other nodes with a root of their own (ReportManifest's answer)
        save.outcome = Outcome(True, step_files={} if shared or not save.nodes - {0} else files, index=index)
        save.decided.set()
        if len(save.nodes) > 1:
            log.info("committed step %s of job %s across nodes %s", save.step, save.job, sorted(save.nodes))
        await self.on_commit(save.job)

    def _adapter_copy(self, save: _GlobalSave, manifests: list[NodeManifest]) -> tuple[FileRecord, bytes] | None:
        """The PEFT adapter file to publish with the step (step_build.adapter_source), read back
        from this root; None when the step is no adapter or its file is not here."""
        assert save.plan is not None
        source = adapter_source(manifests, {t.name: t.kind for t in save.plan.tensors}, save.model_files)
        if source is None:
            return None
        try:
            return source, self.storage.read_range(save.job, save.step, source.name, 0, source.size)
        except OSError as exc:
            log.warning("step %s of job %s: no %s beside adapter_config.json (%s); `ckptd export` writes one", save.step, save.job, ADAPTER_WEIGHTS, exc)
            return None

    def _write_commit(self, save: _GlobalSave, shared: bool) -> tuple[CheckpointIndex, dict[str, bytes]]:
        """Write the step's small files and its index (the commit) and `latest`; returns the
        index and those files (for nodes with their own root)."""
        assert save.plan is not None
        manifests = [save.manifests[n] for n in sorted(save.manifests)]
        assert save.compression is not None
        index, files = step_files(
            save.job, save.step, save.plan, manifests, save.extras, save.model_files, save.metric,
            quantization=save.compression.record, adapter=self._adapter_copy(save, manifests),
        )
        if shared:
            present = self.storage.step_file_sizes(save.job, save.step)
            for manifest in manifests:
                for record in manifest.files:
                    _check_file(present, record, manifest.node)
        write_step_files(self.storage, save.job, save.step, files)
        self.storage.write_latest(save.job, save.step)
        return index, files

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
        for step in done[-RECENT_SAVES:]:
            _slim(self._saves[(job, step)])

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _check_file(present: dict[str, int], record: FileRecord, node: int) -> None:
    """A file a node says it wrote into the shared root is there with its size (present: the
    step's files and sizes)."""
    size = present.get(record.name)
    if size is None:
        raise IncompleteStep(f"{record.name}, written by node {node}, is not in the shared root")
    if size != record.size:
        raise IncompleteStep(f"{record.name}, written by node {node}, has {size} bytes, its manifest says {record.size}")


def _short(values: Sequence[int], limit: int = 16) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


class Cluster:
    """This node's view of the other nodes: the coordinator (in process on node 0, over gRPC
    elsewhere) and the peers' inventories and files."""

    def __init__(
        self,
        node: int,
        peers: Sequence[str],
        token: str,
        storage: StorageBackend,
        on_commit: Callable[[str], Awaitable[None]],
        tls: PeerTls | None = None,
        decide: Decide = lossless_by_default,
    ) -> None:
        self.node = node
        self.links = PeerLinks(peers, token, tls)
        self.storage = storage
        self.root_id = ""
        self._on_commit = on_commit
        self._decide = decide
        self.coordinator: Coordinator | None = None

    def start(self) -> None:
        """Read (or create) the root's id; node 0 becomes the coordinator."""
        self.root_id = self.storage.root_id()
        if self.node == 0:
            self.coordinator = Coordinator(self.storage, self.links, self.root_id, self._on_commit, self._decide)

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
        options: SaveOptions = NO_OPTIONS,
        lineage: int = 0,
    ) -> JoinResult:
        """Join the save at the coordinator (Coordinator.join); returns once every rank has."""
        if self.coordinator is not None:
            return await self.coordinator.join(
                job, step, self.node, world_size, fingerprints, specs, known_plans, self.root_id, timeout_s, metric, options, lineage
            )
        request = rpc_convert.join_request(
            job, step, self.node, world_size, fingerprints, specs, known_plans, timeout_s, metric, self.root_id, options, lineage
        )
        # A coordinator that is restarting joins late rather than failing this node's ranks; one
        # that stays away past the join window fails the call below with gRPC's reason.
        await self.links.ready(0, timeout_s)
        reply = await self._call_coordinator(self.links.stub(0).JoinSave, request, timeout_s + 30)
        return rpc_convert.join_result_of(reply, world_size)

    async def report(
        self, job: str, step: int, save_id: str, manifest: NodeManifest | None, error: str, extras: dict[int, Any], model_files: dict[str, bytes]
    ) -> Outcome:
        """Report this node's part; returns the outcome. extras: rank -> its extras tree."""
        if self.coordinator is not None:
            return await self.coordinator.report(job, step, save_id, self.node, manifest, error, extras, model_files)
        texts = {r: json.dumps(e) for r, e in extras.items()}
        request = rpc_convert.report_request(job, step, save_id, self.node, manifest, error, texts, model_files)
        try:
            reply = await self.links.stub(0).ReportManifest(request, metadata=self.links.metadata)
        except grpc.RpcError as exc:
            return Outcome(False, f"the coordinator {self.describe(0)} did not answer: {exc.details() or exc.code().name}", decided=False)
        return rpc_convert.outcome_of(reply)

    async def _call_coordinator(self, method: Any, request: Any, timeout_s: float) -> Any:
        try:
            return await method(request, timeout=timeout_s, metadata=self.links.metadata)
        except grpc.RpcError as exc:
            raise coordinator_error(exc, self.describe(0)) from None

    async def inventory(self, node: int, job: str, step: int, newest: bool = False) -> PeerInventory | str:
        """What a peer holds of a step (PeerInventory; with `newest`, also its newest committed
        step of the job), or why it did not answer."""
        try:
            reply = await self.links.stub(node).Inventory(
                ppb.InventoryRequest(job=job, step=step, newest=newest), timeout=INVENTORY_TIMEOUT_S, metadata=self.links.metadata, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            return exc.details() or exc.code().name
        return rpc_convert.inventory_of(reply)

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


class SingleNode:
    """A daemon without peers: its saves meet and commit at an in-process coordinator of one
    node, the same Coordinator node 0 runs for several (no peer port, no root id file), so that
    one node and several commit by one protocol (engine/commit.py)."""

    node = 0

    def __init__(self, storage: StorageBackend, on_commit: Callable[[str], Awaitable[None]], decide: Decide = lossless_by_default) -> None:
        self.coordinator = Coordinator(storage, PeerLinks((), ""), "", on_commit, decide)

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
        options: SaveOptions = NO_OPTIONS,
        lineage: int = 0,
    ) -> JoinResult:
        return await self.coordinator.join(job, step, 0, world_size, fingerprints, specs, known_plans, "", timeout_s, metric, options, lineage)

    async def report(
        self, job: str, step: int, save_id: str, manifest: NodeManifest | None, error: str, extras: dict[int, Any], model_files: dict[str, bytes]
    ) -> Outcome:
        return await self.coordinator.report(job, step, save_id, 0, manifest, error, extras, model_files)
