"""The files of a `ckptd import` source, checked before anything reads them
(docs/integrations/import.md, "Safety").

A source is untrusted input: a directory someone else wrote (a download, a shared checkpoint)
may hold a link to a file elsewhere (an SSH key; /etc/shadow when the import runs as root), which
would be carried into the step, or a FIFO or device where a file belongs, which blocks the
reader or never ends. So:

- SOURCE itself, the file or directory named on the command line, may be a link (the user chose
  it); a file must then be a regular file.
- a file read from a source directory must be a regular file in it, or a link to one in it
  (links are resolved whole). The one link that leaves the directory and is followed is a
  Hugging Face hub cache's: a snapshot directory `.../snapshots/REV/` holds links into the
  model's blob store, `config.json -> ../../blobs/HASH`; a link from there to a file directly
  in that `.../blobs/` is followed.
- files are opened without following a link and without blocking, and checked on the
  descriptor (storage's open_for_reading) before a byte is read.

A refusal (ImportRefused) names the entry, what it is, and what to do. The checks are made on
the paths, before the reads: a source changed while it is imported (a file swapped for a link
midway) is outside them, except for the files opened here, which are checked on the descriptor.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Callable

from ckptd.daemon.importer.direct_write import ImportRefused
from ckptd.daemon.storage import ForeignEntry, open_for_reading, read_file
from ckptd.daemon.storage.fs import kind_of

HUB_SNAPSHOTS, HUB_BLOBS = "snapshots", "blobs"  # huggingface_hub's cache layout


def check_source(source: Path) -> Path:
    """The path to read SOURCE from: a directory as given, a regular file resolved (SOURCE may
    be a link). ImportRefused when it is missing or something else (a FIFO, a device, a socket)."""
    st = _status(source, os.stat)
    if stat.S_ISDIR(st.st_mode):
        return source
    if not stat.S_ISREG(st.st_mode):
        raise _not_a_file(source, st)
    return Path(os.path.realpath(source))


def has_entry(directory: Path, name: str) -> bool:
    """Whether `directory` has an entry `name` of any kind (a dangling link included): what
    the import then reads, and source_file refuses when it is not a file it may read."""
    return os.path.lexists(directory / name)


def source_file(directory: Path, name: str) -> Path:
    """The path to read the file `name` (a plain name) of source directory `directory` from:
    the entry itself, or the file a link there resolves to when that lies inside the directory
    (or in a Hugging Face cache's blobs/, module docstring). ImportRefused when the entry is
    missing, a link out of the directory, or not a regular file."""
    path = directory / name
    st = _status(path, os.lstat)
    if stat.S_ISLNK(st.st_mode):
        target = Path(os.path.realpath(path))
        home = Path(os.path.realpath(directory))
        if not (target.is_relative_to(home) or _in_hub_blobs(target, home)):
            raise ImportRefused(
                f"{path} is a symbolic link to {target}, outside the source directory {directory}: ckptd import does not "
                f"follow links out of the directory it imports (only a Hugging Face cache's links into its {HUB_BLOBS}/). "
                f"If that file belongs to the checkpoint, copy it in its place (cp --remove-destination {target} {path})"
            )
        try:
            st = os.stat(target)
        except OSError as exc:
            raise ImportRefused(f"{path} is a symbolic link to {target}, which cannot be read: {exc.strerror or exc}") from None
        path = target
    if not stat.S_ISREG(st.st_mode):
        raise _not_a_file(path, st)
    return path


def open_source(path: Path) -> int:
    """A descriptor to read the regular file at `path` (a checked path: source_file, or SOURCE
    resolved), opened without following a link or blocking; ImportRefused when it is not a
    regular file now."""
    try:
        return open_for_reading(path)
    except ForeignEntry:
        st = os.lstat(path)
        raise _not_a_file(path, st) from None


def read_source(path: Path, limit: int) -> bytes:
    """The whole file at `path` (a checked path, as for open_source), at most `limit` bytes, read
    as storage's read_file does; ImportRefused when it is larger or not a regular file now."""
    try:
        return read_file(path, limit)
    except ForeignEntry:
        raise _not_a_file(path, os.lstat(path)) from None
    except OSError as exc:
        if exc.errno != errno.EFBIG:
            raise
        raise ImportRefused(f"{path} is larger than the {limit} bytes ckptd reads of such a file") from None


def _status(path: Path, stat_of: Callable[[Path], os.stat_result]) -> os.stat_result:
    try:
        return stat_of(path)
    except FileNotFoundError:
        raise ImportRefused(f"{path} does not exist") from None
    except OSError as exc:
        raise ImportRefused(f"cannot read {path}: {exc.strerror or exc}") from None


def _in_hub_blobs(target: Path, home: Path) -> bool:
    """Whether `target` is a file directly in the blobs/ of the Hugging Face cache entry whose
    snapshot directory `home` is (`<entry>/snapshots/<rev>` -> `<entry>/blobs/<hash>`)."""
    return home.parent.name == HUB_SNAPSHOTS and target.parent == home.parent.parent / HUB_BLOBS


def _not_a_file(path: Path, st: os.stat_result) -> ImportRefused:
    return ImportRefused(
        f"{path} is {kind_of(st)}, not a regular file: ckptd import reads only regular files (a FIFO or a device "
        "would block it or never end); put the file it stands for in its place"
    )
