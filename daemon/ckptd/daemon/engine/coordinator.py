"""The coordinator's side of a save (wire-free: the peer client of rpc/peer_client.py carries
other nodes' calls to it).

Every save meets and commits at a coordinator: node 0's with several nodes (over the peer
port for the others), an in-process one with a single node (`SingleNode`): one protocol.

A save across nodes (docs/architecture.md §12):
1. Each node's daemon gathers its local ranks (BeginSave), then joins the save at the
   coordinator (node 0) with the digests of its ranks' tensor metadata (plan.spec_digest,
   derived by the daemon; node 0 checks each against the metadata it comes with), and that
   metadata the first time.
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
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable

from ckptd.daemon.engine.admission import Admission
from ckptd.daemon.engine.peers import NoPeers, PeerProbe
from ckptd.daemon.engine.plan_inputs import JobPlans, plan_key
from ckptd.daemon.engine.requests import JoinSave, ReportManifest
from ckptd.daemon.engine.runs import NO_CLAIM, RunClaim, Runs, short
from ckptd.daemon.errors import Aborted, InvalidRequest, Precondition, RunRefused, listed
from ckptd.format.index import ADAPTER_WEIGHTS, CheckpointIndex, FileRecord
from ckptd.daemon.plan.compression import NO_OPTIONS, Compression, Decide, SaveOptions, lossless_by_default
from ckptd.daemon.plan.files import IncompleteStep, NodeManifest, adapter_source, step_files
from ckptd.daemon.plan.retention import DEFAULT_JOB_POLICY, JobPolicy, policy_record
from ckptd.daemon.plan.save_plan import PlanError, SavePlan, TensorSpec, make_save_plan
from ckptd.daemon.records import JoinResult, Outcome
from ckptd.daemon.storage import StorageBackend
from ckptd.daemon.storage.step_commit import StepCommit

log = logging.getLogger(__name__)

LIVENESS_PERIOD_S = 1.0
LIVENESS_FAILURES = 3  # consecutive failed checks before a writing node counts as gone
RECENT_SAVES = 16

# Told of each commit, with the step's index once it is written (node 0 applies the job's
# retention then; the index is handed over so that nothing reads it back from disk).
OnCommit = Callable[[CheckpointIndex], Awaitable[None]]


@dataclass
class _GlobalSave:
    job: str
    step: int
    world_size: int
    save_id: str
    timeout_s: float
    metric: float | None
    created: float = field(default_factory=time.monotonic)
    cache: JobPlans | None = None  # the job's cache when the save began
    fingerprints: dict[int, str] = field(default_factory=dict)  # rank -> digest of its metadata
    rank_specs: dict[int, tuple[TensorSpec, ...]] = field(default_factory=dict)  # rank -> its metadata, taken when it joined
    node_of_rank: dict[int, int] = field(default_factory=dict)
    root_ids: dict[int, str] = field(default_factory=dict)  # node -> root id
    planned: asyncio.Event = field(default_factory=asyncio.Event)
    plan: SavePlan | None = None
    key: str = ""
    fresh_plan: bool = False  # the plan was made for this save (not taken from the job's cache)
    error: str = ""
    refused: bool = False  # the metadata itself is bad (INVALID_ARGUMENT)
    claim: RunClaim = NO_CLAIM  # the run whose ranks save it (engine/runs.py)
    run_refused: bool = False  # the run may not save into the job (errors.RunRefused)
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
    _answers: dict[bool, JoinResult] = field(default_factory=dict, init=False)  # `answer`'s, by whether the node knows the plan

    @property
    def nodes(self) -> set[int]:
        return set(self.root_ids)

    def answer(self, known: bool) -> JoinResult:
        """The answer to every joining node once planned, with every rank's metadata unless
        the node `known`s the plan: two records per save, not one per node."""
        found = self._answers.get(known)
        if found is None:
            assert self.plan is not None
            found = self._answers[known] = JoinResult(
                save_id=self.save_id, plan_key=self.key, node_of_rank=self.rank_nodes, specs=None if known else self.all_specs,
                shared_root=self.shared_root, compression=self.compression, plan=self.plan, fingerprints=self.rank_fingerprints,
            )
        return found


def _slim(save: _GlobalSave) -> None:
    """A decided save only answers late reports: keep its outcome, not what the commit was made
    of (manifests, extras, metadata, the index: ~2 KiB per tensor; issue 30 finding 5), nor what
    it knew of each rank (O(ranks) per save kept: issue 34)."""
    save.manifests.clear()
    save.extras.clear()
    save.model_files.clear()
    save.all_specs = save.rank_nodes = save.rank_fingerprints = ()
    save.fingerprints.clear()
    save.rank_specs.clear()
    save.node_of_rank.clear()
    save._answers.clear()
    if save.outcome is not None:
        files = save.outcome.step_files if save.nodes - {0} else {}
        save.outcome = replace(save.outcome, index=None, step_files=files)


def root_sharing(root_ids: dict[int, str], coordinator_root_id: str) -> bool:
    """Whether the nodes of a save (`root_ids`: node -> its root's id) all write into the
    coordinator's (node 0's) root: True when several do and every id is the coordinator's;
    False when each node has a root of its own. PlanError when some nodes share a root and
    others, or the coordinator, do not: a node that believes its root is its own empties the
    step's directory before writing, which would delete the files of the nodes sharing it."""
    if len(root_ids) > 1 and all(rid == coordinator_root_id for rid in root_ids.values()):
        return True
    first: dict[str, int] = {}
    for node in sorted(root_ids):
        seen = first.setdefault(root_ids[node], node)
        if seen == node:
            continue
        apart = sorted(n for n, rid in root_ids.items() if rid != root_ids[node])
        if apart:
            shown = ", ".join(map(str, apart[:3])) + (" and more" if len(apart) > 3 else "")
            other = f"node{'s' if len(apart) > 1 else ''} {shown} write{'' if len(apart) > 1 else 's'} into another"
        else:
            other = "the coordinator (node 0) writes into another"
        raise PlanError(
            f"nodes {seen} and {node} write into one storage root (id {root_ids[node][:12]}) but {other}: every node of a job "
            "must write into one shared root, or each into a root of its own; give the daemons the same --root on shared "
            "storage, or each a local one, and save again")
    return False


