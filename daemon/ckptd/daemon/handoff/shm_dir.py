"""The shared-memory directory (`--shm-dir`): its check at start, its free space, and the
daemon-wide budget of snapshot arenas in it (`--shm-budget`).

The budget is a number of bytes, a share of the host's memory, or none (then only the
directory's own size bounds the arenas). The host's memory is the smaller of the machine's
(MemTotal) and the daemon's cgroup memory limit: tmpfs pages are charged to the cgroup of the
process that touches them first, and the daemon pre-faults its arenas itself (handoff/arena.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ckptd.common.sizes import human_bytes

_PERCENT: Final = re.compile(r"\s*(\d+(?:\.\d+)?)\s*%\s*")
_SHM_FIX: Final = (
    "give it more shared memory: Docker `docker run --shm-size=16g ...` (or `shm_size:` in compose); "
    "Kubernetes: mount an emptyDir with `medium: Memory` and a `sizeLimit` at /dev/shm "
    "(or use hostIPC: true); or point --shm-dir / CKPTD_SHM_DIR at a larger tmpfs"
)


@dataclass(frozen=True)
class ShmBudget:
    """The most shared memory the snapshot arenas of all jobs may take together.

    nbytes: a fixed number of bytes; share: a fraction (0 < share <= 1) of the host's memory;
    both 0: no budget (the shared-memory directory's size is the bound)."""

    nbytes: int = 0
    share: float = 0.0

    @classmethod
    def of_percent(cls, text: str) -> "ShmBudget":
        """'50%' -> a share of 0.5; ValueError unless a percentage above 0 and at most 100."""
        match = _PERCENT.fullmatch(text)
        percent = float(match.group(1)) if match else 0.0
        if not 0 < percent <= 100:
            raise ValueError(f"{text!r} is not a percentage above 0 and at most 100")
        return cls(share=percent / 100)

    def resolve(self, host_memory: int) -> int | None:
        """The budget in bytes (None: no budget), a share taken of `host_memory` bytes."""
        if self.share:
            return int(self.share * host_memory)
        return self.nbytes or None

    def __str__(self) -> str:
        if self.share:
            return f"{self.share * 100:g}% of the host's memory"
        return human_bytes(self.nbytes) if self.nbytes else "none"


def host_memory_bytes() -> int:
    """The memory this daemon may use: MemTotal, or its cgroup's limit when that is lower."""
    total = next(
        int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:")
    )
    limit = _cgroup_limit()
    return min(total, limit) if limit else total


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2 `memory.max`, else v1), None when unlimited or unknown."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            candidates.append(Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max")
        elif "memory" in controllers.split(","):
            candidates.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.limit_in_bytes")
    for candidate in candidates:
        try:
            text = candidate.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 says "unlimited" with a huge number, v2 with "max"
            return int(text)
    return None


def free_bytes(shm_dir: Path) -> int:
    """Bytes that can still be allocated in `shm_dir` (OSError if it cannot be checked)."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def total_bytes(shm_dir: Path) -> int:
    """The size of the file system of `shm_dir` in bytes (OSError if it cannot be checked)."""
    st = os.statvfs(shm_dir)
    return st.f_blocks * st.f_frsize


def check_shm(shm_dir: Path, needed_bytes: int) -> str | None:
    """None when `shm_dir` is a writable directory with at least `needed_bytes` free; else what is wrong and how to fix it.

    Containers get a 64 MiB /dev/shm by default, far too little for checkpoint arenas (docs/architecture.md section 10).
    """
    if not shm_dir.is_dir():
        return (
            f"shared-memory directory {shm_dir} does not exist or is not a directory; create it, or point "
            "--shm-dir / CKPTD_SHM_DIR at a tmpfs such as /dev/shm (in Kubernetes: an emptyDir with `medium: Memory`)"
        )
    if not os.access(shm_dir, os.W_OK | os.X_OK):
        return f"shared-memory directory {shm_dir} is not writable by uid {os.geteuid()}; fix its permissions or choose another --shm-dir"
    try:
        st = os.statvfs(shm_dir)
    except OSError as exc:
        return f"cannot check the free space of {shm_dir}: {exc.strerror or exc}"
    free = st.f_bavail * st.f_frsize
    if free < needed_bytes:
        total = st.f_blocks * st.f_frsize
        return (
            f"{shm_dir} has {human_bytes(free)} free (of {human_bytes(total)}) but the checkpoint arenas need "
            f"{human_bytes(needed_bytes)}; {_SHM_FIX}"
        )
    return None
