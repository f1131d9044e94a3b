"""CheckpointClient: what a training rank uses to save to and load from its node's daemon.

`save` and `load` are collective: every rank of the job calls them for the same step.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import grpc
import torch

from ckptd.client.arena_copy import CopyPlan
from ckptd.client.devcopy import coalesced_ranges, item_of
from ckptd.client.errors import CheckpointError, CheckpointNotFound, DaemonUnavailable, InvalidState
from ckptd.client.handle import DurableInfo, SaveHandle
from ckptd.client.handoff import CudaBackend, DeviceBackend, Fenced, GpuHandoff, lazy_placements
from ckptd.client.layout import Fragment, LayoutRules, RankCoords
from ckptd.client.slots import Placed, place
from ckptd.client.state import FlatState, TensorEntry, flatten_state, restore_state
from ckptd.client.structure import Structure, StructureCache
from ckptd.client.transport import ArenaMaps, Decoding, Fill, MemoryCopies, Source, fill_all
from ckptd.common import dtypes
from ckptd.common.boxes import Box
from ckptd.common.frames import Frames
from ckptd.common.names import check_job_id
from ckptd.common.paths import default_address
from ckptd.common.quant_options import check_master_mode, check_scheme
from ckptd.wire import MESSAGE_SIZE_OPTIONS
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc

log = logging.getLogger("ckptd.client")

ON_ERROR = ("warn", "raise")


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as the daemon lists it."""

    step: int
    created_at: float  # unix seconds
    size_bytes: int
    file_count: int
    path: str
    in_memory: bool  # the snapshot is still in the daemon's memory (fast restore)
    metric: float | None


def _model_files(state: Mapping[str, Any]) -> dict[str, str]:
    """config.json (and generation_config.json) of a Hugging Face model, so the step directory
    loads with `from_pretrained` as it is."""
    model = state.get("model")
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return {}
    files = {"config.json": config.to_json_string()}
    generation = getattr(model, "generation_config", None)
    if generation is not None and callable(getattr(generation, "to_json_string", None)):
        files["generation_config.json"] = generation.to_json_string()
    return files


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return (torch.distributed.get_rank() if rank is None else rank,
                torch.distributed.get_world_size() if world_size is None else world_size)
    env_rank = int(os.environ.get("RANK", "0"))
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    return (env_rank if rank is None else rank, env_world if world_size is None else world_size)


def _meta(entry: TensorEntry, fragment: Fragment) -> pb.TensorMeta:
    box = fragment.box
    return pb.TensorMeta(
        name=entry.name,
        kind=entry.kind,
        dtype=dtypes.from_torch_name(str(fragment.local.dtype)),
        shape=fragment.global_shape,
        box=pb.Box(offsets=box.offsets, lengths=box.lengths),
        aliases=entry.aliases,
    )


def _metas(structure: Structure) -> list[pb.TensorMeta]:
    """The tensor metadata of a structure's fragments, built once per structure."""
    metas = structure.cache.get("metas")
    if metas is None:
        metas = structure.cache["metas"] = [_meta(e, f) for e, f in structure.fragments]
    return metas


def _box_of(message: pb.Box) -> Box:
    return Box(tuple(message.offsets), tuple(message.lengths))


