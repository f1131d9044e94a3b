"""What a test reads straight from a daemon's root, without a daemon: the committed steps of a job."""

from __future__ import annotations

from pathlib import Path

from ckptd.format.index import INDEX_NAME


def committed(root: Path, job: str) -> list[int]:
    """The job's step numbers whose directory holds its index (the commit), ascending."""
    return sorted(int(p.name[5:]) for p in (root / job).glob("step-*") if (p / INDEX_NAME).is_file())
