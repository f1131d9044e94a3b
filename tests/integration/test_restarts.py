"""Restarts under torchrun (issue 31 item 6; docs/usage.md "Restarts and preemption").

A real `torchrun --max-restarts 2` (python -m torch.distributed.run, gloo on CPU) of two DDP
ranks (restart_rank.py) saving through a real daemon after every step. On the first attempt that
starts, rank 1 waits until step 3 is durable, moves the step's data files out of the root, and SIGKILLs
itself in the middle of step 4. torchrun's agent stops rank 0 and starts the group again
(a new $TORCHELASTIC_RESTART_COUNT: a new run id, which takes the job over by loading first);
the new ranks load step 3 from the daemon's memory (the held snapshot of the newest step) and
train to the end. Checked:

- the resumed run's losses equal an uninterrupted run's, step for step, bit for bit;
- no data file was read: the files were not there while the restarted ranks loaded, and the
  daemon counted both loads as served from memory (`ckptd_loads_total{tier="memory"}`, none from
  disk);
- put back, step 3 verifies (`ckptd verify`), and the steps the restarted run saved load.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from ckptd.client import CheckpointClient
from ckptd.client.run_id import launcher_run_id
from daemon_rig import DaemonFactory, free_port
from metrics_scrape import scrape
from torchrun_rig import finish, torchrun

WORKER = Path(__file__).with_name("restart_rank.py")
STEPS = 5
KILL_STEP = 3


def losses(out: Path, rank: int) -> dict[int, list[tuple[int, float, int]]]:
    """Each step's records of one rank: (attempt, loss, resumed_from) per time it was trained."""
    by_step: dict[int, list[tuple[int, float, int]]] = {}
    for line in (out / f"rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], []).append((record["attempt"], record["loss"], record["resumed_from"]))
    return by_step


# issue 31 item 6
def test_torchrun_restart_after_sigkill_resumes_from_memory_with_identical_losses(daemons: DaemonFactory, tmp_path: Path) -> None:
    port = free_port()
    daemon = daemons.start("--keep-last", "0", "--metrics-port", str(port), "--metrics-host", "127.0.0.1")

    hidden = tmp_path / "hidden"
    spec = {"job": "restarted", "steps": STEPS, "out": str(tmp_path / "restarted"), "kill": {"rank": 1, "step": KILL_STEP, "hide": str(hidden)}}
    # one restart more than the test needs, for each run: an attempt can die at start-up for a
    # reason outside ckptd (rank 0's store port, picked free by torchrun, taken before it binds)
    reference = torchrun(WORKER, daemon.address, {"job": "reference", "steps": STEPS, "out": str(tmp_path / "reference")}, log=tmp_path / "reference.log", max_restarts=1)
    run = torchrun(WORKER, daemon.address, spec, log=tmp_path / "restarted.log", max_restarts=2)  # side by side: the time is mostly start-up
    finish(reference, tmp_path / "reference.log", daemon_log=daemon.log_text)
    output = finish(run, tmp_path / "restarted.log", daemon_log=daemon.log_text)
    assert "exitcode: -9) local_rank: 1" in output, output[-4000:]  # torchrun saw rank 1 killed, and restarted the group
    # the second attempt is a new run (torchrun's restart count is part of its id) that resumed
    assert "job restarted: run " in daemon.log_text() and "(resumed)" in daemon.log_text(), daemon.log_text()[-3000:]
    loads = scrape(port)

    for rank in (0, 1):
        expected = {step: records[0][1] for step, records in losses(tmp_path / "reference", rank).items()}
        got = losses(tmp_path / "restarted", rank)
        assert sorted(got) == list(range(1, STEPS + 1))
        for step, records in got.items():
            assert [loss for _, loss, _ in records] == [expected[step]] * len(records), (rank, step, records)
        resumed = [start for records in got.values() for _, _, start in records if start != 0]
        assert resumed and all(start == KILL_STEP for start in resumed), resumed  # the restart began after step 3

    # both restarted ranks were served from the daemon's memory, none from disk
    # (the reference run never finds a step to load: a load of a job without steps counts no tier)
    served = {tier: loads.get(f'ckptd_loads_total{{tier="{tier}"}}', 0) for tier in ("memory", "disk", "mixed")}
    assert served == {"memory": 2, "disk": 0, "mixed": 0}, served
    step_dir = daemons.root / "restarted" / f"step-{KILL_STEP:08d}"
    assert not list(step_dir.glob("*.safetensors"))  # still away: nobody could have read them

    for data in hidden.iterdir():
        shutil.move(str(data), str(step_dir / data.name))
    verify = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "verify", str(step_dir)], capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr


# issue 31 item 6
def test_a_new_pod_resumes_under_the_run_id_of_the_first_attempt(daemon) -> None:
    """torchrun derives the run id from its run id, restart count and master address: a pod that
    Kubernetes starts again (restart count 0, the same --rdzv-id and master service) gets the
    first attempt's id, which the second attempt superseded. Once that attempt has ended, the new
    pod's ranks resume and save (the daemon used to refuse them as the superseded run)."""
    def attempt(restarts: int) -> str:
        env = {"TORCHELASTIC_RUN_ID": "job-7", "TORCHELASTIC_RESTART_COUNT": str(restarts), "MASTER_ADDR": "trainer-0.svc", "MASTER_PORT": "29500"}
        run_id = launcher_run_id(env)
        assert run_id is not None
        return run_id

    state = {"model": torch.nn.Linear(4, 4)}
    for restarts, step in ((0, 1), (1, 2), (0, 3)):  # attempt 0, its restart, then a new pod
        with CheckpointClient("pods", address=daemon.address, rank=0, world_size=1, run_id=attempt(restarts), on_error="raise") as ckpt:
            assert ckpt.load(state) == (step - 1 or None)
            assert ckpt.save(step, state).wait_durable(timeout=60) is not None
    with CheckpointClient("pods", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        assert [info.step for info in ckpt.list()] == [1, 2, 3]
