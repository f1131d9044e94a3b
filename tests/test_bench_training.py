"""Smoke runs of tests/bench/bench_training.py (issue 33 item 6): `--quick` runs every system and
prints the target's verdict; interrupted, it stops the daemons and DCP's process and removes
its files. The figures themselves are the benchmark's business, not asserted here."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

SCRIPT = Path(__file__).resolve().parent / "bench" / "bench_training.py"


def start(out: Path, shm: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--shm-dir", str(shm)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


def left_in_session(sid: int, wait_s: float = 10.0) -> list[str]:
    """The processes still in the benchmark's session (daemons, DCP's process, multiprocessing's
    resource tracker, which exits shortly after its parent), as 'pid comm', after up to wait_s."""
    deadline = time.monotonic() + wait_s
    while (left := _in_session(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _in_session(sid: int) -> list[str]:
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rpartition(")")[2].split()
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6: session id
            left.append(f"{stat.parent.name} {text.split(' ', 2)[1]}")
    return left


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bench-training-test-", dir="/dev/shm"))
    yield path
    left = sorted(str(p) for p in path.rglob("*"))
    shutil.rmtree(path, ignore_errors=True)
    assert left == [], "left behind in shared memory"


@pytest.mark.long
@pytest.mark.timeout(240)
def test_the_quick_run_measures_every_system_and_cleans_up(tmp_path: Path, shm: Path) -> None:
    bench = start(tmp_path / "out", shm)
    output, _ = bench.communicate(timeout=180)
    assert bench.returncode == 0, output
    assert "training time lost: ckptd / DCP async_save" in output and "target <= 0.5" in output, output
    for system in ("ckptd", "ckptd-nice", "dcp"):
        assert f"{system}: training time lost per save" in output, output
    assert "summary: " in output and "ERROR" not in output, output
    assert not (tmp_path / "out").exists()  # made by the run, removed with the scratch directory
    assert left_in_session(bench.pid) == []


@pytest.mark.long
@pytest.mark.timeout(240)
def test_ctrl_c_stops_everything_and_removes_the_files(tmp_path: Path, shm: Path) -> None:
    bench = start(tmp_path / "out", shm)
    assert bench.stdout is not None
    lines = []
    for line in bench.stdout:
        lines.append(line)
        if line.startswith("part warm-up"):  # the daemons and DCP's group are up
            break
    time.sleep(1.0)
    os.killpg(bench.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the whole foreground group
    rest, _ = bench.communicate(timeout=120)
    output = "".join(lines) + rest
    assert bench.returncode == 130, output
    assert "interrupted (SIGINT)" in output, output
    assert not (tmp_path / "out").exists(), output
    assert left_in_session(bench.pid) == []
