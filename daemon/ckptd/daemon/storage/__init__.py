"""The storage seam (issue 21 item 2): the only package that does I/O on the storage root.

- base.py: the StorageBackend protocol and its four roles (StepCatalog, StepFiles,
  StepWriting, StepJanitor), PartWriter, ReadHandle, StepReader, and the records of the
  contract (RecycledFile, FreeSpace, Leftover);
- step_commit.py: StepCommit, the commit rule of a step (the index last), stated once;
- posix.py: Storage, the POSIX backend (a directory tree), composing one class per role:
  posix_catalog.py, posix_files.py, posix_writing.py, posix_janitor.py (recycle bin,
  recovery, gc), over posix_tree.py (the root's paths, and the one rule of what a job
  directory and a storage root are) and posix_parts.py (data files being written, steps read
  by the tools);
- fs.py: the safe file primitives under them (no link followed, nothing foreign touched);
- space.py: whether a step fits (pure).

The names below are those `ckptd.daemon.storage` had as one module; they stay importable from
here.
"""

from ckptd.daemon.storage.base import (
    FreeSpace,
    Leftover,
    PartWriter,
    ReadHandle,
    RecycledFile,
    StepCatalog,
    StepFiles,
    StepJanitor,
    StepReader,
    StepWriting,
    StorageBackend,
)
from ckptd.daemon.storage.fs import (
    DELETING_PREFIX,
    DIR_MODE,
    FILE_MODE,
    RECYCLE_DIR,
    TMP_MARK,
    ForeignEntry,
    check_replaceable,
    create_file,
    foreign_entries,
    foreign_reason,
    fsync_dir,
    make_dir,
    open_dir,
    open_for_reading,
    open_recycled,
    read_file,
    remove_own_tree,
    start_writeback,
    tmp_name,
    tree_bytes,
    write_small_file,
)
from ckptd.daemon.storage.posix import Storage
from ckptd.daemon.storage.posix_catalog import UncommittedStep
from ckptd.daemon.storage.posix_parts import PosixPartWriter, PosixStepReader, step_at
from ckptd.daemon.storage.posix_tree import ROOT_ID_FILE, is_job_dir, is_storage_root
from ckptd.daemon.storage.space import reused_bytes, space_problem

__all__ = [
    "DELETING_PREFIX", "DIR_MODE", "FILE_MODE", "RECYCLE_DIR", "ROOT_ID_FILE", "TMP_MARK",
    "ForeignEntry", "FreeSpace", "Leftover", "PartWriter", "PosixPartWriter", "PosixStepReader", "ReadHandle",
    "RecycledFile", "StepCatalog", "StepFiles", "StepJanitor", "StepReader", "StepWriting", "Storage", "StorageBackend", "UncommittedStep", "check_replaceable", "create_file", "foreign_entries", "foreign_reason", "is_job_dir", "is_storage_root",
    "fsync_dir", "make_dir", "open_dir", "open_for_reading", "open_recycled", "read_file", "remove_own_tree",
    "reused_bytes", "space_problem", "start_writeback", "step_at", "tmp_name", "tree_bytes", "write_small_file",
]
