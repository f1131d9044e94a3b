"""The id of a run: one start of a training program, the same on every rank of it.

The daemon tells two runs of one job apart by it (a second live run's saves are refused; a run
that resumed takes the job over: daemon engine/runs.py, docs/usage.md "Job identity"). Every
rank must send the same id, and every client of one process must too (a `CheckpointClient` per
save, as DCP's storage writer is, is still one run), so it comes from something the ranks share
and a process keeps; the first that applies:

1. `CheckpointClient(run_id=...)`, else $CKPTD_RUN_ID: the caller's (it must be new for every
   start of the program and equal on all its ranks);
2. the launcher's: torchrun ($TORCHELASTIC_RUN_ID unless "none", with its restart count and
   $MASTER_ADDR:$MASTER_PORT) or Slurm ($SLURM_JOB_ID, $SLURM_STEP_ID, $SLURM_RESTART_COUNT);
3. a job of one rank: this process (host, boot, pid and start time);
4. torch.distributed initialized with this client's rank and world size: rank 0's process,
   broadcast to the others at the client's first save or load (both are collective);
5. else this host and the parent process: ranks that are threads of one process, or processes
   that one launcher started on one node.

Derived ids (2-5) are 32 hex digits. Nothing here runs at import.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
from typing import Mapping

import torch

from ckptd.client.collectives import collective_device
from ckptd.common.names import check_run_id

RUN_ID_ENV = "CKPTD_RUN_ID"


def new_run_id() -> str:
    """A fresh random run id (32 hex digits)."""
    return secrets.token_hex(16)


def launcher_run_id(env: Mapping[str, str]) -> str | None:
    """The run id the launcher's variables give (rule 4), or None."""
    elastic = env.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic != "none":
        parts = ["torchrun", elastic, env.get("TORCHELASTIC_RESTART_COUNT", ""), env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")]
    elif env.get("SLURM_JOB_ID"):
        parts = ["slurm", env["SLURM_JOB_ID"], env.get("SLURM_STEP_ID", ""), env.get("SLURM_RESTART_COUNT", "")]
    else:
        return None
    return _digest(parts)


def _digest(parts: list[str]) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


class RunIdentity:
    """A client's run id, settled at the first `get()` (the rules of the module docstring).

    rank, world_size: the client's; given: its run_id argument (None: $CKPTD_RUN_ID or derived).
    `get()` may broadcast through torch.distributed (rule 3): call it where every rank of the
    run does, i.e. in a save or load. `source` says which rule gave the id.
    """

    def __init__(self, rank: int, world_size: int, given: str | None, env: Mapping[str, str] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self._env = os.environ if env is None else env
        explicit = given if given is not None else self._env.get(RUN_ID_ENV) or None
        self._id: str | None = check_run_id(explicit) if explicit is not None else None
        self.source = ("run_id=" if given is not None else f"${RUN_ID_ENV}") if explicit is not None else ""

    def get(self) -> str:
        """The run id (settled once)."""
        if self._id is None:
            self._id, self.source = self._derive()
        return self._id

    def _derive(self) -> tuple[str, str]:
        launched = launcher_run_id(self._env)
        if launched is not None:
            return launched, "launcher"
        if self.world_size == 1:
            return process_run_id(), "process"
        if _distributed_matches(self.rank, self.world_size):
            return _broadcast_from_rank0(), "torch.distributed"
        return _digest(["parent", socket.gethostname(), str(os.getppid())]), "parent process"


def process_run_id(pid: int | None = None) -> str:
    """The id of process `pid` (this one by default): its host, the boot, its pid and the time
    it started (a pid used again after a restart gives another id)."""
    pid = os.getpid() if pid is None else pid
    with open(f"/proc/{pid}/stat", "rb") as f:
        started = f.read().rsplit(b")", 1)[1].split()[19].decode()  # field 22, after "pid (comm)"
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return _digest(["process", socket.gethostname(), boot, str(pid), started])


def _distributed_matches(rank: int, world_size: int) -> bool:
    """Whether torch.distributed's default group is this client's run (rank and world size)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) == (rank, world_size)


def _broadcast_from_rank0() -> str:
    """Rank 0's process id on every rank of the default group (one broadcast of 16 bytes)."""
    buf = torch.zeros(16, dtype=torch.uint8, device=collective_device(None))
    if torch.distributed.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(bytes.fromhex(process_run_id())), dtype=torch.uint8))
    torch.distributed.broadcast(buf, src=0)
    return bytes(buf.cpu().tolist()).hex()
