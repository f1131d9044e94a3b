"""CkptdCheckpointIO with the real PyTorch Lightning, on CPU, against real daemons.

- every checkpoint a Trainer saves (top-k files, last.ckpt, as a copy or a link) loads back as
  Lightning built it, right after its save and at the end; ModelCheckpoint's removals remove
  the pointer files, and the daemon's retention (--keep-best 2 with the plugin's metrics,
  --keep-last 1) keeps exactly the steps the remaining pointers name;
- a run SIGKILLed after a durable save and resumed with ckpt_path="last" gives the same losses,
  step by step, as an uninterrupted run; a run resumed from a top-k file into a new job too;
- the same with Lightning's DDP (2 processes, gloo): global rank 0 saves, both ranks load;
- a second save of one global_step: its own Lightning bookkeeping, the same tensors, or an error;
- bad paths and bad checkpoints: clear errors.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import zipfile
from collections import OrderedDict
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy  # noqa: E402
from lightning_utilities.core.apply_func import apply_to_collection  # noqa: E402

from ckptd.client import CheckpointClient  # noqa: E402
from ckptd.client.errors import CheckpointError  # noqa: E402
from ckptd.demo.process import DaemonProcess  # noqa: E402
from ckptd.integrations.lightning import CkptdCheckpointIO  # noqa: E402
from worker_process import load_worker  # noqa: E402  (tests/worker_process.py)

_worker = load_worker(Path(__file__).with_name("lightning_worker.py"))  # tests/integrations is no package
finish = _worker.finish
kill = _worker.kill
start_ranks = _worker.start_ranks

WORKER = Path(__file__).with_name("lightning_worker.py")
RETENTION = ("--keep-last", "1", "--keep-best", "2", "--best-mode", "min")


@pytest.fixture
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    """The tests that take `daemon` share one (conftest.shared_daemon), each with jobs of its own;
    those that need their own flags or a fresh one start theirs from `daemons`."""
    return shared_daemon


@pytest.fixture(scope="module")
def worker() -> ModuleType:
    """lightning_worker.py, imported by path (tests/integrations is no package)."""
    return _worker


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where `a` and `b` differ: types, keys and their order, tensor dtypes, shapes and values."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [f"{path}: tensors differ"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{path}: keys {list(a)} != {list(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}/{i}")]
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def clone(checkpoint: dict[str, Any]) -> dict[str, Any]:
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().clone())


class CheckingIO(CkptdCheckpointIO):
    """CkptdCheckpointIO that loads every checkpoint back right after saving it and records
    how it differs from what Lightning passed (read after the run)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.saved: dict[str, dict[str, Any]] = {}
        self.problems: list[str] = []
        self.repeats = 0  # saves of a step already saved under another path (their pointers carry a shape)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        expected = clone(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)
        self.saved[str(path)] = expected
        loaded = self.load_checkpoint(path)  # waits until the pointer is written
        self.repeats += "shape" in json.loads(Path(path).read_text())
        self.problems += [f"{path}{d}" for d in differences(loaded, expected)]
        if loaded["state_dict"]._metadata != checkpoint["state_dict"]._metadata:
            self.problems.append(f"{path}: state_dict metadata differs")


def pointer_steps(dirpath: Path) -> dict[str, int]:
    return {p.name: json.loads(p.read_text())["step"] for p in sorted(dirpath.glob("*.ckpt"))}


def ckptd_steps(address: str, job: str) -> set[int]:
    with CheckpointClient(job, address=address, rank=0, world_size=1) as client:
        return {info.step for info in client.list()}