class Coordinator:
    """Node 0's part: one barrier and one commit per save of a job's step across nodes."""

    def __init__(
        self,
        storage: StorageBackend,
        peers: PeerProbe,
        own_root_id: str,
        on_commit: OnCommit,
        decide: Decide = lossless_by_default,
        runs: Runs | None = None, job_policy: JobPolicy = DEFAULT_JOB_POLICY,
    ) -> None:
        self.storage = storage
        self.peers = peers
        self.job_policy = job_policy  # a job's retention request -> the policy the index records (node 0's flags)
        self.admission = Admission(runs if runs is not None else Runs(), peers, storage)  # which run may save (engine/runs.py)
        self.root_id = own_root_id
        self.on_commit = on_commit  # retention for the job, after each commit (OnCommit)
        self.decide = decide  # each save's compression, from its options and lineage (node 0's settings)
        self._jobs: dict[str, JobPlans] = {}
        self._saves: dict[tuple[str, int], _GlobalSave] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    async def join(self, request: JoinSave, node: int, node_root_id: str) -> JoinResult:
        """Add `node`'s ranks (its root's id `node_root_id`) to the save of `request.step`;
        returns when every rank has joined.

        request.fingerprints: each of the node's ranks' metadata digest (plan.spec_digest);
        request.specs: the metadata of the ranks whose digest this job's cache may lack
        (UnknownFingerprint when it does). request.options: the compression its ranks ask for
        (every node must ask for the same); request.lineage: the quantization generation of
        what they last loaded. The coordinator decides the save's compression from these when
        it plans the save (JoinResult.compression). request.claim: the ranks' run, which may be
        refused (RunRefused) once all have joined (Admission.admit)."""
        job, step, world_size = request.job, request.step, request.world_size
        for rank in request.fingerprints:
            if not 0 <= rank < world_size:
                raise InvalidRequest(f"rank {rank} is not in [0, world_size={world_size})")
        cache = self._job_cache(job, world_size)
        rank_specs = cache.take(request.fingerprints, request.specs)
        save = self._saves.get((job, step))
        if save is not None and not save.decided.is_set() and save.claim.run and request.claim.run and save.claim.run != request.claim.run:
            await self._abort(save, await self.admission.replace(job, step, save.claim, request.claim))  # another run's: refused, or ended
            save.planned.set()  # its ranks waiting to be planned learn it now
        if save is None or save.decided.is_set():
            save = _GlobalSave(job, step, world_size, uuid.uuid4().hex, request.timeout_s, request.metric, cache=cache, claim=request.claim)
            self._saves.pop((job, step), None)  # re-inserted: `_saves` is in the order saves began
            self._saves[(job, step)] = save
            self._forget_old(job)
            self._spawn(self._join_deadline(save))
        if save.world_size != world_size:
            raise InvalidRequest(f"node {node} says job {job!r} has {world_size} ranks, other nodes say {save.world_size}")
        if node in save.root_ids:
            raise Precondition(f"node {node} joined the save of step {step} twice (its daemon restarted?): save again")
        if not save.fingerprints.keys().isdisjoint(request.fingerprints):
            rank = min(save.fingerprints.keys() & request.fingerprints.keys())
            raise InvalidRequest(f"rank {rank} is served by node {save.node_of_rank[rank]} and by node {node}; each rank talks to its own node's daemon")
        if save.root_ids and request.options != save.options:
            raise InvalidRequest(
                f"node {node}'s ranks ask for {request.options.describe()} in step {step} but other nodes' ranks asked for {save.options.describe()}; "
                "every rank must pass the same")
        save.options = request.options
        save.lineage = max(save.lineage, request.lineage)
        save.root_ids[node] = node_root_id
        save.fingerprints.update(request.fingerprints)
        save.rank_specs.update(rank_specs)
        save.node_of_rank.update(dict.fromkeys(request.fingerprints, node))
        if len(save.fingerprints) == world_size:
            self._spawn(self._plan(save))
        await save.planned.wait()
        if save.error:
            raise (InvalidRequest if save.refused else RunRefused if save.run_refused else Aborted)(save.error)
        assert save.plan is not None
        return save.answer(save.key in request.known_plans)

    def _job_cache(self, job: str, world_size: int) -> JobPlans:
        """The job's cache; a new one when the job's world size changed (an elastic restart:
        its ranks' metadata and plans are of another layout)."""
        cache = self._jobs.get(job)
        if cache is None or cache.world_size != world_size:
            cache = self._jobs[job] = JobPlans(world_size)
        return cache

    async def _plan(self, save: _GlobalSave) -> None:
        try:
            displaced = await self.admission.admit(save.job, save.step, save.claim)
        except RunRefused as exc:
            save.run_refused = True
            await self._abort(save, str(exc))
            save.planned.set()
            return
        for other in [s for s in self._saves.values() if displaced and (s.job, s.claim.run) == (save.job, displaced) and not s.planned.is_set()]:
            await self._abort(other, f"run {short(save.claim.run)} took job {save.job!r} over")  # waits for ranks that will not come
            other.planned.set()
        try:
            assert save.cache is not None
            save.all_specs = tuple(save.rank_specs[r] for r in range(save.world_size))
            save.rank_nodes = tuple(save.node_of_rank[r] for r in range(save.world_size))
            save.rank_fingerprints = tuple(save.fingerprints[r] for r in range(save.world_size))
            save.key = plan_key(save.rank_fingerprints, save.rank_nodes)
            save.shared_root = root_sharing(save.root_ids, self.root_id)  # once, not per joining node (O(nodes) each); PlanError on a root half shared
            plan = save.cache.plan(save.key)
            if plan is None:
                plan = await asyncio.to_thread(make_save_plan, save.all_specs, save.rank_nodes)
                save.fresh_plan = True
                save.cache.keep(save.key, plan)
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
                f"ranks {listed(missing)} never joined the save of step {save.step} within {save.timeout_s:.0f} s "
                f"(nodes that joined: {listed(sorted(save.nodes))})",
            )
            save.planned.set()

    async def report(self, request: ReportManifest, node: int) -> Outcome:
        """Take `node`'s manifest (or its failure); returns the step's outcome once it is decided."""
        job, step, save_id, manifest = request.job, request.step, request.save_id, request.manifest
        save = self._saves.get((job, step))
        if save is None or save.save_id != save_id:
            return Outcome(False, f"the coordinator knows no save {save_id} of step {step} (it restarted or the save was aborted)", decided=False)
        if node not in save.root_ids:  # save.root_ids: the nodes that joined (save.nodes builds a set)
            raise InvalidRequest(f"node {node} did not join the save of step {step}")
        if not save.decided.is_set():
            if manifest is None:
                await self._abort(save, f"node {node} failed: {request.error or 'no reason given'}")
            else:
                save.manifests[node] = manifest
                save.extras.update(request.extras)
                save.model_files.update(request.model_files)
                if len(save.manifests) == len(save.root_ids):  # manifests come from joined nodes only: all have reported
                    await self._commit(save)
        await save.decided.wait()
        assert save.outcome is not None
        return save.outcome

    async def _commit(self, save: _GlobalSave) -> None:
        assert save.plan is not None
        shared = save.shared_root  # decided when planned: PlanError there, never at the commit
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
        await self.on_commit(index)

    def _adapter_copy(self, save: _GlobalSave, manifests: list[NodeManifest]) -> tuple[FileRecord, bytes] | None:
        """The PEFT adapter file to publish with the step (step_build.adapter_source), read back
        from this root; None when the step is no adapter or its file is not here."""
        assert save.plan is not None
        source = adapter_source(manifests, save.plan, save.model_files)
        if source is None:
            return None
        try:
            return source, self.storage.files.read_range(save.job, save.step, source.name, 0, source.size)
        except OSError as exc:
            log.warning("step %s of job %s: no %s beside adapter_config.json (%s); `ckptd export` writes one", save.step, save.job, ADAPTER_WEIGHTS, exc)
            return None

    def _write_commit(self, save: _GlobalSave, shared: bool) -> tuple[CheckpointIndex, dict[str, bytes]]:
        """Write the step's small files and its index (the commit) and `latest`; returns the
        index and those files (for nodes with their own root)."""
        assert save.plan is not None
        manifests = [save.manifests[n] for n in sorted(save.manifests)]
        assert save.compression is not None
        asked = save.options.retention  # the job's own retention, merged into node 0's flags: every node prunes by what the index records
        index, files = step_files(
            save.job, save.step, save.plan, manifests, save.extras, save.model_files, save.metric,
            quantization=save.compression.record, adapter=self._adapter_copy(save, manifests),
            retention=None if asked is None else policy_record(self.job_policy(asked), asked),
            layouts=save.cache.index_layouts if save.cache is not None else None,
            extras_texts=save.cache.extras_texts if save.cache is not None else None,
            after=self.storage.catalog.newest_commit_time(save.job),
        )
        if shared:
            present = self.storage.files.step_file_sizes(save.job, save.step)
            for manifest in manifests:
                for record in manifest.files:
                    _check_file(present, record, manifest.node)
        StepCommit(self.storage.writing, self.storage.catalog, save.job, save.step).commit(files)
        return index, files

    async def _abort(self, save: _GlobalSave, reason: str) -> None:
        if save.decided.is_set():
            return
        save.error = save.error or reason
        save.outcome = Outcome(False, reason)
        save.decided.set()
        if save.fresh_plan and save.cache is not None and save.plan is not None:
            save.cache.forget(save.key, save.plan)  # a plan is kept once a save made with it got past its refusals
        log.warning("save of step %s of job %s aborted on every node: %s", save.step, save.job, reason)
        try:
            await asyncio.to_thread(self.storage.janitor.remove_step, save.job, save.step)
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
                saving = await self.peers.saving(node, save.job, save.step)
                failures[node] = 0 if saving else failures.get(node, 0) + 1
                if failures[node] >= LIVENESS_FAILURES:
                    what = "stopped answering" if saving is None else "lost the save (its daemon restarted)"
                    await self._abort(save, f"{self.peers.describe(node)} {what} while writing step {save.step}")
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


class SingleNode:
    """A daemon without peers: its saves meet and commit at an in-process coordinator of one
    node, the same Coordinator node 0 runs for several (no peer port, no root id file), so that
    one node and several commit by one protocol (engine/commit.py)."""

    node = 0

    def __init__(self, storage: StorageBackend, on_commit: OnCommit, decide: Decide = lossless_by_default,
                 runs: Runs | None = None, job_policy: JobPolicy = DEFAULT_JOB_POLICY) -> None:
        self.coordinator = Coordinator(storage, NoPeers(), "", on_commit, decide, runs, job_policy)

    async def join_save(self, request: JoinSave) -> JoinResult:
        return await self.coordinator.join(request, 0, "")

    async def report(self, request: ReportManifest) -> Outcome:
        return await self.coordinator.report(request, 0)
