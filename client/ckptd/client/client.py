"""CheckpointClient: what a training rank uses to save to and load from its node's daemon.

`save` and `load` are collective: every rank of the job calls them for the same step. This
module checks the caller's arguments and runs the flow of a save and of a load; the calls to
the daemon are ckptd.client._rpc, the hand-off of a save's tensors ckptd.client._handoff, and
filling a load's targets ckptd.client.reader.fill.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, Mapping

from ckptd.client.arena_warm import ArenaWarmup
from ckptd.client.arenas import ArenaMaps
from ckptd.client._handoff.base import DeviceBackend, Fenced, Started
from ckptd.client._handoff.cuda import CudaBackend
from ckptd.client._handoff.modes import AUTO
from ckptd.client._handoff.select import Handoff
from ckptd.client.reader.plan_fill import fill_plan
from ckptd.client._rpc import CheckpointInfo, DaemonRpc, DurableInfo, LoadPlan, PlanAhead, SaveGrant, SaveOptions, StatusResponse, load_fingerprint
from ckptd.client.environment import meshes_of, trainer_environment
from ckptd.client.errors import CheckpointError, CheckpointNotFound, InvalidState
from ckptd.client.handle import SaveHandle
from ckptd.client.layout import LayoutRules, RankCoords
from ckptd.client.options import ClientOptions
from ckptd.client.ranks import env_int, rank_and_world
from ckptd.client.run_id import RunIdentity
from ckptd.client.slots import Placed, SlotMismatch, place
from ckptd.client.load_checks import checked_plan, daemon_strict, warn_missing
from ckptd.client.restore import restore_state
from ckptd.client.state import FlatState
from ckptd.client.walk import StateWalk
from ckptd.client.structure import Structure, StructureCache
from ckptd.common.names import check_job_id, check_step
from ckptd.common.paths import daemon_address, default_address
from ckptd.common.quant_options import check_master_mode, check_scheme
from ckptd.common.retention import JobRetention, check_metric

__all__ = ["CheckpointClient", "CheckpointInfo"]

log = logging.getLogger("ckptd.client")
THREAD_PREFIX = "ckptd-"  # what the names of a client's threads begin with (its copy pool, ckptd-warm, ckptd-commit)


def _model_files(state: Mapping[str, Any]) -> dict[str, str]:
    """config.json (and generation_config.json) of a Hugging Face model, so the step directory
    loads with `from_pretrained` as it is. A model object may name its own instead: a method
    `ckptd_model_files() -> {file name: JSON text}` (e.g. adapter_config.json of a PEFT adapter,
    ckptd.integrations.peft); the daemon accepts the names in its format's MODEL_FILES."""
    model = state.get("model")
    own = getattr(model, "ckptd_model_files", None)
    if callable(own):
        files = own()
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise TypeError(f"{type(model).__name__}.ckptd_model_files() must return a dict of file name -> JSON text, got {files!r:.200}")
        return files
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return {}
    files = {"config.json": config.to_json_string()}
    generation = getattr(model, "generation_config", None)
    if generation is not None and callable(getattr(generation, "to_json_string", None)):
        files["generation_config.json"] = generation.to_json_string()
    return files