def settled_steps(address: str, job: str, want: set[int]) -> set[int]:
    """The job's steps once they equal `want`, or as they are after 10 s (retention runs just
    after a commit is acknowledged, so it may lag a moment behind the last pointer)."""
    deadline = time.monotonic() + 10
    while (steps := ckptd_steps(address, job)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return steps


@pytest.mark.parametrize("save_last", [True, "link"])
def test_every_checkpoint_a_trainer_saves_loads_back_as_lightning_built_it(daemons, worker, tmp_path: Path, save_last: Any) -> None:
    daemon = daemons.start(*RETENTION)
    dirpath = tmp_path / "ckpts"
    io = CheckingIO(job="fit", address=daemon.address, on_error="raise")
    checkpoint = ModelCheckpoint(dirpath=dirpath, monitor="train_loss", save_top_k=2, save_last=save_last, every_n_train_steps=3)
    trainer = L.Trainer(max_steps=18, callbacks=[checkpoint], plugins=[io], logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert trainer.strategy.checkpoint_io is io
    trainer.fit(worker.TinyMLP(), worker.data())

    assert io.problems == []
    assert (io.repeats > 0) == (save_last is True)  # last.ckpt after the top-k file of the same step
    pointers = pointer_steps(dirpath)
    top_k = {Path(p).name for p in checkpoint.best_k_models}
    assert set(pointers) == top_k | {"last.ckpt"} and len(top_k) == 2
    removed = {Path(p).name for p in io.saved} - set(pointers)
    assert removed, "ModelCheckpoint removed no top-k file: the run is too short to test removal"
    assert (dirpath / "last.ckpt").is_symlink() == (save_last == "link")
    # retention with the metrics the plugin sends keeps exactly what the pointers name
    assert settled_steps(daemon.address, "fit", set(pointers.values())) == set(pointers.values())
    # at the end (after teardown) every pointer still loads as saved, last.ckpt through its link too
    for name in pointers:
        target = os.path.realpath(dirpath / name)
        assert differences(io.load_checkpoint(dirpath / name), io.saved[target]) == []
    loaded = io.load_checkpoint(checkpoint.best_model_path)
    assert all(isinstance(k, int) for k in loaded["optimizer_states"][0]["state"])
    assert isinstance(loaded["state_dict"], OrderedDict)
    # after fit (the plugin torn down), a save of the last step again: the step ckptd holds
    trainer.save_checkpoint(dirpath / "final.ckpt")
    assert io.problems == [] and json.loads((dirpath / "final.ckpt").read_text())["step"] == 18
    io.teardown()


# issue 31 item 7
def test_without_rng_hooks_a_resume_draws_as_the_uninterrupted_run_and_load_from_checkpoint_reads_pointers(daemon, worker, tmp_path: Path, one_thread: None) -> None:
    """A module without on_save/on_load_checkpoint hooks (dropout, a shuffled loader): resumed
    from step 5, steps 6-10 have the uninterrupted run's losses because the plugin restores the
    generators (with rng=False they do not); Model.load_from_checkpoint on a pointer gives the
    saved weights and hyper-parameters."""

    def spec(name: str, **changes: Any) -> dict[str, Any]:
        base = {"address": daemon.address, "job": name, "dirpath": str(tmp_path / name), "out": str(tmp_path / f"{name}.jsonl"),
                "max_steps": 10, "every": 5, "ckpt_path": None, "pause_at": 0, "hooks": False}
        return {**base, **changes}

    def losses(name: str) -> dict[int, float]:
        return {line["step"]: line["loss"] for line in map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())}

    worker.train(spec("ref"))
    for name, rng in (("run", True), ("norng", False)):
        worker.train(spec(name, max_steps=5, rng=rng))
        worker.train(spec(name, ckpt_path="last", rng=rng))
    ref = losses("ref")
    assert [losses("run")[s] for s in range(6, 11)] == [ref[s] for s in range(6, 11)]
    assert [losses("norng")[s] for s in range(6, 11)] != [ref[s] for s in range(6, 11)]

    pointer = tmp_path / "run" / "epoch=0-step=5.ckpt"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker.MLP, "ckptd_address", daemon.address)
        model = worker.MLP.load_from_checkpoint(pointer)
        with pytest.raises(RuntimeError, match=r"size mismatch for net.0.weight.*\[16, 6\].*\[32, 6\]"):
            worker.MLP.load_from_checkpoint(pointer, hidden=32)  # kwargs override the saved hyper-parameters
    saved = CkptdCheckpointIO(job="run", address=daemon.address).load_checkpoint(pointer)["state_dict"]
    assert type(model) is worker.MLP and model.hparams.hidden == 16
    assert differences(model.state_dict(), saved) == []
    with pytest.raises(TypeError, match="ckptd pointer.*not hparams_file"):
        worker.MLP.load_from_checkpoint(pointer, hparams_file=tmp_path / "h.yaml")
    plain = {"pytorch-lightning_version": L.__version__, "state_dict": model.state_dict(), "hyper_parameters": {"hidden": 16}}
    torch.save(plain, tmp_path / "plain.ckpt")  # not a pointer: Lightning's own load_from_checkpoint
    assert differences(worker.MLP.load_from_checkpoint(tmp_path / "plain.ckpt").state_dict(), saved) == []


