"""Whether a step's files fit on the storage's free space: pure arithmetic, any backend."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ckptd.common.sizes import human_bytes


def reused_bytes(sizes: Sequence[int], recycled: Sequence[int]) -> int:
    """Bytes of new files that overwrite recycled files in place instead of taking free space.

    sizes: the files to write, in the order the pipeline opens them; recycled: the recycle
    bin's file sizes, largest first. The pipeline gives the k-th file the k-th recycled one
    (posix_parts.PosixPartWriter): it overwrites min(size, recycled size) bytes already
    allocated, and cuts off any excess only once written. Pure."""
    return sum(min(size, old) for size, old in zip(sizes, recycled))


def space_problem(write_bytes: int, reused: int, reserve: int, free: int, where: Path | str) -> str | None:
    """None when a step's files fit on the file system at `where`, else why not and what to do.

    write_bytes: the most bytes the step's files can take; reused: of those, bytes that
    overwrite recycled files (reused_bytes), which take no free space; reserve: bytes that must
    stay free (--disk-reserve); free: the file system's free bytes (Storage.free_bytes).
    The files fit when (write_bytes - reused) + reserve <= free. Pure."""
    data = max(0, write_bytes - reused)
    needed = data + reserve
    if needed <= free:
        return None
    recycled = f"; another {human_bytes(min(reused, write_bytes))} reuse recycled files" if reused else ""
    if data > free:
        fix = "free space there (delete old checkpoints, keep fewer with --keep-last) or use a larger storage root"
    else:
        fix = "free space or lower --disk-reserve"
    return (
        f"not enough disk space: needs {human_bytes(needed)} ({human_bytes(data)} of data + "
        f"{human_bytes(reserve)} reserve{recycled}), {human_bytes(free)} free on {where}: {fix}"
    )
