"""What the object-store tier moves for one committed step, from the step's index alone. Pure.

- Which node uploads which file (`uploads_of`): the node that wrote a data file uploads it
  (node-local roots); node 0 uploads the small files and, last, the index; with a root shared
  by every node, node 0 uploads everything.
- How each file is verified: a data file (safetensors) by its *units* (ckptd.format.units:
  byte ranges whose xxh3-64 the index records, tiling the file); the bytes read for an upload
  and the bytes downloaded for a restore are checked unit by unit against the index. A small
  file (JSON) is checked whole (format.check_small_file).
- Whether two files are byte-identical (`file_signature`): same size and the same units, so a
  file unchanged since an earlier uploaded step (an incremental save's hard link) is copied
  inside the bucket instead of uploaded again.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

from ckptd.format.index import INDEX_NAME, CheckpointIndex, FileRecord
from ckptd.format.units import Unit, is_data_file
from ckptd.daemon.storage.step_commit import publish_rank


def file_signature(record: FileRecord, units: Sequence[Unit]) -> str:
    """An identity of the file's bytes: equal for two files only when they hold the same bytes
    (same size, same units and checksums; up to xxh3-64 collisions)."""
    text = f"{record.size};" + ";".join(f"{u.offset},{u.nbytes},{u.xxh3:016x}" for u in units)
    return hashlib.sha256(text.encode()).hexdigest()


def uploads_of(index: CheckpointIndex, node: int, shared_root: bool) -> list[FileRecord]:
    """The files of the step that `node` uploads (the index itself not included; node 0 writes
    it last, see the module docstring). In the order of the commit rule
    (storage.step_commit.publish_rank): data files first, then small files, each in the index's
    order."""
    if shared_root:
        mine = list(index.files) if node == 0 else []
    else:
        mine = [f for f in index.files if (f.node == node if is_data_file(f.name) else node == 0)]
    return sorted(mine, key=lambda f: publish_rank(f.name))


def writes_index(node: int) -> bool:
    """Whether `node` writes the step's index into the bucket (node 0, the coordinator)."""
    return node == 0


def small_files(index: CheckpointIndex, units: dict[str, tuple[Unit, ...]]) -> list[FileRecord]:
    """The files verified whole by their recorded checksum: those without units (the index excluded)."""
    return [f for f in index.files if f.name not in units and f.name != INDEX_NAME]