@pytest.mark.slow
def test_a_run_killed_after_a_durable_save_resumes_with_the_losses_of_an_uninterrupted_one(daemons, worker, tmp_path: Path, one_thread: None) -> None:
    daemon = daemons.start(*RETENTION)

    def spec(name: str, **changes: Any) -> dict[str, Any]:
        base = {"address": daemon.address, "job": name, "dirpath": str(tmp_path / name), "out": str(tmp_path / f"{name}.jsonl"),
                "max_steps": 25, "every": 5, "ckpt_path": None, "pause_at": 0}
        return {**base, **changes}

    def losses(name: str) -> dict[int, float]:
        lines = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        return {line["step"]: line["loss"] for line in lines}

    killed = subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec("run", pause_at=10))], stdout=subprocess.PIPE, text=True)
    try:
        worker.train(spec("ref"))  # the uninterrupted run, meanwhile
        assert killed.stdout is not None and killed.stdout.readline().strip() == "DURABLE 10"
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
    assert killed.returncode == -signal.SIGKILL
    before = losses("run")
    assert max(before) == 10 and all(before[s] == losses("ref")[s] for s in before)
    assert pointer_steps(tmp_path / "run")["last.ckpt"] == 10

    worker.train(spec("run", ckpt_path="last"))  # a new Trainer, plugin and client, as a restarted process has them
    ref, resumed = losses("ref"), losses("run")
    assert max(resumed) == 25
    assert [resumed[s] for s in range(11, 26)] == [ref[s] for s in range(11, 26)]

    # ModelCheckpoint decided alike in both runs; its removals removed the pointers
    assert pointer_steps(tmp_path / "run") == pointer_steps(tmp_path / "ref")
    assert not (tmp_path / "run" / "epoch=1-step=10.ckpt").exists()
    for job in ("ref", "run"):
        want = set(pointer_steps(tmp_path / job).values())
        assert settled_steps(daemon.address, job, want) == want
    io = CkptdCheckpointIO(job="reader", address=daemon.address)
    for name in pointer_steps(tmp_path / "run"):
        a, b = io.load_checkpoint(tmp_path / "run" / name), io.load_checkpoint(tmp_path / "ref" / name)
        assert differences(a["state_dict"], b["state_dict"]) == [] and differences(a["optimizer_states"], b["optimizer_states"]) == []

    # an explicit top-k path of job "run", resumed into a new job: the same losses after it
    best = tmp_path / "run" / "epoch=3-step=20.ckpt"
    assert best.exists()
    worker.train(spec("from-best", ckpt_path=str(best), dirpath=str(tmp_path / "from-best")))
    assert [losses("from-best")[s] for s in range(21, 26)] == [ref[s] for s in range(21, 26)]
    io.teardown()