class CheckpointClient:
    """A training rank's connection to its node's ckptd.

    job: the training run's id. address: "unix:///path.sock" (default: $CKPTD_ADDRESS, else the
    default socket). rank/world_size: default from torch.distributed, else $RANK/$WORLD_SIZE.
    on_error: "warn" (default: a failed save is logged and returned as a failed handle, training
    goes on) or "raise". It covers what can pass (a daemon that is down, a full disk, a timeout,
    an aborted save); a state that can never be saved (an optimizer without its model, a value
    of an unsupported type, a bad tensor name, a meta or sparse tensor) raises on the first save
    whatever it says: ValueError or TypeError, or InvalidState when the daemon refuses the
    state's metadata, with the message that says how to fix it. timeout_s: how long a save or
    load may wait for the other ranks.
    layout, coords: rules for manually sharded (Megatron-style) tensors and this rank's place in
    tensor parallelism (ckptd.client.layout); DTensors need none.
    local_world_size: how many of the job's ranks use this node's daemon; needed when the job
    spans several nodes (default: $LOCAL_WORLD_SIZE, which torchrun sets, else all ranks).
    read_files: how loads get bytes from disk: True, read the committed files directly (the
    storage root must be visible here); False, the daemon copies what is needed into shared
    memory first (a trainer container without the storage volume); None (default), read
    directly when this process can open the files, else go through the daemon.
    mode: how CUDA tensors are handed over (ckptd.client.handoff): "auto" (= "overlap"), "copy",
    "overlap" or "ipc"; CPU tensors always take the plain shared-memory copy. `mode_in_use` and
    `mode_reason` say what is used now and why it differs from the request (a fallback).
    """

    def __init__(
        self,
        job: str,
        *,
        address: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        mode: str = "auto",
        on_error: str = "warn",
        timeout_s: float = 600.0,
        copy_threads: int | None = None,
        layout: LayoutRules | None = None,
        coords: RankCoords | None = None,
        local_world_size: int | None = None,
        read_files: bool | None = None,
        _device_backend: DeviceBackend | None = None,
    ) -> None:
        self.job = check_job_id(job)
        # the GPU hand-off (checks `mode`); _device_backend: a stand-in for CUDA (tests)
        self._gpu = GpuHandoff(
            mode,
            (lambda: _device_backend) if _device_backend is not None else CudaBackend,
            _device_backend.owns if _device_backend is not None else CudaBackend.owns,
        )
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}: use 'warn' or 'raise'")
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        if local_world_size is None:
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        if not 0 <= local_world_size <= self.world_size:
            raise ValueError(f"local_world_size={local_world_size} must be between 1 and world_size={self.world_size}")
        self.local_world_size = local_world_size
        if read_files not in (None, True, False):
            raise ValueError(f"read_files={read_files!r}: use None (read committed files when this process can), True or False")
        self.read_files = read_files
        self.address = address or default_address()
        self.mode = mode
        self.on_error = on_error
        self.timeout_s = float(timeout_s)
        if layout is not None and coords is None:
            raise ValueError("layout rules need coords=RankCoords(tp_rank, tp_size): where this rank sits in tensor parallelism")
        self.layout = layout
        self.coords = coords
        self._rules_reported = False
        self._channel = grpc.insecure_channel(
            self.address,
            options=list(MESSAGE_SIZE_OPTIONS),
        )
        self._stub = pb_grpc.CheckpointStub(self._channel)
        self._pool = ThreadPoolExecutor(copy_threads or min(4, os.cpu_count() or 1), thread_name_prefix="ckptd-copy")
        # groups of a hand-off copy: one per core (the calling thread takes one), at most the pool's threads + 1
        self._copy_workers = max(1, min((copy_threads or 4) + 1, os.cpu_count() or 1))
        self._maps = ArenaMaps()
        self._known_fingerprints: set[str] = set()  # the daemon has their tensor metadata (BeginSave)
        self._known_load_fingerprints: set[str] = set()  # the same for PlanLoad
        # what stays the same from save to save (and load to load): see ckptd.client.structure
        self._save_structures = StructureCache()
        self._load_structures = StructureCache()
        self._placed: Placed | None = None
        self._copy_plans: dict[str, tuple[Placed, Any, CopyPlan]] = {}  # arena path -> (placed, mapping, plan)
        self.failed_saves = 0
        self._lineage = 0  # quantization generation of the step this client loaded last (compounding guard)

    @property
    def mode_in_use(self) -> str:
        """How CUDA tensors are handed over now: "copy", "overlap" or "ipc" (CPU tensors always
        take the plain shared-memory copy)."""
        return self._gpu.mode.in_use

    @property
    def mode_reason(self) -> str | None:
        """Why `mode_in_use` is not the mode asked for (e.g. why "ipc" fell back), else None."""
        return self._gpu.mode.reason

    def fence(self, host: bool = False) -> Fenced:
        """Make later changes of the saved state wait for the last save's device copies.

        GPU-side by default: the current CUDA stream waits on the copy-done event, the host goes
        on. host=True blocks the host instead (for state changed outside the CUDA stream order).
        A no-op when no copy is in flight (always for CPU tensors). Optimizers of the saved
        state get it as a step pre-hook; call it (or `with ckpt.fence(): ...`) before any other
        change of saved tensors, e.g. an EMA update.
        """
        return self._gpu.fence(host)

    @property
    def _who(self) -> pb.RankId:
        return pb.RankId(job=self.job, rank=self.rank, world_size=self.world_size, local_world_size=self.local_world_size)

    # ------------------------------------------------------------ save

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metric: float | None = None,
        quantize: str | None = None,
        rng: bool = False,
        master_weights: str | None = None,
    ) -> SaveHandle:
        """Hand `state` to the daemon as checkpoint `step`.

        Returns once the state may be modified again — for CUDA tensors in modes "overlap" and
        "ipc", once it is fenced: the optimizers of `state` fence themselves (a step pre-hook);
        other changes need `ckpt.fence()` or `handle.wait_snapshot()` first. `handle.stall_s`
        is how long this call blocked the caller.

        quantize: None (the daemon's default, `--quantize`, lossless unless configured), "none"
        (lossless), "O1" (optimizer moments in int8) or "O2" (int4); done by the daemon in the
        background. master_weights: None (the daemon's default), "keep", "drop" (rebuilt from
        the bf16/fp16 model weights on load) or "residual" (a bf16 difference to them). After a
        load from a lossy checkpoint the daemon may save losslessly (`--quant-max-generations`).
        """
        started = time.perf_counter()
        try:
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ValueError(f"step must be an integer >= 0, got {step!r}")
            no_quantize = quantize == "none"
            scheme = None if no_quantize else check_scheme(quantize)
            check_master_mode(master_weights)
            flat = flatten_state(state, rank=self.rank, rng=rng, for_save=True, validate=False)
            structure = self._save_structures.for_state(flat, self.layout, self.coords)  # validates the state
        except (ValueError, TypeError):  # LayoutError, QuantError included
            # What the caller passed can never be saved: raised now, whatever on_error says, with
            # the message that says how to fix it (issue 20, finding 8).
            self.failed_saves += 1
            raise
        except Exception as exc:
            return self._failed_save(step, exc, started)
        try:
            previous = self._gpu.settle()  # the previous snapshot must be committed before the next begins
            if previous is not None:
                log.warning("the previous checkpoint was not handed over: %s", previous)
            if self.mode_in_use != "copy":
                self._gpu.install_hooks(state)
            options = _SaveOptions(scheme, no_quantize, master_weights or "")
            return self._save(step, state, flat, structure, metric, started, options)
        except InvalidState:  # the daemon refused the state's metadata: a caller error as well
            self.failed_saves += 1
            raise
        except Exception as exc:
            return self._failed_save(step, exc, started)

    def _save(
        self,
        step: int,
        state: Mapping[str, Any],
        flat: FlatState,
        structure: Structure,
        metric: float | None,
        started: float,
        options: "_SaveOptions",
    ) -> SaveHandle:
        if self.layout is not None and not self._rules_reported:
            self._rules_reported = True  # after the first save every rule has had its chance
            for rule in self.layout.unused():
                log.warning("layout rule %r matched no tensor: check its pattern", rule.pattern)
        fingerprint = structure.fingerprint
        placed = self._placed if self._placed is not None and self._placed.structure.signature is structure.signature else None
        request = pb.BeginSaveRequest(
            who=self._who,
            step=step,
            fingerprint=fingerprint,
            timeout_s=self.timeout_s,
            metric=metric or 0.0,
            has_metric=metric is not None,
            quantize=options.quantize or "",
            no_quantize=options.no_quantize,
            master_weights=options.master_weights,
            lineage_generation=self._lineage,
            known_layout=placed.layout_id if placed is not None else "",
        )
        if fingerprint not in self._known_fingerprints:
            request.tensors.extend(_metas(structure))
        try:
            try:
                reply = self._call(self._stub.BeginSave, request)
            except CheckpointError as exc:
                if exc.code != "FAILED_PRECONDITION" or "unknown fingerprint" not in str(exc):
                    raise
                request.tensors.extend(_metas(structure))  # the daemon restarted: describe again
                reply = self._call(self._stub.BeginSave, request)
        except CheckpointError as exc:
            if _refused_state(exc):
                raise InvalidState(str(exc), exc.code) from None
            raise
        self._known_fingerprints.add(fingerprint)
        if reply.skipped:
            log.warning("checkpoint of step %s skipped: %s", step, reply.skip_reason)
            return SaveHandle(self, step, time.perf_counter() - started, skipped=True, error=reply.skip_reason)
        try:
            placed = self._placed_for(structure, placed, reply)
            if placed.device:
                return self._save_device(step, state, flat, reply, placed, started)
            if placed.placements:
                self._copy_host(placed, reply.arena_path, reply.arena_size)
            extras = json.dumps(flat.extras, allow_nan=False)
        except BaseException as exc:
            self._abort(reply.save_id, f"{type(exc).__name__}: {exc}")
            raise
        # The snapshot is complete in the arena: the trainer goes on while a helper thread tells
        # the daemon (as in mode "overlap"). The next save, load or close waits for that commit
        # first; a failed one shows on the handle and is logged.
        commit = self._commit_request(reply.save_id, extras, state, time.perf_counter() - started)
        pending = self._gpu.start_commit(step, [], lambda: self._call(self._stub.CommitSnapshot, commit), lambda reason: self._abort(reply.save_id, reason))
        pending.future.add_done_callback(lambda done: self._late_failure(step, done))
        return SaveHandle(self, step, time.perf_counter() - started, bytes_copied=placed.nbytes, pending=pending)

    def _placed_for(self, structure: Structure, known: Placed | None, reply: pb.BeginSaveResponse) -> Placed:
        """The placement of this save: the known one when the daemon left the slots out (same
        layout), taken over to the structure's current views; else bound anew from the slots."""
        if known is not None and reply.layout_id == known.layout_id and not reply.slots:
            placed = known if known.structure is structure else known.rebound(structure)
        else:
            placed = place(structure, reply.slots, reply.layout_id, self._gpu.owns)
        self._placed = placed
        return placed

    def _copy_host(self, placed: Placed, arena_path: str, arena_size: int) -> None:
        """Copy the placement's CPU tensors into the arena with a copy plan made once per
        (placement layout, arena mapping) (ckptd.client.arena_copy)."""
        arena = self._maps.get(arena_path, arena_size)
        cached = self._copy_plans.get(arena_path)
        if cached is None or cached[1] is not arena or cached[0].layout_id != placed.layout_id or cached[0].structure.signature is not placed.structure.signature:
            plan = CopyPlan(arena, placed.host_sources, [placed.placements[i][1] for i in placed.host], self._copy_workers)
            self._copy_plans.pop(arena_path, None)
            self._copy_plans[arena_path] = cached = (placed, arena, plan)
            while len(self._copy_plans) > 4:  # arenas of earlier layouts or a restarted daemon
                del self._copy_plans[next(iter(self._copy_plans))]
        cached[2].run(self._pool, placed.host_sources, cold=self._maps.is_cold(arena_path))
        self._maps.mark_warm(arena_path)

    def _commit_request(self, save_id: str, extras: str, state: Mapping[str, Any], stall_s: float) -> pb.CommitSnapshotRequest:
        """stall_s: how long save() has blocked training so far (for the daemon's stall metric)."""
        commit = pb.CommitSnapshotRequest(who=self._who, save_id=save_id, extras_json=extras, stall_s=stall_s)
        if self.rank == 0:
            commit.model_files.update(_model_files(state))
        return commit

    def _save_device(
        self, step: int, state: Mapping[str, Any], flat: FlatState, reply: pb.BeginSaveResponse, placed: Placed, started: float
    ) -> SaveHandle:
        """Hand over a state with CUDA tensors in the mode in use (ckptd.client.handoff).

        Tensors that a forward pass may change are copied first and fenced at once; the rest
        (parameters, optimizer state) are fenced before the next optimizer step. CPU tensors are
        copied meanwhile by the CPU path. Mode "copy" waits for the copies and commits; the
        others return at once and commit from a helper thread when the copies are done.
        """
        gpu = self._gpu
        backend = gpu.backend
        placements = placed.for_device
        device_idx = set(placed.device)
        if gpu.mode.in_use != "copy":
            lazy = placed.cache.get("lazy")
            if lazy is None:  # which tensors only an optimizer step changes: fixed for a placement
                lazy = placed.cache["lazy"] = lazy_placements(state, placed.kinds, [t for t, _, _ in placed.placements]) & device_idx
        else:
            lazy = set()
        eager = device_idx - lazy
        staging = self._staging_for(placements, device_idx, reply.arena_size) if gpu.mode.in_use == "ipc" else None
        dst = staging.tensor if staging is not None else backend.host_view(reply.arena_path, reply.arena_size)
        copies = []
        queued = time.perf_counter()
        try:
            for group in (eager, lazy):
                if group:
                    copies.append(backend.copy(placements, dst, group))
            if gpu.mode.in_use != "copy" and eager:
                copies[0].fence()  # forward passes may change these: the compute stream waits for their copy now
            if placed.host:
                self._copy_host(placed, reply.arena_path, reply.arena_size)
            commit = self._commit_request(reply.save_id, json.dumps(flat.extras, allow_nan=False), state, time.perf_counter() - started)
        except BaseException:
            for copy in copies:  # the arena goes back to the daemon: nothing may still write into it
                copy.wait()
            raise
        nbytes = placed.nbytes
        if staging is not None:
            staged = placed.cache.get("staged")
            if staged is None:  # the device ranges the daemon copies out of the staging buffer: fixed for a placement
                items = [item_of(t, off, n, "staged" if i in device_idx else None) for i, (t, off, n) in enumerate(placements)]
                staged = placed.cache["staged"] = [pb.StagedRange(staging_offset=o, arena_offset=o, nbytes=n) for o, n in coalesced_ranges(items)]
            commit.staging_id = staging.staging_id
            commit.staged.extend(staged)
        if gpu.mode.in_use == "copy":
            for copy in copies:
                copy.wait()
            copy_s = time.perf_counter() - queued
            self._call(self._stub.CommitSnapshot, commit)
            return SaveHandle(self, step, time.perf_counter() - started, bytes_copied=nbytes, mode="copy", copy_s=copy_s)
        mode = gpu.mode.in_use

        def send() -> None:
            try:
                self._call(self._stub.CommitSnapshot, commit)
            except CheckpointError as exc:
                if staging is not None:
                    gpu.fall_back(f"the daemon could not copy the staging buffer: {exc}")
                raise

        pending = gpu.start_commit(step, copies, send, lambda reason: self._abort(reply.save_id, reason))
        pending.future.add_done_callback(lambda done: self._late_failure(step, done))
        return SaveHandle(self, step, time.perf_counter() - started, bytes_copied=nbytes, pending=pending, mode=mode)

    def _late_failure(self, step: int, done: Any) -> None:
        """A snapshot that failed after save() returned (copy or commit): logged and counted at once."""
        exc = done.exception()
        if exc is not None:
            self.failed_saves += 1
            log.warning("checkpoint of step %s failed after save() returned, training goes on: %s", step, exc)

    def _staging_for(self, placements: list[tuple[torch.Tensor, int, int]], device_idx: set[int], arena_size: int) -> Any:
        """The rank's device staging buffer, opened by the daemon (at least `arena_size` bytes:
        it mirrors the arena's layout); None after falling back to "overlap" (reason logged)."""
        from ckptd.client.ipc import IpcUnavailable

        gpu = self._gpu
        devices = {placements[i][0].device for i in device_idx}
        if len(devices) != 1:
            gpu.fall_back(f"this rank's CUDA tensors are on {len(devices)} devices; one staging buffer serves one")
            return None
        if gpu.staging is not None and gpu.staging.nbytes >= arena_size and gpu.staging.device in devices:
            return gpu.staging
        if gpu.staging is not None:  # the plan grew: a larger buffer
            self._close_staging(gpu.staging)
            gpu.staging.free()
            gpu.staging = None
        try:
            staging = gpu.backend.staging(next(iter(devices)), arena_size)
        except IpcUnavailable as exc:
            gpu.fall_back(str(exc))
            return None
        request = pb.OpenStagingRequest(who=self._who, gpu_uuid=staging.uuid, ipc_handle=staging.handle, nbytes=staging.nbytes, pid=os.getpid())
        try:
            answer = self._call(self._stub.OpenStaging, request)
        except CheckpointError as exc:
            answer = pb.OpenStagingResponse(reason=f"the daemon refused the staging buffer: {exc}")
        if not answer.staging_id:
            staging.free()
            gpu.fall_back(answer.reason or "the daemon could not open the staging buffer")
            return None
        staging.staging_id = answer.staging_id
        gpu.staging = staging
        return staging

    def _close_staging(self, staging: Any) -> None:
        if staging.staging_id:
            try:
                self._stub.CloseStaging(pb.CloseStagingRequest(who=self._who, staging_id=staging.staging_id), timeout=30)
            except grpc.RpcError as exc:
                log.warning("could not close the staging buffer in the daemon: %s", exc.details())

    def _abort(self, save_id: str, reason: str) -> None:
        try:
            self._stub.AbortSave(pb.AbortSaveRequest(who=self._who, save_id=save_id, reason=reason), timeout=10)
        except grpc.RpcError as exc:
            log.warning("could not abort save %s: %s", save_id, exc.details())

    def _failed_save(self, step: int, exc: Exception, started: float) -> SaveHandle:
        self.failed_saves += 1
        if self.on_error == "raise":
            raise exc
        log.warning("checkpoint of step %s failed, training goes on: %s", step, exc)
        return SaveHandle(self, step, time.perf_counter() - started, error=str(exc))

    def _wait_durable(self, step: int, timeout: float | None) -> DurableInfo:
        request = pb.WaitDurableRequest(job=self.job, step=step, timeout_s=timeout or 0.0)
        last = None
        try:
            for last in self._stub.WaitDurable(request, timeout=None if timeout is None else timeout + 30):
                if last.done:
                    break
        except grpc.RpcError as exc:
            raise _translate(exc, self.address) from None
        if last is None or last.state != "committed":
            reason = last.error if last is not None else "no answer"
            raise CheckpointError(f"step {step} was not committed: {reason}", "ABORTED")
        return DurableInfo(step=step, step_dir=last.step_dir, bytes_written=last.bytes_written)

    # ------------------------------------------------------------ load

    def load(self, state: Mapping[str, Any], *, step: int | None = None, strict: bool = True, rng: bool = False) -> int | None:
        """Restore `state` in place from `step` (None: the newest committed); returns the step.

        Returns None when step is None and the job has no checkpoint yet. Raises CheckpointError
        (CheckpointNotFound for a missing step) with the tensors named when strict checks fail.
        """
        flat = flatten_state(state, rank=self.rank, rng=rng, validate=False)
        previous = self._gpu.settle()  # a snapshot still being handed over would be abandoned by the load
        if previous is not None:
            log.warning("the previous checkpoint was not handed over: %s", previous)
        structure = self._load_structures.for_state(flat, self.layout, self.coords)
        request = pb.PlanLoadRequest(
            who=self._who,
            step=step or 0,
            latest=step is None,
            kinds=sorted({e.name.split("/", 1)[0] for e in flat.tensors} | set(flat.extras)),
            strict=strict,
            direct_read=self.read_files is not False,
            decodes=True,
            decodes_frames=True,
            fingerprint=structure.fingerprint if structure.fragments else "",
            known_plans=list(structure.cache.get("load_plans", ())),
        )
        try:
            plan = self._plan_load(request, structure)
            if self.read_files is None and (unreadable := _unreadable_file(plan)) is not None:
                log.info("cannot read %s here: the daemon copies the checkpoint's bytes into shared memory instead", unreadable)
                self._load_done(plan.load_id)
                request.direct_read = False
                plan = self._plan_load(request, structure)
        except CheckpointNotFound:
            if step is None:
                return None
            raise
        self._lineage = plan.generation
        try:
            self._fill(structure, plan)
            extras = json.loads(plan.extras_json) if plan.extras_json else {}
            restore_state(state, flat, extras)
        finally:
            self._load_done(plan.load_id)
        for name in plan.missing:
            log.warning("not in step %s, left as it was: %s", plan.step, name)
        return plan.step

    def _plan_load(self, request: pb.PlanLoadRequest, structure: Structure) -> pb.PlanLoadResponse:
        """PlanLoad with only the fingerprint when the daemon has this structure's metadata
        from an earlier load; with the metadata when it has not (or forgot it: restarted)."""
        if not request.fingerprint:
            return self._call(self._stub.PlanLoad, request)
        if request.fingerprint in self._known_load_fingerprints:
            try:
                return self._call(self._stub.PlanLoad, request)
            except CheckpointError as exc:
                if exc.code != "FAILED_PRECONDITION" or "unknown fingerprint" not in str(exc):
                    raise
        full = pb.PlanLoadRequest()
        full.CopyFrom(request)
        full.tensors.extend(_metas(structure))
        plan = self._call(self._stub.PlanLoad, full)
        self._known_load_fingerprints.add(structure.fingerprint)
        return plan

    def _load_done(self, load_id: str) -> None:
        try:
            self._stub.LoadDone(pb.LoadDoneRequest(who=self._who, load_id=load_id), timeout=10)
        except grpc.RpcError as exc:
            log.warning("LoadDone failed (the daemon releases the step later by itself): %s", exc.details())

    def _fill(self, structure: Structure, plan: pb.PlanLoadResponse) -> None:
        """Fill the structure's tensors from the plan's pieces. A plan from the daemon's memory
        has an id; when the daemon left its pieces out (the rank had them: known_plan), the
        fills made from the earlier answer are used again."""
        known: dict[str, tuple[list[Fill], MemoryCopies | None]] = structure.cache.setdefault("load_plans", {})  # plan id -> ..., newest last
        reused = known.get(plan.plan_id) if plan.plan_id and not plan.pieces else None
        if reused is not None:
            fills, moves = reused
        else:
            sources: dict[str, list[Source]] = {}
            for source in _sources(plan):
                sources.setdefault(source.name, []).append(source)
            fills = [Fill(f.local, f.box, sources[f.name]) for _, f in structure.fragments if f.name in sources]
            on_device = any(self._gpu.owns(fill.target) for fill in fills)  # they go through pinned host memory
            moves = MemoryCopies.prepare(self._maps, fills) if plan.plan_id and not on_device else None
        if plan.plan_id:
            known.pop(plan.plan_id, None)
            known[plan.plan_id] = (fills, moves)
            while len(known) > 4:  # the daemon alternates between its arena sets
                del known[next(iter(known))]
        if moves is not None and moves.run(self._pool, self._maps):
            return
        to_device: list[tuple[torch.Tensor, torch.Tensor]] = []
        if any(self._gpu.owns(fill.target) for fill in fills):
            fills, to_device = self._device_fills(fills)
        with torch.no_grad():
            fill_all(self._pool, self._maps, fills)
            if to_device:
                self._gpu.backend.to_devices(to_device)

    def _device_fills(self, fills: list[Fill]) -> tuple[list[Fill], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Restore onto GPUs: a fragment that is whole in the daemon's memory goes host-to-device
        straight from the pinned arena; anything else is assembled in a pinned host tensor first
        (read, resharded, converted by the CPU path), which then goes over."""
        backend = self._gpu.backend
        host_fills: list[Fill] = []
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for fill in fills:
            target = fill.target
            if not self._gpu.owns(target):
                host_fills.append(fill)
                continue
            whole = [s for s in fill.sources if s.box == fill.want]
            if (len(fill.sources) == 1 and whole and whole[0].kind == "shm"
                    and whole[0].dtype == dtypes.from_torch_name(str(target.dtype)) and target.numel()):
                src = whole[0]
                arena = backend.host_view(src.path, src.offset + src.nbytes)
                pairs.append((arena[src.offset : src.offset + src.nbytes].view(target.dtype).view(target.shape), target))
                continue
            host = backend.pinned_empty(target.shape, target.dtype)
            host_fills.append(Fill(host, fill.want, fill.sources))
            pairs.append((host, target))
        return host_fills, pairs

    # ------------------------------------------------------------ queries

    def list(self) -> list[CheckpointInfo]:
        """The job's committed checkpoints, oldest first."""
        reply = self._call(self._stub.List, pb.ListRequest(job=self.job))
        return [
            CheckpointInfo(c.step, c.created_at, c.size_bytes, c.file_count, c.path, c.in_memory, c.metric if c.has_metric else None)
            for c in reply.checkpoints
        ]

    def latest(self) -> int | None:
        """The newest committed step of the job, or None."""
        infos = self.list()
        return infos[-1].step if infos else None

    def status(self) -> pb.StatusResponse:
        return self._call(self._stub.Status, pb.StatusRequest(job=self.job))

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout_s + 30)
        except grpc.RpcError as exc:
            raise _translate(exc, self.address) from None

    def close(self) -> None:
        """Wait for a snapshot still being handed over, release the GPU resources and the arenas."""
        self._gpu.close(self._close_staging)
        self._pool.shutdown(wait=True)
        self._maps.close()
        self._channel.close()

    def __enter__(self) -> "CheckpointClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _translate(exc: grpc.RpcError, address: str) -> CheckpointError:
    code = exc.code()
    details = exc.details() or str(code)
    if code == grpc.StatusCode.UNAVAILABLE:
        return DaemonUnavailable(
            f"no ckptd answers at {address} ({details}); start it with `ckptd serve` or set CKPTD_ADDRESS", code.name
        )
    if code == grpc.StatusCode.NOT_FOUND:
        return CheckpointNotFound(details, code.name)
    return CheckpointError(details, code.name)



