"""Fault injection for tests: kill the daemon at the N-th file-system event under its root.

TEST-ONLY. Nothing here runs in production: the module is imported by the server only when
one of the environment variables below is set, does nothing at import time, and leaves the
process untouched unless `install_from_env` finds a variable set.

- ``CKPTD_FAULT_KILL_AT=N`` (N >= 1): the daemon SIGKILLs itself just before it performs the
  N-th file event (so events 1..N-1 happened, event N and everything after did not): no
  cleanup, no flush, no atexit, as a power cut of the process would.
- ``CKPTD_FAULT_LOG=PATH``: one JSON line per event, ``{"n": N, "kind": ..., "path": ...}``,
  appended to PATH (outside the root) before the event is performed; with the kill, the last
  line is the event that was not performed. Set it alone to learn how many events a save makes.
- ``CKPTD_FAULT_ARM_FILE=PATH`` (optional): count only from the first event after PATH exists
  (the test creates it just before the save it wants to crash), so a restarted daemon can
  recover, be checked and save once more before the save that is killed. Without it, counting
  starts when the daemon is serving.

A *file event* is one call that may change what is on disk under the storage root:
``open-w`` (an open that may create, truncate or write: O_WRONLY, O_RDWR, O_CREAT, O_TRUNC,
O_APPEND, or a Python file opened in a writing mode), ``write`` (os.write/pwrite/writev/pwritev,
sendfile/copy_file_range into it, and the writes of a Python file object, which do not go
through ``os``), ``fsync``/``fdatasync`` (``fsync-dir`` on a directory descriptor),
``ftruncate``, ``fallocate``, ``chmod``, ``rename`` (os.rename/os.replace), ``link`` (a hard link made there), ``unlink``,
``mkdir``, ``rmdir``; a call that fails (mkdir of a directory that exists) counts too. It is
under the root when its path (made absolute, relative to its ``dir_fd`` when given; links not
resolved) is the root or below it, or when its descriptor was opened at such a path.
Read-only opens (of files, and of directories for a directory fsync), reads, stat and listdir
are not events: they change nothing on disk, so a crash just before one leaves the same disk
state as a crash just before the next event, which is covered. Their descriptors are still
tracked, so the fsync of a directory opened read-only is an event.

How: the functions of the ``os`` module that the daemon, pathlib and shutil call
(``os.open`` … ``os.rmdir``) and ``io.open``/``builtins.open`` are replaced by counting
wrappers. Replacing module attributes catches every Python-level caller that looks the function
up at call time (the daemon's ``os.x(...)``, pathlib, shutil, ``os.fdopen``); file objects
opened under the root are built on a FileIO subclass whose ``write`` counts, because a file
object's writes go straight to the C library. The wrappers are added to ``os.supports_dir_fd``
and friends wherever the originals are, so shutil keeps its symlink-safe rmtree. Events are
counted and performed under one lock, so the count is the order in which they happened and a
kill leaves exactly events 1..N-1 done, even with the pipeline's writer threads.

Counting starts at `FaultInjector.arm` (the server calls it once it is serving; with
CKPTD_FAULT_ARM_FILE, once that file exists too), so the events of start-up recovery are not
counted: event 1 is the first file event after the daemon is ready (and armed), normally the
first of the next save. What C extensions write directly (none of the
daemon's files: they are written with os.pwrite and Python file objects) would not be seen.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil  # noqa: F401  imported before the wrappers: its fd-based rmtree is decided at import
import signal
import stat
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

KILL_AT_ENV = "CKPTD_FAULT_KILL_AT"
LOG_ENV = "CKPTD_FAULT_LOG"
ARM_FILE_ENV = "CKPTD_FAULT_ARM_FILE"

_installed: "FaultInjector | None" = None  # the process's one injector (test-only)


class FaultInjector:
    """Counts file events under `root` once armed; kills the process at event `kill_at` (None:
    never) and logs each event to `log_path` (None: no log). With `arm_file`, events count only
    once that file exists as well. `install` patches the process; only `uninstall` (tests of the
    hook itself) undoes it."""

    def __init__(self, root: Path, kill_at: int | None, log_path: Path | None, arm_file: Path | None = None) -> None:
        if kill_at is not None and kill_at < 1:
            raise ValueError(f"{KILL_AT_ENV} must be an integer >= 1, got {kill_at}")
        self.root = os.path.realpath(root)
        self.kill_at = kill_at
        self.count = 0
        self.armed = False
        self._lock = threading.RLock()
        self._fds: dict[int, tuple[str, bool]] = {}  # fd opened under the root -> (path, is a directory)
        self._orig: dict[str, Callable[..., Any]] = {}
        self._log_fd: int | None = None
        self._log_path = log_path
        self._arm_file = arm_file

    # ------------------------------------------------------------ bookkeeping

    def arm(self) -> None:
        """Start counting (and killing) from the next event on."""
        with self._lock:
            self.armed = True

    def _under(self, path: str) -> bool:
        return path == self.root or path.startswith(self.root + os.sep)

    def _abs(self, path: Any, dir_fd: int | None = None) -> str | None:
        """`path` made absolute and normalized (not resolved: links are not followed), or None
        for something that is not a path (a descriptor)."""
        if isinstance(path, int):
            return None
        path = os.fsdecode(os.fspath(path))
        if not os.path.isabs(path):
            base = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.getcwd()
            path = os.path.join(base, path)
        return os.path.normpath(path)

    def _event(self, kind: str, path: str) -> None:
        """Count an event under the root (the caller holds the lock); log it; die at kill_at."""
        if not self.armed or (self._arm_file is not None and not os.path.lexists(self._arm_file)):
            return
        self._arm_file = None  # armed for good: no more checks
        self.count += 1
        if self._log_fd is not None:
            self._orig["write"](self._log_fd, (json.dumps({"n": self.count, "kind": kind, "path": path}) + "\n").encode())
        if self.kill_at is not None and self.count >= self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def _path_event(self, kind: str, *paths: str | None) -> None:
        for p in paths:
            if p is not None and self._under(p):
                self._event(kind, p)
                return

    def _fd_event(self, kind: str, fd: int) -> None:
        known = self._fds.get(fd)
        if known is not None:
            self._event(f"{kind}-dir" if known[1] and kind == "fsync" else kind, known[0])

    def _track(self, fd: int, path: str | None) -> None:
        """Remember (or forget) what descriptor `fd`, just opened at `path`, refers to."""
        if path is not None and self._under(path):
            try:
                is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
            except OSError:
                is_dir = False
            self._fds[fd] = (path, is_dir)
        else:
            self._fds.pop(fd, None)

    # ------------------------------------------------------------ install

    def install(self) -> None:
        """Replace the os and io functions with counting wrappers (once per process)."""
        global _installed
        if _installed is not None:
            raise RuntimeError("a fault injector is already installed in this process")
        if self._log_path is not None:
            self._log_fd = os.open(self._log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        wrappers = self._wrappers()
        for name, _wrapper in wrappers.items():
            original = getattr(os, name, None) if name != "open_builtin" else builtins.open
            if original is None:
                continue
            self._orig[name] = original
        self._orig.setdefault("write", os.write)
        for name, wrapper in wrappers.items():
            if name not in self._orig:
                continue
            if name == "open_builtin":
                builtins.open = wrapper  # type: ignore[assignment]
                io.open = wrapper  # type: ignore[assignment]
                continue
            original = self._orig[name]
            setattr(os, name, wrapper)
            for support in (os.supports_dir_fd, os.supports_fd, os.supports_follow_symlinks, os.supports_effective_ids):
                if original in support:
                    support.add(wrapper)
        _installed = self

    def uninstall(self) -> None:
        """Put the original functions back (for tests of the hook; the daemon never uninstalls)."""
        global _installed
        for name, original in self._orig.items():
            if name == "open_builtin":
                builtins.open = original  # type: ignore[assignment]
                io.open = original  # type: ignore[assignment]
            else:
                setattr(os, name, original)
        if self._log_fd is not None:
            self._orig["close"](self._log_fd)
            self._log_fd = None
        _installed = None

    def _wrappers(self) -> dict[str, Callable[..., Any]]:
        inj = self
        orig = self._orig

        def open_(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
            with inj._lock:
                where = inj._abs(path, dir_fd)
                writes = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
                if writes:
                    inj._path_event("open-w", where)
                fd = orig["open"](path, flags, mode, dir_fd=dir_fd)
                inj._track(fd, where)
                return fd

        def close(fd: int) -> None:
            with inj._lock:
                inj._fds.pop(fd, None)
                orig["close"](fd)

        def on_fd(name: str, kind: str) -> Callable[..., Any]:
            def wrapper(fd: int, *args: Any, **kwargs: Any) -> Any:
                with inj._lock:
                    inj._fd_event(kind, fd)
                    return orig[name](fd, *args, **kwargs)

            wrapper.__name__ = name
            return wrapper

        def on_path(name: str, kind: str) -> Callable[..., Any]:
            def wrapper(path: Any, *args: Any, dir_fd: int | None = None, **kwargs: Any) -> Any:
                with inj._lock:
                    if isinstance(path, int):
                        inj._fd_event(kind, path)
                    else:
                        inj._path_event(kind, inj._abs(path, dir_fd))
                    return orig[name](path, *args, dir_fd=dir_fd, **kwargs) if dir_fd is not None else orig[name](path, *args, **kwargs)

            wrapper.__name__ = name
            return wrapper

        def moves(name: str) -> Callable[..., Any]:
            def wrapper(src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
                with inj._lock:
                    inj._path_event("rename", inj._abs(src, src_dir_fd), inj._abs(dst, dst_dir_fd))
                    orig[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

            wrapper.__name__ = name
            return wrapper

        def link(src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None, follow_symlinks: bool = True) -> None:
            with inj._lock:
                inj._path_event("link", inj._abs(dst, dst_dir_fd))
                orig["link"](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=follow_symlinks)

        def sendfile(out_fd: int, in_fd: int, *args: Any, **kwargs: Any) -> int:
            with inj._lock:
                inj._fd_event("write", out_fd)
                return orig["sendfile"](out_fd, in_fd, *args, **kwargs)

        def open_builtin(file: Any, mode: str = "r", buffering: int = -1, encoding: str | None = None, errors: str | None = None,
                         newline: str | None = None, closefd: bool = True, opener: Callable[..., int] | None = None) -> Any:
            with inj._lock:
                if isinstance(file, int):
                    counted = file in inj._fds
                    where = inj._fds[file][0] if counted else None
                else:
                    where = inj._abs(file)
                    counted = where is not None and inj._under(where)
                if not counted or opener is not None:
                    return orig["open_builtin"](file, mode, buffering, encoding, errors, newline, closefd, opener)
                if not isinstance(file, int) and not set(mode) <= set("rbt"):
                    inj._path_event("open-w", where)
                raw = _CountingFileIO(inj, file, where, mode.replace("b", "").replace("t", ""), closefd)
                return _wrap_raw(raw, mode, buffering, encoding, errors, newline)

        return {
            "open": open_, "close": close,
            "write": on_fd("write", "write"), "pwrite": on_fd("pwrite", "write"),
            "writev": on_fd("writev", "write"), "pwritev": on_fd("pwritev", "write"),
            "fsync": on_fd("fsync", "fsync"), "fdatasync": on_fd("fdatasync", "fdatasync"),
            "ftruncate": on_fd("ftruncate", "ftruncate"), "posix_fallocate": on_fd("posix_fallocate", "fallocate"),
            "fchmod": on_fd("fchmod", "chmod"),
            "truncate": on_path("truncate", "ftruncate"), "chmod": on_path("chmod", "chmod"),
            "unlink": on_path("unlink", "unlink"), "remove": on_path("remove", "unlink"),
            "rmdir": on_path("rmdir", "rmdir"), "mkdir": on_path("mkdir", "mkdir"),
            "rename": moves("rename"), "replace": moves("replace"), "link": link,
            "sendfile": sendfile, "copy_file_range": on_fd("copy_file_range", "write"),
            "open_builtin": open_builtin,
        }


class _CountingFileIO(io.FileIO):
    """A FileIO under the root: its writes are events (a Python file object writes through the C
    library, not through os.write), and closing it forgets its descriptor."""

    def __init__(self, inj: FaultInjector, file: Any, where: str | None, mode: str, closefd: bool) -> None:
        self._inj = inj
        super().__init__(file, mode, closefd)
        inj._track(self.fileno(), where)

    def write(self, data: Any) -> int | None:  # type: ignore[override]
        with self._inj._lock:
            self._inj._fd_event("write", self.fileno())
            return super().write(data)

    def close(self) -> None:
        if not self.closed:
            with self._inj._lock:
                if self.closefd:
                    self._inj._fds.pop(self.fileno(), None)
                super().close()


def _wrap_raw(raw: io.FileIO, mode: str, buffering: int, encoding: str | None, errors: str | None, newline: str | None) -> Any:
    """What io.open makes of `raw` for `mode` and `buffering` (as _pyio.open does)."""
    if buffering == 0:
        if "b" not in mode:
            raise ValueError("can't have unbuffered text I/O")
        return raw
    size = io.DEFAULT_BUFFER_SIZE if buffering < 0 else buffering
    buffer: Any
    if "+" in mode:
        buffer = io.BufferedRandom(raw, size)
    elif any(c in mode for c in "wax"):
        buffer = io.BufferedWriter(raw, size)
    else:
        buffer = io.BufferedReader(raw, size)
    if "b" in mode:
        return buffer
    text = io.TextIOWrapper(buffer, encoding, errors, newline, line_buffering=buffering == 1)
    text.mode = mode  # type: ignore[misc]
    return text


def fault_settings(env: Mapping[str, str], kill_at_env: str, log_env: str, arm_env: str) -> tuple[int | None, Path | None, Path | None] | None:
    """(kill at the N-th event, the event log, the arm file) the environment asks for under the
    given variable names, or None when neither the kill nor the log variable is set. ValueError
    for a kill count that is not an integer."""
    kill_at = env.get(kill_at_env, "").strip()
    log_path = env.get(log_env, "").strip()
    arm_file = env.get(arm_env, "").strip()
    if not kill_at and not log_path:
        return None
    try:
        n = int(kill_at) if kill_at else None
    except ValueError:
        raise ValueError(f"{kill_at_env} must be an integer >= 1, got {kill_at!r}") from None
    return n, Path(log_path) if log_path else None, Path(arm_file) if arm_file else None


def install_from_env(env: Mapping[str, str], root: Path) -> FaultInjector | None:
    """The injector the environment asks for, installed (not armed), or None when neither
    CKPTD_FAULT_KILL_AT nor CKPTD_FAULT_LOG is set (production: nothing is changed).
    CKPTD_FAULT_ARM_FILE, when set, delays counting until that file exists."""
    settings = fault_settings(env, KILL_AT_ENV, LOG_ENV, ARM_FILE_ENV)
    if settings is None:
        return None
    injector = FaultInjector(root, *settings)
    injector.install()
    return injector
