"""Smoke run of tests/bench/bench_broadcast.py (issue 34 item 4): `--quick` starts four clusters
of four traced daemons, saves, loads with and without load broadcast, counts the bytes read from
the roots and prints a verdict per target; every load is bit-exact. The figures themselves are the
benchmark's business; the read counts are asserted because they are exact, not timings."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "bench" / "bench_broadcast.py"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("strace") is None, reason="the benchmark counts reads with strace")
def test_the_quick_run_reads_each_byte_once_with_broadcast(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "PASS: every load bit-exact" in done.stdout
    ratios = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+-\w+)\s+([\d.]+) \(", done.stdout, re.MULTILINE)}
    assert ratios["shared-on"] <= 1.1 and ratios["local-on"] <= 1.1, done.stdout
    assert ratios["shared-off"] >= 3.5, done.stdout  # 4 replicas each read every byte
