"""Smoke run of tests/bench/bench_fill.py (issue 34: the client's Python per piece of a load of
many pieces): `--quick` fills row slices from every source kind, checks every byte, prints a
verdict per kind and leaves no shared-memory file behind. The figures themselves are the
benchmark's business, not asserted here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "bench" / "bench_fill.py"


def leftovers() -> list[Path]:
    return sorted(Path("/dev/shm").glob("ckptd-bench-fill-*"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_quick_sample_prints_a_verdict_per_source_kind_and_cleans_up(tmp_path: Path) -> None:
    before = leftovers()
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)], capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = run.stdout.split("\nsummary")[1]
    for kind in ("shm", "checked", "file"):
        assert any(f", {kind}: calling thread" in line and ("PASS" in line or "FAIL" in line) for line in summary.splitlines()), run.stdout
    assert leftovers() == before
    assert not any(tmp_path.iterdir())
