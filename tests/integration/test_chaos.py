"""The chaos suite's short run (issue 30): three nodes on loopback, two jobs on the same daemons,
random SIGKILLs of daemons and ranks, damaged files and replicas, a full disk; every step
acknowledged durable must load back bit-exact (tests/chaos_rig.py says what is checked).
The default run has 20 s of chaos after the first acknowledged saves (four to six actions), longer
(up to three times) until each job has three acknowledged saves and three actions were taken;
`pytest -m long` runs 45 s (a dozen actions), CKPTD_CHAOS_SECONDS sets the default run's, and the
long run is `python tests/bench/chaos.py --minutes 20`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chaos_rig import Chaos  # noqa: E402  tests/chaos_rig.py

SECONDS = float(os.environ.get("CKPTD_CHAOS_SECONDS", "20"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seconds", [SECONDS, pytest.param(45.0, marks=pytest.mark.long)])
def test_every_acknowledged_step_of_two_jobs_loads_exactly_through_kills_and_faults(tmp_path: Path, seconds: float) -> None:
    chaos = Chaos(tmp_path, seconds=seconds, seed=int(os.environ.get("CKPTD_CHAOS_SEED", "30")))
    try:
        report = chaos.run(min_acked=3, min_actions=3)
    finally:
        chaos.close()
    print(report.summary())
    assert not report.failures, "\n".join(report.failures) + "\n" + report.summary()
    assert all(len(steps) >= 3 for steps in report.acked.values()), report.summary()
    assert report.verified["exact"] > 0 and sum(report.actions.values()) >= 3, report.summary()