class CheckpointClient:
    """A training rank's connection to its node's ckptd.

    job: the training run's id. Every other keyword is a setting, a field of ClientOptions
    (ckptd.client.options), which says what each does: address, rank, world_size, mode, on_error,
    timeout_s, copy_threads, layout, coords, local_world_size, read_files, run_config, run_id,
    retention. Pass them as keywords or made up front as options=ClientOptions(...), not both;
    either way they are checked here, with a message that says how to fix them.
    """

    _device_backend: DeviceBackend | None = None  # a stand-in for CUDA: tests set it on a subclass (tests/integration/fake_device.py)

    def __init__(
        self,
        job: str,
        *,
        address: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        mode: str = AUTO,
        on_error: str = "warn",
        timeout_s: float = 600.0,
        copy_threads: int | None = None,
        layout: LayoutRules | None = None,
        coords: RankCoords | None = None,
        local_world_size: int | None = None,
        read_files: bool | None = None,
        run_config: dict[str, Any] | None = None,
        run_id: str | None = None, retention: JobRetention | None = None,
        options: ClientOptions | None = None,
    ) -> None:
        self.job = check_job_id(job)
        given = ClientOptions(
            address=address, rank=rank, world_size=world_size, mode=mode, on_error=on_error, timeout_s=timeout_s, copy_threads=copy_threads,
            layout=layout, coords=coords, local_world_size=local_world_size, read_files=read_files, run_config=run_config, run_id=run_id,
            retention=retention,
        )
        if options is None:
            options = given
        elif given != ClientOptions():
            raise TypeError("pass CheckpointClient's settings either as keywords or as options=ClientOptions(...), not both")
        self.options = options
        self.rank, self.world_size = rank_and_world(options.rank, options.world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        local = options.local_world_size
        if local is None:
            local = env_int("LOCAL_WORLD_SIZE", 0)
        if not 0 <= local <= self.world_size:  # 0: not known (the daemon counts the ranks that come)
            raise ValueError(f"local_world_size={local} must be between 1 and world_size={self.world_size} (or 0 or None: not known)")
        self.local_world_size = local
        self.read_files = options.read_files
        self.run_config = options.run_config
        self._run = RunIdentity(self.rank, self.world_size, options.run_id)  # settled at the first save or load (run_id.py)
        self.address = daemon_address(options.address) if options.address else default_address()
        self.mode = options.mode
        self.on_error = options.on_error
        self.timeout_s = float(options.timeout_s)
        self.layout = options.layout
        self.coords = options.coords
        self._rules_reported = False
        self._rpc = DaemonRpc(self.address, self.job, self.rank, self.world_size, self.local_world_size, self.timeout_s, options.retention)
        threads = options.copy_threads
        self._pool = ThreadPoolExecutor(threads or min(4, os.cpu_count() or 1), thread_name_prefix=f"{THREAD_PREFIX}copy")
        self._maps = ArenaMaps()
        self._warmup = ArenaWarmup(self._rpc.stub, self._rpc.who, self._maps)  # a restarted trainer's first load copies through warm page tables
        # groups of a hand-off copy: one per core (the calling thread takes one), at most the pool's threads + 1
        copy_workers = max(1, min((threads or 4) + 1, os.cpu_count() or 1))
        self._load_threads = copy_workers  # the threads of a restore from the daemon's memory (MemoryCopies.run)
        # the hand-off of CUDA tensors by mode
        device = self._device_backend
        backend_factory = (lambda: device) if device is not None else CudaBackend
        owns = device.owns if device is not None else CudaBackend.owns
        self._handoff = Handoff(self.mode, backend_factory, owns, self._rpc, self._maps, self._pool, copy_workers)
        # close() at the latest when the client is collected or the interpreter exits: a call
        # left in flight (the last load's LoadDone) deadlocked grpc's channel in its teardown
        self._closer = weakref.finalize(self, _close, os.getpid(), self._warmup, self._handoff, self._pool, self._maps, self._rpc)
        # what stays the same from save to save (and load to load): see ckptd.client.walk.StateWalk and ckptd.client.structure
        self._walk = StateWalk()
        self._save_structures = StructureCache()
        self._load_structures = StructureCache()
        self._last_load: Structure | None = None  # the structure of the last load (_plan_ahead)
        self._placed: Placed | None = None
        self.failed_saves = 0
        self._lineage = 0  # quantization generation of the step this client loaded last (compounding guard)
        self._began_save = False  # a save of this client reached the daemon
        self._resumed_from: int | None = None  # the step loaded before the first save: this run resumed the job from it
        self._last_step: int | None = None  # the step of this client's last save the daemon took (preemption.py waits for it, not saving it twice)

    @property
    def run_id(self) -> str:
        """This run's id (ckptd.client.run_id). The first access may be collective (a broadcast
        through torch.distributed): make it on every rank, or let the first save or load do it."""
        return self._run.get()

    @property
    def resumed_from(self) -> int | None:
        """The step this client loaded before its first save (it resumed the job from it), else None."""
        return self._resumed_from

    def mark_resumed(self, step: int) -> None:
        """This run resumed the job from committed `step`, loaded another way (DCP's reader,
        ckptd.offline): its saves count as a resume's, as after load() (a rollback below the
        job's newer steps, taking the job over). Before this client's first save; later, no-op."""
        check_step(step)
        if not self._began_save:
            self._resumed_from = step

    def _in_run(self) -> None:
        """Before a call to the daemon: the run id settled and sent, this client attached, and
        the warm-up ended (its mapping of an arena could otherwise unmap one a copy of this save
        or load uses by address: ArenaMaps keeps at most MAX_MAPPINGS)."""
        self._warmup.stop()
        self._rpc.identify(self._run.get())
        self._rpc.attach()

    @property
    def mode_in_use(self) -> str:
        """How CUDA tensors are handed over now: "copy", "overlap" or "ipc" (CPU tensors always
        take the plain shared-memory copy)."""
        return self._handoff.mode.in_use

    @property
    def mode_reason(self) -> str | None:
        """Why `mode_in_use` is not the mode asked for (e.g. why "ipc" fell back), else None."""
        return self._handoff.mode.reason

    def fence(self, host: bool = False) -> Fenced:
        """Make later changes of the saved state wait for the last save's device copies.

        GPU-side by default: the current CUDA stream waits on the copy-done event, the host goes
        on. host=True blocks the host instead (for state changed outside the CUDA stream order).
        A no-op when no copy is in flight (always for CPU tensors). Optimizers of the saved
        state get it as a step pre-hook; call it (or `with ckpt.fence(): ...`) before any other
        change of saved tensors, e.g. an EMA update.
        """
        return self._handoff.commits.fence(host)

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
            check_step(step)
            metric = check_metric(metric)
            no_quantize = quantize == "none"
            scheme = None if no_quantize else check_scheme(quantize)
            check_master_mode(master_weights)
            flat = _with_tensors(self._walk.flatten(state, rank=self.rank, rng=rng, for_save=True))
            structure = self._save_structures.for_state(flat, self.layout, self.coords)  # validates the state
        except (ValueError, TypeError):  # LayoutError, QuantError included
            # What the caller passed can never be saved: raised now, whatever on_error says, with
            # the message that says how to fix it (issue 20, finding 8).
            self.failed_saves += 1
            raise
        except Exception as exc:
            return self._failed_save(step, exc, started)
        try:
            previous = self._handoff.before_save(state)  # the previous snapshot must be committed before the next begins
            if previous is not None:
                log.warning("the previous checkpoint was not handed over: %s", previous)
            options = SaveOptions(scheme, no_quantize, master_weights or "")
            return self._save(step, state, flat, structure, metric, started, options)
        except InvalidState:  # the daemon refused the state's metadata: a caller error as well
            self.failed_saves += 1
            raise
        except Exception as exc:
            return self._failed_save(step, exc, started)

    def _save(
        self, step: int, state: Mapping[str, Any], flat: FlatState, structure: Structure, metric: float | None, started: float, options: SaveOptions
    ) -> SaveHandle:
        if self.layout is not None and not self._rules_reported:
            self._rules_reported = True  # after the first save every rule has had its chance
            for rule in self.layout.unused():
                log.warning("layout rule %r matched no tensor: check its pattern", rule.pattern)
        placed = self._placed if self._placed is not None and self._placed.structure.signature is structure.signature else None
        self._in_run()
        grant = self._rpc.begin_save(
            structure, step, metric, options, self._lineage, placed.layout_id if placed is not None else "", self._resumed_from
        )
        self._began_save = True
        self._last_step = step
        if grant.committed:  # a resumed run redid this step: the daemon keeps the committed one
            log.warning("checkpoint of step %s: %s", step, grant.skip_reason)
            return SaveHandle(self._wait_durable, self.on_error, step, time.perf_counter() - started, kept=grant.skip_reason)
        if grant.skipped:
            log.warning("checkpoint of step %s skipped: %s", step, grant.skip_reason)
            return SaveHandle(self._wait_durable, self.on_error, step, time.perf_counter() - started, skipped=True, error=grant.skip_reason)
        try:
            placed = self._placed_for(structure, placed, grant)
            transport = self._handoff.transport_for(placed)
            # CPU tensors: in the arena when it returns. A rank of no bytes (empty shards: more
            # FSDP ranks than rows) has no arena to copy into, and nothing to copy.
            copies = transport.start(state, placed, grant) if placed.nbytes else Started((), transport.mode)
            try:
                commit = self._rpc.commit_request(grant.save_id, flat.extras_json, self._step_files(state, structure) if self.rank == 0 else {}, time.perf_counter() - started)
                if copies.staging_id:
                    self._rpc.add_staged(commit, copies.staging_id, copies.staged)
            except BaseException:
                copies.wait()  # the arena goes back to the daemon: nothing may still write into it
                raise
        except BaseException as exc:
            self._rpc.abort(grant.save_id, f"{type(exc).__name__}: {exc}")
            raise
        in_flight, copy_s = copies.copies, None
        if copies.waits:  # mode "copy": the copies are done when save() returns; the commit goes as for CPU tensors
            try:
                copies.wait()
            except BaseException as exc:
                self._rpc.abort(grant.save_id, f"the device copy failed: {type(exc).__name__}: {exc}")
                raise
            in_flight, copy_s = (), time.perf_counter() - copies.queued

        # The trainer goes on while a helper thread tells the daemon, once the copies (if any)
        # are done. The next save, load or close waits for that commit first; a failed one
        # shows on the handle and is logged. What the hand-off keeps of this commit must not
        # hold the client: a client dropped without close() is closed when collected.
        rpc, client = self._rpc, weakref.ref(self)

        def send() -> None:
            try:
                rpc.commit(commit)
            except CheckpointError as exc:
                transport.on_commit_error(exc)
                raise

        pending = self._handoff.commits.start_commit(step, in_flight, send, lambda reason: rpc.abort(grant.save_id, reason))
        pending.future.add_done_callback(lambda done: _late_failure(client, step, done))
        return SaveHandle(
            self._wait_durable, self.on_error, step, time.perf_counter() - started, bytes_copied=placed.nbytes, pending=pending, mode=copies.mode,
            copy_s=copy_s,
        )

    def _step_files(self, state: Mapping[str, Any], structure: Structure) -> dict[str, str]:
        """Rank 0's small files of a step: the model's (config.json ...) and environment.json."""
        files = _model_files(state)
        environment = structure.cache.get("environment")
        if environment is None:
            meshes = meshes_of(entry.tensor for entry, _ in structure.fragments)
            tp_size = self.coords.tp_size if self.coords is not None and self.layout is not None else None
            environment = structure.cache["environment"] = trainer_environment(self.run_config, meshes, tp_size)
        files["environment.json"] = environment
        return files

    def _placed_for(self, structure: Structure, known: Placed | None, grant: SaveGrant) -> Placed:
        """The placement of this save: the known one when the daemon left the slots out (same
        layout), taken over to the structure's current views; else bound anew from the slots."""
        if known is not None and grant.layout_id == known.layout_id and not grant.slots:
            placed = known if known.structure is structure else known.rebound(structure)
        else:
            try:
                placed = place(structure, grant.slots, grant.layout_id, self._handoff.owns)
            except SlotMismatch:
                # the daemon planned from other metadata than this structure's: the next save
                # describes the structure again instead of naming it by its fingerprint
                self._rpc.forget_fingerprint(structure.fingerprint)
                raise
        self._placed = placed
        return placed

    def _failed_save(self, step: int, exc: Exception, started: float) -> SaveHandle:
        self.failed_saves += 1
        if self.on_error == "raise":
            raise exc
        log.warning("checkpoint of step %s failed, training goes on: %s", step, exc)
        return SaveHandle(self._wait_durable, self.on_error, step, time.perf_counter() - started, error=str(exc))

    def _wait_durable(self, step: int, timeout: float | None) -> DurableInfo:
        return self._rpc.wait_durable(step, timeout)

    # ------------------------------------------------------------ load

    def load(
        self, state: Mapping[str, Any], *, step: int | None = None, strict: bool | Literal["missing"] = True, rng: bool = False
    ) -> int | None:
        """Restore `state` in place from `step` (None: the newest committed); returns the step.

        Returns None when step is None and the job has no checkpoint yet. Raises CheckpointError
        (CheckpointNotFound for a missing step) with the tensors named when strict checks fail.
        strict: True, every tensor of the state is in the step and every tensor of the step (of
        the state's kinds) is in the state; "missing", only the first: for a rank that holds part
        of the model (a pipeline stage, its experts), whose step holds the other ranks' tensors
        too; False, neither (what is missing is logged and left as it is).
        """
        if not isinstance(strict, bool) and strict != "missing":
            raise ValueError(f"strict={strict!r}: pass True, False or 'missing'")
        if step is not None:
            check_step(step)
        flat = self._walk.flatten(state, rank=self.rank, rng=rng)
        previous = self._handoff.commits.settle()  # a snapshot still being handed over would be abandoned by the load
        if previous is not None:
            log.warning("the previous checkpoint was not handed over: %s", previous)
        ahead = self._plan_ahead(flat, step, strict)
        try:
            structure = self._load_structures.for_state(flat, self.layout, self.coords)
        except BaseException:
            self._rpc.drop_ahead(ahead)
            raise
        self._last_load = structure
        kinds, known_plans = _load_request_of(structure, flat)
        asked = time.perf_counter()
        try:
            self._in_run()
            plan = self._rpc.plan_load(structure, step, kinds, daemon_strict(strict, flat), self.read_files is not False, known_plans, ahead)
            if self.read_files is None and (unreadable := _unreadable_file(plan)) is not None:
                log.info("cannot read %s here: the daemon copies the checkpoint's bytes into shared memory instead", unreadable)
                self._rpc.load_done(plan.load_id)
                plan = self._rpc.plan_load(structure, step, kinds, daemon_strict(strict, flat), False, known_plans)
            extras, unstepped = checked_plan(plan, state, flat, strict, self._rpc.load_done)
        except CheckpointNotFound:
            flat.unfresh(state)  # nothing loaded: a fresh optimizer stays as fresh as it was
            if step is None:
                return None
            raise
        except BaseException:
            flat.unfresh(state)
            raise
        self._lineage = plan.generation
        planned = time.perf_counter()
        try:
            fill_plan(plan, structure, self._maps, self._pool, self._load_threads, self._handoff)
            restore_state(state, flat, extras, strict=strict, never_stepped=unstepped)
            plan_s, fill_s = planned - asked, time.perf_counter() - planned  # tests/bench/bench_recovery.py reads them
            log.debug("step %s loaded: planned in %.3f s, filled in %.3f s", plan.step, plan_s, fill_s, extra={"plan_s": plan_s, "fill_s": fill_s})
        finally:
            self._rpc.load_done(plan.load_id)
        warn_missing(plan, unstepped)
        if not self._began_save:
            self._resumed_from = plan.step  # a resume: the daemon lets this run take the job over (docs/usage.md)
        return plan.step

    def _plan_ahead(self, flat: FlatState, step: int | None, strict: bool | Literal["missing"]) -> PlanAhead | None:
        """PlanLoad sent before this load's structure is checked (about 5 ms at 4,000 tensors; a
        first build from scratch, 13 ms), which then overlaps the daemon's answer: named by the
        structure of this client's last load from memory, or, for this client's first load, by
        the fingerprint the structure will have (StructureCache.fingerprint_first). `plan_load`
        takes it only if its request is the one made once the structure is known, else releases it."""
        last = self._last_load
        if last is not None and last.cache.get("load_plans"):
            fingerprint = load_fingerprint(last)
            kinds, known_plans = _load_request_of(last, flat)
        elif last is None and (first := self._load_structures.fingerprint_first(flat, self.layout, self.coords)) is not None:
            fingerprint, kinds, known_plans = first, _kinds_of(flat), []
        else:
            return None
        self._in_run()
        return self._rpc.plan_load_ahead(fingerprint, step, kinds, daemon_strict(strict, flat), self.read_files is not False, known_plans)

    # ------------------------------------------------------------ queries

    def list(self) -> list[CheckpointInfo]:
        """The job's committed checkpoints, oldest first."""
        return self._rpc.list()

    def latest(self) -> int | None:
        """The newest committed step of the job, or None."""
        infos = self.list()
        return infos[-1].step if infos else None

    def status(self) -> StatusResponse:
        """The daemon's status of this job, as its StatusResponse message."""
        return self._rpc.status()

    def close(self) -> None:
        """Wait for a snapshot still being handed over, release the GPU resources and the arenas.
        Done also when the client is collected, or at exit, if not called; a second call does
        nothing, and so does a call in a process forked from the one that made the client."""
        self._closer()

    def __enter__(self) -> "CheckpointClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _late_failure(client: "weakref.ref[CheckpointClient]", step: int, done: Any) -> None:
    """A snapshot that failed after save() returned (copy or commit): logged, and counted by
    the client if it still lives."""
    exc = done.exception()
    if exc is not None:
        log.warning("checkpoint of step %s failed after save() returned, training goes on: %s", step, exc)
        alive = client()
        if alive is not None:
            alive.failed_saves += 1


def _close(pid: int, warmup: ArenaWarmup, handoff: Handoff, pool: ThreadPoolExecutor, maps: ArenaMaps, rpc: DaemonRpc) -> None:
    """CheckpointClient.close's work, on the client's parts (a finalizer must not hold the client).
    Not in a process forked from the one that made the client: its daemon connection, threads
    and arenas are the parent's. On one of the client's own threads (its last reference went
    there), on a thread of its own: a pool cannot join the thread it runs on. Every part is
    closed even when one fails; the first failure is raised."""
    if os.getpid() != pid:
        return
    if threading.current_thread().name.startswith(THREAD_PREFIX):
        threading.Thread(target=_close, args=(pid, warmup, handoff, pool, maps, rpc), name="closing a ckptd client", daemon=True).start()
        return
    failures = []
    for close in (warmup.stop, handoff.close, lambda: pool.shutdown(wait=True), maps.close, rpc.close):
        try:
            close()
        except Exception as exc:  # the next parts are closed all the same
            failures.append(exc)
    if failures:
        raise failures[0]


def _load_request_of(structure: Structure, flat: FlatState) -> tuple[list[str], list[str]]:
    """The kinds (top-level keys) and known plan ids a load of `flat` with `structure` sends."""
    tensor_kinds = structure.cache.get("kinds")  # the same names while the structure is the same
    if tensor_kinds is None:
        tensor_kinds = structure.cache["kinds"] = flat.tensor_kinds
    return _kinds_of(flat, tensor_kinds), list(structure.cache.get("load_plans", ()))


def _kinds_of(flat: FlatState, tensor_kinds: frozenset[str] | None = None) -> list[str]:
    """The kinds (top-level keys) a load of `flat` sends: its tensors' (`tensor_kinds` when
    known) and its extras'."""
    return sorted((flat.tensor_kinds if tensor_kinds is None else tensor_kinds) | set(flat.extras))


def _with_tensors(flat: FlatState) -> FlatState:
    """`flat`, which a save hands over, once it holds a tensor: the daemon plans, writes and
    commits tensors, and the values beside them ride along (ValueError otherwise)."""
    if not flat.tensors:
        raise ValueError("state holds no tensor: a ckptd checkpoint holds tensors (a model, an optimizer) and the values beside them; add them to the state")
    return flat


def _unreadable_file(plan: LoadPlan) -> str | None:
    """A committed file of the plan that this process cannot open for reading (e.g. a trainer
    container without the storage volume), or None."""
    for path in sorted({p.path for p in plan.pieces if p.kind == "file"}):
        if not os.access(path, os.R_OK):
            return path
    return None
