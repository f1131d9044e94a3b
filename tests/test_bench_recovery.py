"""Smoke run of tests/bench/bench_recovery.py (issue 34 item 3): `--quick` loses a node of a real
torchrun job, replaces it and resumes, prints every phase of the breakdown beside the floor and
the checks' verdicts, and leaves no process or shared-memory file behind. The figures
themselves are the benchmark's business, not asserted here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from session_rig import left_in_session  # tests/session_rig.py

SCRIPT = Path(__file__).resolve().parent / "bench" / "bench_recovery.py"
PHASES = ("detection", "restart", "launch", "load", "planning", "fetch", "fill", "first step", "total")


def running_with(text: str) -> list[str]:
    """The processes with `text` in their command line."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(cmdline.parent.name)
        except OSError:
            continue
    return found


@pytest.mark.long
@pytest.mark.timeout(240)
def test_the_quick_run_breaks_the_recovery_down_and_cleans_up(tmp_path: Path) -> None:
    shm_before = set(Path("/dev/shm").iterdir())
    bench = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    output, _ = bench.communicate(timeout=200)
    assert bench.returncode == 0, output
    for phase in PHASES:
        assert f"\n  {phase}" in output or f"\n    {phase}" in output or f"\n      {phase}" in output, (phase, output)
    assert "floor: node 1's" in output and "the bulk channel's" in output, output
    assert "restored bit-exact on all 3 ranks: PASS" in output and "read from the buddy's memory only: PASS" in output, output
    assert left_in_session(bench.pid) == []
    assert running_with(str(tmp_path)) == []  # the ranks: torchrun starts each in a session of its own
    assert [p for p in set(Path("/dev/shm").iterdir()) - shm_before if "recovery" in p.name] == []
