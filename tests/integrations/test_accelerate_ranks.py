"""ckptd.integrations.accelerate with the real Accelerate in 2 processes (gloo on CPU) and a real
daemon: the objects each process registered for checkpointing come back to that process (issue
30 finding 3). The single-process behaviour is in test_accelerate.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from worker_process import run_ranks  # tests/worker_process.py

pytest.importorskip("accelerate")

WORKER = Path(__file__).with_name("accel_ranks.py")


def _run(daemon, tmp: Path, mode: str) -> list[dict]:
    out = tmp / mode
    out.mkdir()
    run_ranks(WORKER, 2, address=daemon.address, job="accel-ranks", step=4, mode=mode, out=str(out))
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


# issue 30 finding 3
def test_issue30_finding3_each_process_gets_back_the_objects_it_registered(daemon, tmp_path: Path) -> None:
    saved = _run(daemon, tmp_path, "save")
    assert [(r["step"], r["seen"], r["count"]) for r in saved] == [(4, [10.0] * 3, 10), (4, [11.0] * 3, 11)]
    resumed = _run(daemon, tmp_path, "load")
    assert [(r["step"], r["process"], r["seen"], r["count"]) for r in resumed] == [(4, 0, [10.0] * 3, 10), (4, 1, [11.0] * 3, 11)]
