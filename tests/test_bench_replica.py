"""Smoke run of tests/bench/bench_replica.py (issue 34 items 1-2): `--quick` measures the floor,
the replica restore and the cold disk restore, unlimited and with the roots' reads limited
(where this machine allows: root, cgroup v1 blkio, a loop device), prints a verdict per target
and leaves no loop device, mount, cgroup or shared-memory file behind. The figures themselves
are the benchmark's business, not asserted here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "bench" / "bench_replica.py"
BLKIO = Path("/sys/fs/cgroup/blkio")


def leftovers(out: Path) -> list[str]:
    """The benchmark's loop devices (of images under `out`), blkio groups and shared-memory files that exist now."""
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=False).stdout.splitlines()
    found = [line for line in loops if str(out) in line]
    found += [str(p) for p in BLKIO.glob("ckptd-bench-replica-*")] if BLKIO.is_dir() else []
    found += [str(p) for p in Path("/dev/shm").glob("ckptd-bench-replica-*")]
    return found


@pytest.mark.long
@pytest.mark.timeout(240)
def test_the_quick_sample_prints_a_verdict_per_target_and_cleans_up(tmp_path: Path) -> None:
    before = leftovers(tmp_path)
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = run.stdout.split("\nsummary")[1]
    assert "memory restore / floor" in summary and ("PASS" in summary or "FAIL" in summary), run.stdout
    assert "reads limited" in summary, run.stdout  # measured, or NOT MEASURED with the reason
    assert leftovers(tmp_path) == before
    assert not any((tmp_path / "out").iterdir())  # the image and the mount point removed
