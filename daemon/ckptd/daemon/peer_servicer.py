"""The gRPC servicer of ckptd.v1.Peer (daemon to daemon, on TCP): check the token, validate,
call the coordinator or the storage, map errors to status codes (servicer._abort).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import os
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import grpc

from ckptd.common.names import check_job_id
from ckptd.daemon import errors
from ckptd.daemon.checks import MAX_WORLD_SIZE, check_step, check_timeout, tensor_specs
from ckptd.daemon.cluster import FETCH_CHUNK, PEER_TOKEN_KEY, manifest_from_wire, meta_of
from ckptd.daemon.format import INDEX_NAME
from ckptd.daemon.service import CheckpointService
from ckptd.daemon.format import MODEL_FILES
from ckptd.daemon.servicer import MAX_MODEL_FILE_BYTES, _abort, parse_json
from ckptd.daemon.storage import ForeignEntry
from ckptd.wire.v1 import peer_pb2 as ppb
from ckptd.wire.v1 import peer_pb2_grpc as ppb_grpc

T = TypeVar("T")


def _authorized(context: grpc.aio.ServicerContext, token: str) -> None:
    """Raise Unauthenticated unless the call carries exactly one peer token, the right one
    (compared in constant time). Runs before a handler reads its request."""
    given = [value for key, value in (context.invocation_metadata() or ()) if key == PEER_TOKEN_KEY]
    presented = given[0] if len(given) == 1 and isinstance(given[0], str) else ""
    matches = hmac.compare_digest(presented.encode(), token.encode())
    if len(given) > 1:
        raise errors.Unauthenticated(f"{len(given)} peer tokens in one call: send exactly one ({PEER_TOKEN_KEY})")
    if not matches or not token:
        raise errors.Unauthenticated("wrong or missing peer token: every daemon needs the same --peer-token / CKPTD_PEER_TOKEN")


def _peer_call(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Check the token, then map the method's exceptions to status codes."""

    @functools.wraps(method)
    async def wrapper(self: "PeerServicer", request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            _authorized(context, self.token)
            return await method(self, request, context)
        except Exception as exc:
            await _abort(context, exc, method.__name__)
        raise AssertionError("unreachable: context.abort raises")

    return wrapper


class PeerServicer(ppb_grpc.PeerServicer):
    def __init__(self, service: CheckpointService, token: str) -> None:
        assert service.cluster is not None, "the peer service runs only with several nodes"
        self.service = service
        self.cluster = service.cluster
        self.token = token

    def _check_node(self, node: int) -> int:
        if not 0 <= node < self.cluster.nodes:
            raise errors.InvalidRequest(f"node {node} is not in [0, {self.cluster.nodes}): check --peers on every node")
        return node

    def _coordinator(self) -> Any:
        if self.cluster.coordinator is None:
            raise errors.Precondition(
                f"this daemon is node {self.cluster.node}, not the coordinator (node 0): check that --peers lists the nodes in the same order everywhere"
            )
        return self.cluster.coordinator

    @_peer_call
    async def JoinSave(self, request: ppb.JoinSaveRequest, context: grpc.aio.ServicerContext) -> ppb.JoinSaveResponse:
        coordinator = self._coordinator()
        job = check_job_id(request.job)
        step = check_step(request.step)
        node = self._check_node(request.node)
        if not 1 <= request.world_size <= MAX_WORLD_SIZE:
            raise errors.InvalidRequest(f"world_size {request.world_size} must be between 1 and {MAX_WORLD_SIZE}")
        if not request.fingerprints:
            raise errors.InvalidRequest(f"node {node} joined the save of step {step} without ranks")
        specs = {}
        for entry in request.tensors:
            if request.fingerprints.get(entry.rank) != entry.fingerprint:
                raise errors.InvalidRequest(f"metadata of rank {entry.rank} does not match its fingerprint")
            specs[entry.rank] = tuple(tensor_specs(entry.tensors))
        timeout_s = check_timeout(request.timeout_s) or self.service.config.save_timeout_s
        result = await coordinator.join(
            job, step, node, request.world_size, dict(request.fingerprints), specs, list(request.known_plans),
            request.root_id, timeout_s, request.metric if request.has_metric else None,
        )
        tensors = []
        if result.specs is not None:
            for rank, rank_specs in enumerate(result.specs):
                tensors.append(ppb.RankTensors(rank=rank, fingerprint="", tensors=[meta_of(s) for s in rank_specs]))
        return ppb.JoinSaveResponse(
            save_id=result.save_id, plan_key=result.plan_key, node_of_rank=dict(enumerate(result.node_of_rank)),
            tensors=tensors, shared_root=result.shared_root,
        )

    @_peer_call
    async def ReportManifest(self, request: ppb.ReportManifestRequest, context: grpc.aio.ServicerContext) -> ppb.ReportManifestResponse:
        coordinator = self._coordinator()
        job = check_job_id(request.job)
        step = check_step(request.step)
        node = self._check_node(request.node)
        extras = {rank: parse_json(text, f"extras of rank {rank}") if text else {} for rank, text in request.extras_json.items()}
        model_files = {}
        for name, text in request.model_files.items():
            if name not in MODEL_FILES or len(text) > MAX_MODEL_FILE_BYTES:
                raise errors.InvalidRequest(f"model file {name!r} is not one of {', '.join(MODEL_FILES)} or too large")
            parse_json(text, f"model file {name}")
            model_files[name] = text.encode()
        manifest = None
        if request.ok:
            # the JSON fields are checked here first: manifest_from_wire trusts the parser's depth
            if request.quantization_json:
                parse_json(request.quantization_json, f"node {node}'s quantization record")
            for fragment in request.fragments:
                if fragment.quant_json:
                    parse_json(fragment.quant_json, f"the quantization record of fragment {fragment.name[:200]!r}")
            manifest = manifest_from_wire(node, request.files, request.fragments, request.quantization_json)
        for record in manifest.files if manifest is not None else ():
            _check_file_name(record.name)
        outcome = await coordinator.report(job, step, request.save_id, node, manifest, request.error[:2000], extras, model_files)
        return ppb.ReportManifestResponse(committed=outcome.committed, error=outcome.error, step_files=outcome.step_files)

    @_peer_call
    async def Inventory(self, request: ppb.InventoryRequest, context: grpc.aio.ServicerContext) -> ppb.InventoryResponse:
        job = check_job_id(request.job)
        step = check_step(request.step)
        step_dir = self.service.storage.step_dir(job, step)
        committed = await asyncio.to_thread(self.service.storage.is_committed, job, step)  # links not followed
        files = []
        if committed:
            for path in await asyncio.to_thread(lambda: sorted(step_dir.glob("*.safetensors"))):
                files.append(ppb.FileEntry(name=path.name, size=path.stat().st_size))
        coordinator = self.cluster.coordinator
        in_flight = self.service.saving(job, step) or (coordinator is not None and coordinator.deciding(job, step))
        return ppb.InventoryResponse(root_id=self.cluster.root_id, committed=committed, files=files, in_flight=in_flight)

    async def Fetch(self, request: ppb.FetchRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[ppb.Chunk]:
        try:
            _authorized(context, self.token)
            job = check_job_id(request.job)
            step = check_step(request.step)
            name = _check_file_name(request.file, data_only=False)
            try:
                index = await self.service.index(job, step)
            except (errors.Precondition, OSError):
                raise errors.NotFound(f"step {step} of job {job!r} is not committed on node {self.cluster.node}") from None
            path = self.service.storage.step_dir(job, step) / name
            sizes = {f.name: f.size for f in index.files}
            if name == INDEX_NAME:
                sizes[name] = await asyncio.to_thread(lambda: path.stat().st_size)
            if name not in sizes:
                raise errors.NotFound(f"{name} is not a file of step {step} of job {job!r}")
            size = sizes[name]
            nbytes = request.nbytes or size - request.offset  # 0: to the end
            if request.offset < 0 or nbytes < 0 or request.offset + nbytes > size:
                raise errors.InvalidRequest(f"bytes [{request.offset}, +{request.nbytes}) are outside {name} ({size} bytes)")
            try:
                fd = await asyncio.to_thread(self.service.storage.open_step_file, job, step, name)  # no link followed, no FIFO waited on
            except ForeignEntry as exc:
                raise errors.Precondition(f"{name} on node {self.cluster.node} is not served: {exc}") from None
            try:
                done = 0
                while done < nbytes:
                    n = min(FETCH_CHUNK, nbytes - done)
                    data = await asyncio.to_thread(os.pread, fd, n, request.offset + done)
                    if not data:
                        raise errors.Precondition(f"{name} on node {self.cluster.node} ends before byte {request.offset + done}")
                    done += len(data)
                    yield ppb.Chunk(data=data)
            finally:
                os.close(fd)
        except Exception as exc:
            await _abort(context, exc, "Fetch")


def _check_file_name(name: str, data_only: bool = True) -> str:
    """A plain file name inside a step directory (a data file unless not `data_only`)."""
    if not name or "/" in name or "\0" in name or name.startswith(".") or len(name) > 255:
        raise errors.InvalidRequest(f"{name!r} is not a file name of a step directory")
    if data_only and not name.endswith(".safetensors"):
        raise errors.InvalidRequest(f"{name!r} is not a checkpoint data file name")
    return name
