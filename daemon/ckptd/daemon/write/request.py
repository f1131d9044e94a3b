"""What a node's write of a save is asked to do (PersistRequest) and how far it has got
(Progress): the types the writer, the snapshot's side of it and the engine share."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ckptd.format.index import CheckpointIndex
from ckptd.daemon.handoff.arena import ArenaSet
from ckptd.daemon.plan.node_files import NodeFilePlans
from ckptd.daemon.plan.save_plan import SavePlan


@dataclass(frozen=True)
class PersistRequest:
    job: str
    step: int
    plan: SavePlan
    arenas: ArenaSet
    extras: dict[int, Any]  # rank -> JSON tree
    model_files: dict[str, bytes]  # small files for model tools (config.json), validated names
    metric: float | None
    max_file_bytes: int
    write_threads: int
    throttle_bytes_per_s: float = 0.0  # 0: as fast as the disk goes (a slow disk, for tests and drills)
    node: int = 0  # this daemon's node: it writes the plan's parts of this node
    shared_dir: bool = False  # other nodes write into the same step directory
    quantize: str | None = None  # "O1" | "O2": quantize the optimizer moments (ckptd.common.quant)
    master_weights: str = "keep"  # "keep" | "drop" | "residual"
    quantization: dict[str, Any] | None = None  # the index's record (generation ...); None: lossless lineage
    disk_reserve: int = 0  # bytes to leave free on the root's file system (check_space); 0: the files only have to fit
    previous: CheckpointIndex | None = None  # the job's newest committed step: its unchanged files of frozen tensors are linked (write/reuse.py)
    file_plans: NodeFilePlans | None = None  # the files planned for the job's last save, reused while the plan is the same; None: planned anew


class Progress:
    """A save's bytes (of stored tensors) written so far, and those linked from the previous step
    instead (incremental saves: read back and checked, not written); read by WaitDurable and
    Status from another thread. `total`: all of the save's bytes, written or linked. In the
    snapshot's bytes while the files are written; in the files' bytes once `settle`d."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._written = 0
        self._linked = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        """`nbytes` more were written."""
        with self._lock:
            self._written += nbytes

    def link(self, nbytes: int) -> None:
        """`nbytes` more were linked from the previous step (and checked) instead of written."""
        with self._lock:
            self._linked += nbytes

    def settle(self, written: int, linked: int) -> None:
        """The node's files are written: from now on the bytes they take (written, and linked
        from the previous step), not the snapshot's bytes they were made of (a compressed
        step's files hold fewer)."""
        with self._lock:
            self._written, self._linked = written, linked
            self.total = written + linked  # done: a compressed step's progress reads whole, not a part of the snapshot's bytes

    @property
    def written(self) -> int:
        return self._written

    @property
    def linked(self) -> int:
        return self._linked
