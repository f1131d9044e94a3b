"""Data-loader position through ckptd.integrations.accelerate, with sample ids recorded (issue 31
item 5): 2 gloo processes killed with SIGKILL and resumed in the same world size train every
sample of each epoch once, the batches and losses of an uninterrupted run, both with torchdata's
StatefulDataLoader (Accelerate's use_stateful_dataloader; its per-process state saved and
restored) and with Accelerate's skip_first_batches; resumed in another world size, the rule of
batches_to_skip trains the rest of the epoch once, nothing twice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptd.demo.process import DaemonProcess
from worker_process import load_worker, run_ranks  # tests/worker_process.py

pytest.importorskip("accelerate")
pytest.importorskip("torchdata.stateful_dataloader")

WORKER = Path(__file__).with_name("accel_train.py")
SAMPLES = 40


@pytest.fixture
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    """The module's tests share one daemon (conftest.shared_daemon): each saves under its own job."""
    return shared_daemon


def _runs(tmp: Path, name: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((tmp / f"{name}-{rank}.json").read_text()) for rank in range(world)]


def _killed_and_resumed(daemon: Any, tmp: Path, job: str, stateful: bool, baseline: bool) -> None:
    # 2 processes, 5 batches each an epoch; saved at 3 and 6, killed at 4 (3 durable), resumed
    # mid-epoch to the end of the second epoch. baseline: compare with an uninterrupted run too.
    if baseline:
        run_ranks(WORKER, 2, stateful=stateful, steps=10, out=str(tmp / "plain-{rank}.json"))
    spec = {"stateful": stateful, "steps": 10, "save_every": 3, "address": daemon.address, "job": job,
            "marker": str(tmp / "marker"), "out": str(tmp / "run-{rank}.json")}
    run_ranks(WORKER, 2, expect=-9, **{**spec, "kill_at": 4})
    assert json.loads((tmp / "marker").read_text()) == 3
    killed = _runs(tmp, "run", 2)
    run_ranks(WORKER, 2, **spec)
    resumed = _runs(tmp, "run", 2)
    for rank in range(2):
        assert resumed[rank]["resumed_from"] == 3
        # step 4 trained again after the resume: the batch and the loss the killed run had there
        assert (resumed[rank]["samples"]["4"], resumed[rank]["losses"]["4"]) == (killed[rank]["samples"]["4"], killed[rank]["losses"]["4"])
    if baseline:
        plain = _runs(tmp, "plain", 2)
        for rank in range(2):
            seen = {**{s: v for s, v in killed[rank]["samples"].items() if int(s) <= 3}, **resumed[rank]["samples"]}
            assert seen == plain[rank]["samples"]  # the same batches, in the same order, on the same process
            assert resumed[rank]["losses"] == {str(k): plain[rank]["losses"][str(k)] for k in range(4, 11)}
    for epoch in (range(1, 6), range(6, 11)):  # every sample once an epoch, over both processes
        ids = [i for rank in range(2) for s in epoch for i in (killed if s <= 3 else resumed)[rank]["samples"][str(s)]]
        assert sorted(ids) == list(range(SAMPLES))


# issue 31 item 5
def test_stateful_dataloader_killed_and_resumed_trains_each_sample_once(daemon, tmp_path: Path) -> None:
    _killed_and_resumed(daemon, tmp_path, "accel-stateful", stateful=True, baseline=False)


# issue 31 item 5
@pytest.mark.long  # the default run's killed-and-resumed test covers the same path
def test_stateful_dataloader_resumed_trains_the_batches_of_an_uninterrupted_run(daemon, tmp_path: Path) -> None:
    _killed_and_resumed(daemon, tmp_path, "accel-stateful-all", stateful=True, baseline=True)


# issue 31 item 5
@pytest.mark.long  # skip_first_batches instead of the stateful loader: pytest -m long
def test_skip_first_batches_killed_and_resumed_trains_each_sample_once(daemon, tmp_path: Path) -> None:
    _killed_and_resumed(daemon, tmp_path, "accel-skip", stateful=False, baseline=True)


# issue 31 item 5
def test_resumed_in_another_world_size_trains_the_rest_of_the_epoch_once(daemon, tmp_path: Path, one_thread: None) -> None:
    """Saved by 2 processes after 3 steps (the epoch's first 6 batches of 10), resumed by 1: the
    StatefulDataLoader states of the 2 processes are not restored (they describe the old split);
    batches_to_skip skips the 6 batches, the rest of the epoch is trained once, and the next
    epoch is the one an uninterrupted single process trains."""
    spec = {"stateful": True, "steps": 17, "save_every": 3, "address": daemon.address, "job": "accel-resize",
            "marker": str(tmp_path / "marker")}
    run_ranks(WORKER, 2, expect=-9, **{**spec, "kill_at": 4, "out": str(tmp_path / "two-{rank}.json")})
    assert json.loads((tmp_path / "marker").read_text()) == 3
    run_ranks(WORKER, 1, **{**spec, "resized": True, "out": str(tmp_path / "one-{rank}.json")})
    two, (one,) = _runs(tmp_path, "two", 2), _runs(tmp_path, "one", 1)
    assert one["resumed_from"] == 3
    before = [i for rank in range(2) for s in ("1", "2", "3") for i in two[rank]["samples"][s]]
    assert sorted(before + one["epochs"]["0"]) == list(range(SAMPLES))  # nothing twice, nothing skipped
    alone = load_worker(WORKER).train({"steps": 20, "stateful": True})
    assert one["epochs"]["1"] == alone["epochs"][1]
