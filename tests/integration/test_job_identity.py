"""Job identity with real daemons (issue 30, finding 6; docs/usage.md "Job identity"): runs of
real processes (gloo ranks, tests/integration/identity_rank.py, whose ranks agree on their run
id through torch.distributed) and clients in this process with explicit run ids.

- a second live run of a job is refused with a message naming the job and what to do, as a
  failed handle under on_error="warn" (it used to join the first run's save and raise
  InvalidState "rank 0 joined the save of step 20 twice"), and the job's steps stay the first run's;
- a run that loads the newest step first (a resume) takes the job over; the run it displaced
  is refused from then on;
- a crashed run makes way at once: the save it left open fails when its processes end, and
  the next run saves the same step right away;
- with two nodes, node 0 decides: it asks the other node whether the owner is still attached;
- a rollback is logged with the steps it passes over and marked by `ckptd ls`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ckptd.client import CheckpointClient
from daemon_rig import free_port
from on_disk import committed  # tests/on_disk.py

WORKER = Path(__file__).with_name("identity_rank.py")


class Run:
    """A run of `world` gloo rank processes executing `ops` (identity_rank.py)."""

    def __init__(self, tmp: Path, name: str, address: str, job: str, value: float, ops: list[dict[str, Any]], world: int = 2) -> None:
        self.out = tmp / f"{name}.jsonl"
        port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")])}
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps({
                    "address": address, "job": job, "rank": r, "world_size": world, "port": port, "value": value, "out": str(self.out), "ops": ops,
                })],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for r in range(world)
        ]

    def finish(self, timeout: float = 180) -> list[list[dict[str, Any]]]:
        """Wait for every rank; each rank's lines."""
        for p in self.procs:
            output, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, output[-4000:]
        return self.lines()

    def lines(self) -> list[list[dict[str, Any]]]:
        out = []
        for r in range(len(self.procs)):
            path = Path(f"{self.out}.{r}")
            out.append([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [])
        return out

    def kill(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.communicate(timeout=30)


def _gathering(address: str, job: str, step: int, arrived: int = 1, timeout: float = 120) -> None:
    """Wait until `arrived` ranks joined the save of `step` on the daemon."""
    with CheckpointClient(job, address=address, rank=0, world_size=1) as probe:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(f.job == job and f.step == step and f.ranks_arrived >= arrived for f in probe.status().in_flight):
                return
            time.sleep(0.05)
    raise AssertionError(f"no rank joined step {step} of {job} within {timeout} s")


def _value_of(address: str, job: str, step: int) -> float:
    out = {"model": {"w": torch.zeros(64)}}
    with CheckpointClient(job, address=address, rank=0, world_size=1, on_error="raise") as reader:
        assert reader.load(out, step=step) == step
    return float(out["model"]["w"][0])


def _saves(lines: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {line["step"]: line for line in lines if line["op"] == "save"}


# issue 30 finding 6
def test_a_second_live_run_is_refused_and_a_resumed_one_takes_the_job_over(daemon, tmp_path: Path) -> None:
    go, done = tmp_path / "go", tmp_path / "done"
    first = Run(tmp_path, "a", daemon.address, "shared", 1.0, [
        {"op": "save", "step": 10, "durable": True},
        {"op": "wait", "file": str(go), "rank": 1},  # rank 0 goes on into step 20 and waits there for rank 1
        {"op": "save", "step": 20, "durable": True},
        {"op": "wait", "file": str(done)},
        {"op": "save", "step": 40},
    ])
    try:
        _gathering(daemon.address, "shared", 20)
        # the reproduction: a second run of the job, both ranks, while the first one's save of step 20 gathers
        second = Run(tmp_path, "b", daemon.address, "shared", 2.0, [
            {"op": "save", "step": 20}, {"op": "save", "step": 25}, {"op": "save", "step": 26, "raise": True},
        ]).finish()
        for lines in second:
            saves = _saves(lines)
            for step in (20, 25):
                assert "raised" not in saves[step] and saves[step]["ok"] is False, saves[step]  # nothing escapes on_error="warn"
                assert "job 'shared' belongs to another run that is still live" in saves[step]["error"]
                assert "new job name" in saves[step]["error"] and "load the job's newest step" in saves[step]["error"]
            assert saves[26]["raised"] == "CheckpointError" and saves[26]["code"] == "FAILED_PRECONDITION"  # not InvalidState

        go.touch()  # the first run's save of step 20 completes, with its own ranks only
        deadline = time.monotonic() + 120
        while not (daemon.root / "shared" / "step-00000020" / "ckptd.index.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _value_of(daemon.address, "shared", 20) == 1.0

        # a run that resumes (loads the newest step first) takes the job over from the live first run
        third = Run(tmp_path, "c", daemon.address, "shared", 3.0, [{"op": "load"}, {"op": "save", "step": 30, "durable": True}]).finish()
        for lines in third:
            assert lines[0] == {"op": "load", "step": 20, "value": 1.0}
            assert _saves(lines)[30]["ok"] is True, lines
        done.touch()
        for lines in first.finish():
            saves = _saves(lines)
            assert saves[10]["ok"] and saves[20]["ok"]
            assert saves[40]["ok"] is False and "no longer owns job 'shared'" in saves[40]["error"]  # displaced: refused
    finally:
        for p in first.procs:
            if p.poll() is None:
                p.kill()
    assert sorted(int(p.name[5:]) for p in (daemon.root / "shared").glob("step-*")) == [10, 20, 30]
    assert [_value_of(daemon.address, "shared", s) for s in (10, 20, 30)] == [1.0, 1.0, 3.0]


# issue 30 finding 6
def test_a_crashed_runs_open_save_fails_at_once_and_the_next_run_saves_that_step(daemon, tmp_path: Path) -> None:
    crashed = Run(tmp_path, "e", daemon.address, "crash", 1.0, [
        {"op": "save", "step": 10, "durable": True},
        {"op": "wait", "file": str(tmp_path / "never"), "rank": 1},
        {"op": "save", "step": 20},
    ])
    _gathering(daemon.address, "crash", 20)
    crashed.kill()  # rank 0 had joined step 20; rank 1 never will
    started = time.monotonic()
    restarted = Run(tmp_path, "f", daemon.address, "crash", 2.0, [{"op": "save", "step": 20, "durable": True}]).finish()
    for lines in restarted:
        assert _saves(lines)[20]["ok"] is True, lines  # not "rank 0 joined the save of step 20 twice"
    assert time.monotonic() - started < 60  # at once, not after the dead save's timeout (600 s)
    assert _value_of(daemon.address, "crash", 20) == 2.0


def _on_node(cluster: Any, node: int, run: str, ranks: int, work: Any) -> list[Any]:
    """`ranks` ranks of run `run` (a job of that many ranks), all on `node`, each doing work(client)."""

    def rank(r: int) -> Any:
        with CheckpointClient("mn", address=cluster.address(node), rank=r, world_size=ranks, local_world_size=ranks, timeout_s=60, run_id=run) as ckpt:
            return work(ckpt)

    with ThreadPoolExecutor(ranks) as pool:
        return list(pool.map(rank, range(ranks)))


# issue 30 finding 6
def test_node_0_refuses_a_second_run_while_the_owner_is_attached_to_another_node(node_sets) -> None:
    cluster = node_sets(2, shared_root=False)
    cluster.start_all()
    state = {"model": {"w": torch.ones(256)}}
    owner = CheckpointClient("mn", address=cluster.address(1), rank=0, world_size=1, local_world_size=1, timeout_s=60, run_id="owner-run")
    try:
        owner.save(1, state).wait_durable(timeout=60)  # the owner's rank is on node 1 only; node 0 decides
        refused = _on_node(cluster, 0, "second-run", 2, lambda c: c.save(2, state))
        assert [h.ok for h in refused] == [False, False]
        assert all("job 'mn' belongs to another run that is still live: run owner-run" in str(h.error) for h in refused)
    finally:
        owner.close()  # the owner ends: its client detaches from node 1
    accepted = _on_node(cluster, 0, "second-run", 2, lambda c: c.save(2, state).wait_durable(timeout=60))
    assert all(info is not None and info.step == 2 for info in accepted)


# issue 30 finding 6
def test_a_rollback_is_logged_with_the_steps_it_passes_over_and_marked_by_ls(daemons) -> None:
    daemon = daemons.start("--keep-last", "0")  # every step stays
    model = torch.nn.Linear(4, 4)
    with CheckpointClient("rb", address=daemon.address, on_error="raise") as ckpt:
        for step in (10, 20, 30):
            ckpt.save(step, {"model": model}).wait_durable(timeout=60)
        ckpt.load({"model": model}, step=10)
        ckpt.save(15, {"model": model}).wait_durable(timeout=60)
        ckpt.save(16, {"model": model}).wait_durable(timeout=60)
    log = daemon.log_path.read_text()
    assert "job rb saves step 15 below its newest committed step 30: a rollback. It passes over steps 20, 30" in log
    assert "saves step 16 below" not in log
    listed = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "ls", str(daemon.root), "rb", "--json"], capture_output=True, text=True, timeout=120)
    rows = {r["step"]: r for r in json.loads(listed.stdout)}
    assert {s: r["rollback_over"] for s, r in rows.items()} == {10: [], 15: [20, 30], 16: [], 20: [], 30: []}
    text = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "ls", str(daemon.root), "rb"], capture_output=True, text=True, timeout=120).stdout
    assert [line for line in text.splitlines() if "(rollback:" in line] == [line for line in text.splitlines() if "step-00000015" in line]
    assert "(rollback: committed after steps 20, 30)" in text and "(latest)" in text



