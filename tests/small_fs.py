"""A daemons' root on a small tmpfs, for the tests of full disks and read-only roots."""

from __future__ import annotations

import contextlib
import os
import subprocess
from typing import Any, Iterator

import pytest


@contextlib.contextmanager
def tmpfs_root(daemons: Any, size: str) -> Iterator[Any]:
    """Mount a tmpfs of `size` (mount's syntax: "24m") at `daemons.root` (a DaemonFactory of
    tests/conftest.py) and yield `daemons`; at the end its daemons are killed and the tmpfs
    unmounted (lazily if busy). Skips the test, saying what is not covered, where mounting is
    not allowed (not root, or no mount permission in a container)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for the root needs root: full-disk and read-only-root cases not covered")
    root = daemons.root
    root.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(root)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at the root here ({mounted.stderr.strip()}): full-disk and read-only-root cases not covered")
    try:
        yield daemons
    finally:
        for daemon in daemons.started:
            if daemon.popen.poll() is None:
                daemon.kill()
        if subprocess.run(["umount", str(root)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(root)], check=True)
