"""The test-only fault hook (ckptd.daemon.faults.files): what it counts, and that it kills at event N."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from ckptd.daemon.faults.files import FaultInjector, install_from_env


def test_nothing_is_installed_without_the_variables(tmp_path: Path) -> None:
    before = (os.open, os.write, os.fsync, open)
    assert install_from_env({}, tmp_path) is None
    assert (os.open, os.write, os.fsync, open) == before


def test_it_counts_writing_events_under_the_root_only(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "out"
    root.mkdir()
    outside.mkdir()
    log = tmp_path / "events.jsonl"
    injector = FaultInjector(root, None, log)
    injector.install()
    try:
        (outside / "x").write_bytes(b"not counted")
        injector.arm()
        (outside / "y").write_bytes(b"not counted")
        d = root / "d"
        os.mkdir(d)
        fd = os.open(d / "f", os.O_WRONLY | os.O_CREAT, 0o600)
        os.pwrite(fd, b"abc", 0)
        os.fsync(fd)
        os.close(fd)
        with os.fdopen(os.open("g", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=(dfd := os.open(d, os.O_RDONLY))), "wb") as f:
            f.write(b"through a file object")
        os.replace("g", "h", src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)
        os.close(dfd)
        (d / "h").read_bytes()  # a read: no event
        shutil.rmtree(d)  # the fd-based, link-safe rmtree still: unlink, unlink, rmdir
        assert shutil.rmtree.avoids_symlink_attacks
    finally:
        injector.uninstall()
    kinds = [(e["kind"], Path(e["path"]).name) for e in map(json.loads, log.read_text().splitlines())]
    assert kinds[:8] == [
        ("mkdir", "d"), ("open-w", "f"), ("write", "f"), ("fsync", "f"), ("open-w", "g"), ("write", "g"),
        ("rename", "g"), ("fsync-dir", "d"),
    ]
    assert sorted(kinds[8:10]) == [("unlink", "f"), ("unlink", "h")] and kinds[10:] == [("rmdir", "d")]  # rmtree: directory order
    assert injector.count == len(kinds)


def test_it_kills_the_process_before_event_n(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    script = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from ckptd.daemon.faults.files import install_from_env
        install_from_env(os.environ, Path({str(root)!r})).arm()
        for i in range(10):
            (Path({str(root)!r}) / f"f{{i}}").write_bytes(b"x")  # open-w, write: two events each
        """
    )
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "CKPTD_FAULT_KILL_AT": "5", "CKPTD_FAULT_LOG": str(log)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=60)
    assert proc.returncode == -9  # SIGKILL: no cleanup
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["n"] for e in events] == [1, 2, 3, 4, 5] and events[-1]["kind"] == "open-w"
    assert sorted(p.name for p in root.iterdir()) == ["f0", "f1"]  # event 5 (creating f2) never happened