# a new user's probe, 2026-12-01: a new run under a used job name pushed the job's steps out
def test_a_new_run_that_loaded_nothing_may_not_save_below_the_jobs_steps(daemons) -> None:
    daemon = daemons.start("--keep-last", "3")
    model = torch.nn.Linear(4, 4)
    with CheckpointClient("reuse", address=daemon.address, on_error="raise", run_id="first") as first:
        for step in (10, 20, 30, 40, 50):
            first.save(step, {"model": model}).wait_durable(timeout=60)
    with CheckpointClient("reuse", address=daemon.address, run_id="second") as second:  # on_error="warn": a failed handle
        handles = [second.save(step, {"model": model}) for step in (5, 15, 25)]
        for handle in handles:
            handle.wait_durable(timeout=60)
        assert [h.ok for h in handles] == [False] * 3
        assert "this run loaded none of them before saving below them (a new run under a used job name?)" in str(handles[0].error)
        assert committed(daemon.root, "reuse") == [30, 40, 50]  # nothing saved, nothing pushed out
        second.save(60, {"model": model}).wait_durable(timeout=60)  # above them: the job's next step, accepted
    with CheckpointClient("reuse", address=daemon.address, on_error="raise", run_id="third") as third:
        assert third.load({"model": model}, step=40) == 40
        third.save(45, {"model": model}).wait_durable(timeout=60)  # a deliberate rollback: loaded first
    assert committed(daemon.root, "reuse") == [45, 50, 60]  # the last three committed
    with CheckpointClient("reuse", address=daemon.address, on_error="raise", run_id="fourth") as fourth:
        fourth.mark_resumed(45)  # loaded another way (DCP's reader): a resume all the same
        fourth.save(47, {"model": model}).wait_durable(timeout=60)
    assert committed(daemon.root, "reuse") == [45, 47, 60]


def test_a_run_that_saves_a_step_twice_is_told_so(daemon) -> None:
    model = torch.nn.Linear(4, 4)
    with CheckpointClient("twice", address=daemon.address) as ckpt:
        ckpt.save(10, {"model": model}).wait_durable(timeout=60)
        again = ckpt.save(10, {"model": model})
        assert again.ok is False and "this run saved it already" in str(again.error) and "a new run under a used job name" not in str(again.error)