# issue 30 finding 7
@pytest.mark.slow
def test_a_run_killed_between_a_commit_and_its_pointer_resumes_from_the_newest_step(
    daemons, worker, tmp_path: Path, one_thread: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 15 is committed but the run dies before last.ckpt names it (pointers from 15 on are
    held back, then SIGKILL): ckpt_path="last" loads step 15, not the 10 that last.ckpt names,
    and the run goes on as an uninterrupted one, without redoing 11..15. A later resume from an
    earlier pointer of the job redoes steps the job holds: their saves keep the held steps."""
    daemon = daemons.start("--keep-last", "0")

    def spec(name: str, **changes: Any) -> dict[str, Any]:
        base = {"address": daemon.address, "job": "run" if name != "ref" else "ref", "dirpath": str(tmp_path / ("ref" if name == "ref" else "run")),
                "out": str(tmp_path / f"{name}.jsonl"), "max_steps": 25, "every": 5, "ckpt_path": None, "pause_at": 0}
        return {**base, **changes}

    def lines(name: str) -> list[tuple[int, float]]:
        return [(line["step"], line["loss"]) for line in map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())]

    killed = subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec("killed", committed_at=15, stall_pointers_from=15))], stdout=subprocess.PIPE, text=True)
    try:
        worker.train(spec("ref"))  # the uninterrupted run, meanwhile
        assert killed.stdout is not None and killed.stdout.readline().strip() == "COMMITTED 15"
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
    ref = dict(lines("ref"))
    assert [s for s, _ in lines("killed")] == list(range(1, 16))
    assert pointer_steps(tmp_path / "run")["last.ckpt"] == 10 and 15 in ckptd_steps(daemon.address, "run")

    with caplog.at_level(logging.WARNING, logger="ckptd.integrations.lightning"):
        worker.train(spec("resumed", ckpt_path="last"))
    assert any("last.ckpt names step 10 of ckptd job 'run', whose newest committed step is 15" in r.getMessage() for r in caplog.records)
    assert lines("resumed") == [(s, ref[s]) for s in range(16, 26)]  # from 15 on, nothing redone, as uninterrupted
    assert pointer_steps(tmp_path / "run")["last.ckpt"] == 25

    earlier = min(pointer_steps(tmp_path / "run").items(), key=lambda item: item[1])
    assert earlier[1] < 25, pointer_steps(tmp_path / "run")
    held = {step: (daemon.root / "run" / f"step-{step:08d}" / "ckptd.index.json").read_bytes() for step in ckptd_steps(daemon.address, "run")}
    worker.train(spec("again", ckpt_path=str(tmp_path / "run" / earlier[0])))  # redoes earlier+1..25: saves steps the job holds
    assert lines("again") == [(s, ref[s]) for s in range(earlier[1] + 1, 26)]
    assert {step: (daemon.root / "run" / f"step-{step:08d}" / "ckptd.index.json").read_bytes() for step in held} == held  # kept, not rewritten
    assert pointer_steps(tmp_path / "run")["last.ckpt"] == 25


@pytest.mark.slow
def test_a_ddp_run_killed_after_a_durable_save_resumes_with_the_losses_of_an_uninterrupted_one(daemons, tmp_path: Path) -> None:
    """2 processes of Lightning's DDP (CPU, gloo), 4 samples per rank and batch (5 batches per
    epoch, checkpoints at epoch ends): global rank 0 saves, both ranks load step 10 back from
    the one daemon at the same time."""
    daemon = daemons.start(*RETENTION)

    def spec(name: str, **changes: Any) -> dict[str, Any]:
        base = {"address": daemon.address, "job": name, "dirpath": str(tmp_path / name), "out": str(tmp_path / f"{name}.jsonl"),
                "max_steps": 20, "every": 5, "batch": 4, "ckpt_path": None, "pause_at": 0}
        return {**base, **changes}

    def losses(name: str) -> dict[int, float]:
        lines = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        return {line["step"]: line["loss"] for line in lines}

    killed = start_ranks(spec("run", pause_at=10))
    try:
        finish(start_ranks(spec("ref")))  # the uninterrupted run, meanwhile
        assert killed[0].stdout is not None and killed[0].stdout.readline().strip() == "DURABLE 10"
    finally:
        kill(killed)  # every process of the run: SIGKILL
    assert [p.returncode for p in killed] == [-signal.SIGKILL] * 2
    ref, before = losses("ref"), losses("run")
    assert sorted(ref) == list(range(1, 21)) and len(set(ref.values())) == 20
    assert max(before) == 10 and all(before[s] == ref[s] for s in before)
    assert pointer_steps(tmp_path / "run")["last.ckpt"] == 10

    finish(start_ranks(spec("run", ckpt_path="last")))  # new processes, Trainer, plugin and clients
    resumed = losses("run")
    assert max(resumed) == 20
    assert [resumed[s] for s in range(11, 21)] == [ref[s] for s in range(11, 21)]

    # ModelCheckpoint (monitoring the loss averaged over the ranks) decided alike in both runs
    assert pointer_steps(tmp_path / "run") == pointer_steps(tmp_path / "ref")
    for job in ("ref", "run"):
        want = set(pointer_steps(tmp_path / job).values())
        assert settled_steps(daemon.address, job, want) == want
    io = CkptdCheckpointIO(job="reader", address=daemon.address)
    for name in pointer_steps(tmp_path / "run"):
        a, b = io.load_checkpoint(tmp_path / "run" / name), io.load_checkpoint(tmp_path / "ref" / name)
        assert differences(a["state_dict"], b["state_dict"]) == [] and differences(a["optimizer_states"], b["optimizer_states"]) == []
    io.teardown()


# issue 31 item 1 (ddp_spawn)
@pytest.mark.long  # ~100 s on 2 cores: pytest -m long (the plugin's copy is checked by the default run's refusal test)
def test_a_ddp_spawn_run_killed_resumes_with_the_losses_of_an_uninterrupted_one_and_hands_its_weights_back(daemons, tmp_path: Path) -> None:
    """strategy="ddp_spawn" (2 processes that Lightning starts by multiprocessing from the
    worker's main process, which pickles the Trainer with the plugin: only its configuration
    travels): SIGKILLed with its workers after step 10 is durable, resumed with
    ckpt_path="last": the losses of steps 11-20 are an uninterrupted ddp_spawn run's, and the
    main process gets the trained weights back (through the plugin, never the daemon)."""
    daemon = daemons.start(*RETENTION)

    def spec(name: str, **changes: Any) -> dict[str, Any]:
        base = {"address": daemon.address, "job": name, "dirpath": str(tmp_path / name), "out": str(tmp_path / f"{name}.jsonl"),
                "max_steps": 20, "every": 5, "batch": 4, "ckpt_path": None, "pause_at": 0, "spawn": True, "devices": 2}
        return {**base, **changes}

    def run(body: dict[str, Any], **kwargs: Any) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, str(WORKER), json.dumps(body)], text=True, start_new_session=True, **kwargs)

    def losses(name: str) -> dict[int, float]:
        return {line["step"]: line["loss"] for line in map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())}

    killed = run(spec("run", pause_at=10), stdout=subprocess.PIPE)
    try:
        assert run(spec("ref")).wait(timeout=300) == 0  # the uninterrupted run, meanwhile
        assert killed.stdout is not None and killed.stdout.readline().strip() == "DURABLE 10"
    finally:
        os.killpg(killed.pid, signal.SIGKILL)  # the main process and its workers
        killed.wait(timeout=30)
    ref = losses("ref")
    assert sorted(ref) == list(range(1, 21)) and max(losses("run")) == 10 and pointer_steps(tmp_path / "run")["last.ckpt"] == 10

    assert run(spec("run", ckpt_path="last", handback=str(tmp_path / "handback.safetensors"))).wait(timeout=300) == 0
    resumed = losses("run")
    assert [resumed[s] for s in range(11, 21)] == [ref[s] for s in range(11, 21)]
    io = CkptdCheckpointIO(job="reader", address=daemon.address)
    final = io.load_checkpoint(tmp_path / "run" / "last.ckpt")
    io.teardown()
    assert final["global_step"] == 20
    from safetensors.torch import load_file

    handed_back = load_file(tmp_path / "handback.safetensors")
    assert differences(dict(sorted(handed_back.items())), dict(sorted(final["state_dict"].items()))) == []  # safetensors sorts the names


def test_saves_that_could_not_be_loaded_back_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's own sharding strategies, a save on a rank other than 0, and a pointer another
    rank cannot see: refused before anything reaches a daemon. A copy of the plugin keeps its
    configuration only."""
    io = CkptdCheckpointIO(job="refused", address="unix:///nonexistent/ckptd.sock", on_error="raise")
    model, optimizer = _trained()
    good = _checkpoint(model, optimizer, 1, "x")
    with pytest.raises(RuntimeError, match="does not work with FSDPStrategy: that strategy shards the model.*CkptdModelParallelStrategy"):
        FSDPStrategy(checkpoint_io=io).save_checkpoint(good, tmp_path / "x.ckpt")  # through Lightning's Strategy
    copied = copy.deepcopy(io)  # what strategy="ddp_spawn" does to the plugins, through pickle: the configuration only
    assert (copied.job, copied.address, copied.on_error, copied.rng) == (io.job, io.address, io.on_error, io.rng)
    assert copied._client is None and copied._writer is not io._writer

    # global rank 1 of 2, as torch.distributed would say under DDP
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(RuntimeError, match="called on global rank 1 of 2; it saves the whole checkpoint from global rank 0"):
        io.save_checkpoint(good, tmp_path / "x.ckpt")
    with pytest.raises(FileNotFoundError, match=r"missing.ckpt \(on global rank 1 of 2\).*every rank sees: on several nodes, a shared file system"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    assert not (tmp_path / "x.ckpt").exists()


def _checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, note: str) -> dict[str, Any]:
    """A checkpoint dict shaped as Lightning's."""
    return {
        "epoch": 0, "global_step": step, "pytorch-lightning_version": L.__version__,
        "state_dict": model.state_dict(), "loops": {"fit_loop": {"epoch_loop.state_dict": {"_batches_that_stepped": step}}},
        "callbacks": {"Note": {"note": note, "score": torch.tensor(0.5)}}, "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [], "hyper_parameters": {"hidden": 3, "betas": (0.9, 0.99)},
    }


