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

from session_rig import left_in_session  # tests/session_rig.py

SCRIPT = Path(__file__).resolve().parent / "bench" / "bench_training.py"


def start(out: Path, shm: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--shm-dir", str(shm)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


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