def _refused_state(exc: CheckpointError) -> bool:
    """Whether the daemon's answer to BeginSave refuses what the caller passed (bad tensor names,
    shapes that do not tile, options or node sizes the ranks disagree on): INVALID_ARGUMENT,
    except a job whose world size changed while an earlier save is still in flight (an elastic
    restart; it passes once that save ends)."""
    return exc.code == "INVALID_ARGUMENT" and "has a save in flight with world size" not in str(exc)


def _unreadable_file(plan: pb.PlanLoadResponse) -> str | None:
    """A committed file of the plan that this process cannot open for reading (e.g. a trainer
    container without the storage volume), or None."""
    for path in sorted({p.path for p in plan.pieces if p.source == "file"}):
        if not os.access(path, os.R_OK):
            return path
    return None


def _sources(plan: pb.PlanLoadResponse) -> Iterator[Source]:
    for p in plan.pieces:
        yield _source(p)


def _source(p: pb.Piece) -> Source:
    decoding = None
    if p.HasField("decode"):
        d = p.decode
        decoding = Decoding(
            d.codec, d.block, _source(d.scales) if d.HasField("scales") else None, _source(d.base) if d.HasField("base") else None,
            Frames(d.frame_rows, tuple(d.frame_ends)) if d.frame_rows else None,
        )
    return Source(
        p.name, p.source, p.path, p.offset, p.nbytes, _box_of(p.fragment), p.dtype, p.checksum, p.chunk_bytes, p.chunk_xxh3, decoding
    )


@dataclass(frozen=True)
class _SaveOptions:
    """A save's compression options as the client sends them."""

    quantize: str | None  # "O1" | "O2" | None
    no_quantize: bool  # quantize="none": lossless whatever the daemon's default
    master_weights: str  # "" (the daemon's default) | keep | drop | residual