# a new user's probe, 2026-12-01: ckpt_path="last" followed the job's newest step, another ModelCheckpoint's weights-only one
def test_a_last_checkpoint_does_not_follow_a_newer_step_that_lacks_its_parts(daemon, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, optimizer = _trained()
    io = CkptdCheckpointIO(job="last-wo", address=daemon.address, on_error="raise")
    io.save_checkpoint(_checkpoint(model, optimizer, 10, "full"), tmp_path / "last.ckpt")
    weights_only = _weights_only(model, optimizer, 12)
    io.save_checkpoint(weights_only, tmp_path / "wo" / "epoch=0-step=12.ckpt")
    io.teardown()
    with caplog.at_level(logging.WARNING, logger="ckptd.integrations.lightning"):
        loaded = CkptdCheckpointIO(job="last-wo", address=daemon.address).load_checkpoint(tmp_path / "last.ckpt")
    assert loaded["global_step"] == 10 and "optimizer_states" in loaded
    assert "the job's newest committed step 12 lacks its callbacks, optimizer_states" in caplog.text


# a new user's probe, 2026-12-01: killed after a durable top-k save and before its pointer, the resumed
# run's best_model_path named a file that never appeared
def test_a_resume_writes_the_pointer_the_stopped_run_did_not(daemon, tmp_path: Path) -> None:
    model, optimizer = _trained()
    best = str(tmp_path / "epoch=0-step=8.ckpt")
    io = CkptdCheckpointIO(job="healed", address=daemon.address, on_error="raise")
    io.save_checkpoint(_checkpoint(model, optimizer, 4, "four"), tmp_path / "last.ckpt")
    eight = _checkpoint(model, optimizer, 8, "eight")
    eight["callbacks"]["ModelCheckpoint{'monitor': 'loss'}"] = {"best_model_path": best, "best_k_models": {best: torch.tensor(0.1)}}
    io.save_checkpoint(eight, best)
    io.teardown()
    os.remove(best)  # as if the run was killed before this pointer was written
    loaded = CkptdCheckpointIO(job="healed", address=daemon.address).load_checkpoint(tmp_path / "last.ckpt")
    assert loaded["global_step"] == 8 and os.path.exists(best)
    assert CkptdCheckpointIO(job="healed", address=daemon.address).load_checkpoint(best)["global_step"] == 8


def test_a_redone_step_kept_weights_only_gets_no_full_pointer(daemon, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, optimizer = _trained()
    first = CkptdCheckpointIO(job="kept-wo", address=daemon.address, on_error="raise")
    first.save_checkpoint(_checkpoint(model, optimizer, 10, "full"), tmp_path / "ten.ckpt")
    weights_only = _weights_only(model, optimizer, 12)
    first.save_checkpoint(weights_only, tmp_path / "wo" / "twelve.ckpt")
    first.teardown()
    resumed = CkptdCheckpointIO(job="kept-wo", address=daemon.address, on_error="raise")
    assert resumed.load_checkpoint(tmp_path / "ten.ckpt")["global_step"] == 10  # a resume from 10
    with caplog.at_level(logging.WARNING, logger="ckptd.integrations.lightning"):
        resumed.save_checkpoint(_checkpoint(model, optimizer, 12, "redone"), tmp_path / "last.ckpt")  # the daemon keeps its 12
        resumed.teardown()
    assert not (tmp_path / "last.ckpt").exists() and "lacks its callbacks, optimizer_states" in caplog.text


def _weights_only(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """What save_checkpoint(weights_only=True) hands over: no optimizer states, no callbacks."""
    return {k: v for k, v in _checkpoint(model, optimizer, step, "weights").items() if k not in ("optimizer_states", "callbacks")}


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_second_save_of_a_step_keeps_its_own_bookkeeping_and_small_tensors_and_refuses_other_tensors(daemon, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, optimizer = _trained()
    io = CkptdCheckpointIO(job="same", address=daemon.address, on_error="raise")
    first, second = _checkpoint(model, optimizer, 7, "first"), _checkpoint(model, optimizer, 7, "second")
    expected = {"a.ckpt": clone(first), "b.ckpt": clone(second)}
    io.save_checkpoint(first, tmp_path / "a.ckpt")
    io.save_checkpoint(second, tmp_path / "b.ckpt")  # the same step: not handed over again
    for name, want in expected.items():
        loaded = io.load_checkpoint(tmp_path / name)
        assert differences(loaded, want) == [] and loaded["epoch"] == 0
    assert "shape" not in json.loads((tmp_path / "a.ckpt").read_text())
    assert set(json.loads((tmp_path / "b.ckpt").read_text())["shape"]["trees"]) == {"lightning"}  # only what differs
    assert ckptd_steps(daemon.address, "same") == {7}

    # two ModelCheckpoints meeting at a step (a probe: fit died): the second's own small tensors
    # (its best_model_score, a new best_k_models entry) differ; its pointer carries them
    changed_score = _checkpoint(model, optimizer, 7, "first")
    changed_score["callbacks"]["Note"]["score"] = torch.tensor(0.25)
    changed_score["callbacks"]["Best"] = {"best_k_models": {"c.ckpt": torch.tensor(1.5, dtype=torch.float64)}, "current": torch.arange(3)}
    expected["c.ckpt"] = clone(changed_score)
    io.save_checkpoint(changed_score, tmp_path / "c.ckpt")
    io.teardown()  # the pointers are written
    carried = json.loads((tmp_path / "c.ckpt").read_text())["shape"]["tensors"]
    assert set(carried) == {"lightning/callbacks/Note/score", "lightning/callbacks/Best/best_k_models/c.ckpt", "lightning/callbacks/Best/current"}
    for name, want in expected.items():
        loaded = io.load_checkpoint(tmp_path / name)
        assert differences(loaded, want) == [], name
    assert ckptd_steps(daemon.address, "same") == {7}
    with torch.no_grad():
        model[0].weight.add_(1.0)
    with pytest.raises(ValueError, match="global_step 7 was already saved.*'model/0.weight' changed"):
        io.save_checkpoint(_checkpoint(model, optimizer, 7, "first"), tmp_path / "c.ckpt")

    # on_error="warn" (the default): training goes on, that file is not written (a new user's probe: it crashed fit)
    warned = CkptdCheckpointIO(job="same-warn", address=daemon.address)
    warned.save_checkpoint(_checkpoint(model, optimizer, 9, "full"), tmp_path / "full.ckpt")
    weights_only = _weights_only(model, optimizer, 9)
    with caplog.at_level(logging.WARNING, logger="ckptd.integrations.lightning"):
        warned.save_checkpoint(weights_only, tmp_path / "weights.ckpt")
    assert "a weights-only save of a step saved in full?" in caplog.text and "weights.ckpt is not written" in caplog.text
    warned.save_checkpoint(_weights_only(model, optimizer, 11), tmp_path / "wo-11.ckpt")  # weights only first, then in full:
    with pytest.raises(ValueError, match="global_step 11 was already saved"):  # every full save would be left out: raised
        warned.save_checkpoint(_checkpoint(model, optimizer, 11, "full"), tmp_path / "full-11.ckpt")
    warned.teardown()
    assert (tmp_path / "full.ckpt").exists() and not (tmp_path / "weights.ckpt").exists()

    # a removal before the pointer is written withdraws it
    io.save_checkpoint(_checkpoint(model, optimizer, 8, "x"), tmp_path / "gone.ckpt")
    io.remove_checkpoint(tmp_path / "gone.ckpt")
    io.teardown()
    assert not (tmp_path / "gone.ckpt").exists()

    # a new run that loaded nothing (a fresh start under a used job name) saving a step the job holds: refused, saying why
    again = _checkpoint(model, optimizer, 7, "first")
    with pytest.raises(CheckpointError, match="step 7 of job 'same' is already committed.*loaded no step of the job.*new job name"):
        CkptdCheckpointIO(job="same", address=daemon.address, on_error="raise").save_checkpoint(again, tmp_path / "again.ckpt")
    warn = CkptdCheckpointIO(job="same", address=daemon.address)
    warn.save_checkpoint(again, tmp_path / "again.ckpt")  # logged, training goes on
    warn.teardown()
    assert not (tmp_path / "again.ckpt").exists()

    # map_location as torch.load takes it
    for where in ("cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda storage, location: storage):
        assert io.load_checkpoint(tmp_path / "a.ckpt", map_location=where)["state_dict"]["0.weight"].device.type == "cpu"
    io.teardown()


def test_bad_paths_and_checkpoints_give_clear_errors(daemon, tmp_path: Path) -> None:
    io = CkptdCheckpointIO(job="bad", address=daemon.address, on_error="raise")
    model, optimizer = _trained()

    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    archive = tmp_path / "torch.ckpt"
    with zipfile.ZipFile(archive, "w") as z:  # torch's serialization writes a zip archive
        z.writestr("archive/data.pkl", b"")
    with pytest.raises(ValueError, match="not a ckptd checkpoint pointer: .*torch.ckpt: .*TorchCheckpointIO"):
        io.load_checkpoint(archive)
    cases = {
        "text.ckpt": ("hello", "not JSON"),
        "other.ckpt": ('{"a": 1}', "without \"format\""),
        "job.ckpt": ('{"format": "ckptd-lightning-pointer", "version": 1, "job": "../x", "step": 1}', "invalid job id"),
        "step.ckpt": ('{"format": "ckptd-lightning-pointer", "version": 1, "job": "bad", "step": -1}', "not an integer >= 0"),
        "newer.ckpt": ('{"format": "ckptd-lightning-pointer", "version": 9, "job": "bad", "step": 1}', "newer ckptd"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"not a ckptd checkpoint pointer: .*{name}: .*{message}"):
            io.load_checkpoint(tmp_path / name)
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(ValueError, match="not a ckptd checkpoint pointer: .*a directory"):
        io.load_checkpoint(tmp_path / "dir.ckpt")

    (tmp_path / "absent.ckpt").write_text('{"format": "ckptd-lightning-pointer", "version": 1, "job": "bad", "step": 99}')
    with pytest.raises(FileNotFoundError, match=r"names step 99 of ckptd job 'bad', which the daemon .* does not hold \(the job's steps: none\)"):
        io.load_checkpoint(tmp_path / "absent.ckpt")
    with CheckpointClient("plain", address=daemon.address, on_error="raise") as client:  # a step saved without the plugin
        client.save(3, {"model": model}).wait_durable(timeout=60)
    (tmp_path / "plain.ckpt").write_text('{"format": "ckptd-lightning-pointer", "version": 1, "job": "plain", "step": 3}')
    with pytest.raises(ValueError, match="names step 3 of ckptd job 'plain', which CkptdCheckpointIO did not save"):
        io.load_checkpoint(tmp_path / "plain.ckpt")

    good = _checkpoint(model, optimizer, 1, "x")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(good, tmp_path / "x.ckpt", storage_options={"a": 1})
    with pytest.raises(ValueError, match="is a URL"):
        io.save_checkpoint(good, "s3://bucket/x.ckpt")
    with pytest.raises(ValueError, match="'global_step' is None"):
        io.save_checkpoint({k: v for k, v in good.items() if k != "global_step"}, tmp_path / "x.ckpt")
    unpicklable = {**good, "hyper_parameters": {"loss_fn": torch.nn.MSELoss()}}
    with pytest.raises(TypeError, match="'lightning/hyper_parameters/loss_fn': a value of type torch.nn.modules.loss.MSELoss.*never pickles"):
        io.save_checkpoint(unpicklable, tmp_path / "x.ckpt")
    with pytest.raises(TypeError, match="tensor 'lightning/extra'.*complex64"):
        io.save_checkpoint({**good, "extra": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "x.ckpt")
    (tmp_path / "a-file").write_text("")  # a pointer that cannot be written: raised at the next call
    io.save_checkpoint(_checkpoint(model, optimizer, 2, "x"), tmp_path / "a-file" / "x.ckpt")
    with pytest.raises(CheckpointError, match="pointer file was not written"):
        io.wait_durable()
    with pytest.raises(ValueError, match="invalid job id"):
        CkptdCheckpointIO(job="no spaces")
    with pytest.raises(ValueError, match="on_error"):
        CkptdCheckpointIO(job="j", on_error="ignore")
    io.teardown()
    assert not (tmp_path / "x.ckpt").exists()
