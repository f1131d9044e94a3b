"""The engine's requests: what a rank or a node asks, as one frozen record each (wire-free).

The wire edge builds each once from its message, every field checked (rpc/validate.py); the
facade (service.py), the engine and the coordinator pass it on unchanged, so a request's
parameters are written down here and nowhere else.

    BeginSave   a rank joins the save of a step (Saves.begin)
    CommitSnapshot  a rank hands its part of the snapshot over (Saves.hand_over)
    JoinSave    a node joins the save at the coordinator (Coordination.join_save, Coordinator.join)
    ReportManifest  a node reports its written part, or its failure (Coordination.report, Coordinator.report)
    PlanLoad    a rank asks where the bytes of the tensors it loads are (Loads.plan)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ckptd.daemon.engine.runs import NO_CLAIM, RunClaim
from ckptd.daemon.handoff.transports import StagedHandOver
from ckptd.daemon.plan.compression import NO_OPTIONS, SaveOptions
from ckptd.daemon.plan.files import NodeManifest
from ckptd.daemon.plan.save_plan import TensorSpec


@dataclass(frozen=True)
class BeginSave:
    """Rank `rank` of `world_size` joins the save of `step` of `job`."""

    job: str
    rank: int
    world_size: int
    step: int
    fingerprint: str  # the rank's name for its tensor metadata (the client's structure fingerprint)
    specs: Sequence[TensorSpec] | None  # its tensor metadata; None: what it sent before under `fingerprint`
    metric: float | None  # for keep_best retention; None: none given
    timeout_s: float = 0.0  # seconds until the save fails; 0: the daemon's save_timeout_s (and never more)
    local_world_size: int = 0  # the job's ranks this daemon serves (0: all, on a single node)
    options: SaveOptions = NO_OPTIONS  # compression and retention asked (every rank must ask the same)
    lineage: int = 0  # the quantization generation of the step the rank last loaded
    run: str = ""  # the rank's run ("": a client older than run ids)
    resumed_from: int | None = None  # the step the run loaded before its first save (a resume), else None
    client_id: str = ""  # the rank's client ("": unknown)


@dataclass(frozen=True)
class CommitSnapshot:
    """Rank `rank`'s part of the save `save_id` is in its arena (or, `staged`, in its staging buffer)."""

    job: str
    rank: int
    save_id: str  # BeginSave's answer
    extras_json: str  # the rank's extras tree as JSON text (checked by Saves.hand_over)
    model_files: Mapping[str, bytes] | None = None  # config.json ... (rank 0's are kept)
    staged: StagedHandOver | None = None  # mode "ipc": ranges to copy from its staging buffer into its arena first
    stall_s: float = 0.0  # seconds its save() blocked training so far, for the metrics (0: not reported)


@dataclass(frozen=True)
class JoinSave:
    """A node's ranks join the save of `step` at the coordinator (the node and its root are the
    joiner's, given alongside: Coordinator.join)."""

    job: str
    step: int
    world_size: int
    fingerprints: Mapping[int, str]  # each of the node's ranks' metadata digest (plan.spec_digest)
    specs: Mapping[int, tuple[TensorSpec, ...]]  # the metadata of the ranks whose digest the coordinator may lack
    known_plans: Sequence[str]  # plan keys the node has planned before (their metadata is not sent back)
    timeout_s: float  # seconds the coordinator waits for every rank
    metric: float | None
    options: SaveOptions = NO_OPTIONS  # what its ranks ask for (every node must ask for the same)
    lineage: int = 0  # the deepest quantization generation its ranks last loaded
    claim: RunClaim = NO_CLAIM  # the ranks' run (engine/runs.py)


@dataclass(frozen=True)
class ReportManifest:
    """A node's part of the save `save_id` of `step` is written (`manifest`), or failed (`manifest`
    None, `error` says why); the reporting node is given alongside (Coordinator.report)."""

    job: str
    step: int
    save_id: str  # the coordinator's id of the save (JoinResult.save_id)
    manifest: NodeManifest | None
    error: str = ""
    extras: Mapping[int, Any] = field(default_factory=dict)  # rank -> its extras tree (extra.json), the node's ranks
    model_files: Mapping[str, bytes] = field(default_factory=dict)  # config.json ... as the ranks sent them


@dataclass(frozen=True)
class PlanLoad:
    """Rank `rank` of `world_size` loads `wanted` from `step` of `job`."""

    job: str
    rank: int
    world_size: int
    step: int | None  # None: the newest committed step
    # the tensor boxes wanted; a rank's same specs object again (rpc/checkpoint.py resolves a
    # known fingerprint to it) lets a memory-tier plan be reused (plan/load_plan.py MemoryPlans)
    wanted: Sequence[TensorSpec]
    kinds: Sequence[str]  # the top-level keys of the rank's state (which extras it loads)
    strict: bool  # missing or unexpected tensors are an error (the client decides; reported either way)
    direct_read: bool = True  # the rank reads this node's root itself; else the daemon stages what it reads
    decodes: bool = True  # the client decodes quantized codes and residuals
    decodes_frames: bool = True  # the client reads codes in zstd frames
    run: str = ""  # the rank's run: its open saves are abandoned, another run's never
    client: str = ""  # the client id of the rank ("": a client older than client ids): its end ends the load's lease
    local_world_size: int = 0  # the job's ranks this daemon serves (0: not said; all of them on a single node)
