"""The GPU modes end to end on CPU against a real daemon: "ipc" (the daemon opens the rank's
staging buffer and drains it) and the save path's work per save in "overlap".

The client runs under the strict CUDA stand-in (tests/fakecuda.py) with SharedDeviceLib, whose
device memory lives in files; the daemon (tests/fake_gpu_daemon.py) loads the same library as its
CUDA runtime, so it opens the 64-byte IPC handle in its own process and copies the buffer into
its arenas with cudaMemcpy, the stand-in's rules enforced on both sides. Without it a daemon on
a CPU machine refuses the buffer and the client falls back to "overlap"
(tests/integration/test_gpu_handoff.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import fake_gpu_daemon  # tests/fake_gpu_daemon.py (tests/conftest.py puts tests/ on the import path)
import fakecuda
from ckptd.client import CheckpointClient


@pytest.fixture
def gpu_daemon(tmp_path: Path) -> Iterator[tuple[Any, Path]]:
    """A daemon with the stand-in's shared device memory as its CUDA runtime, and that memory's directory."""
    device_dir = tmp_path / "device"
    device_dir.mkdir()
    shm_dir = Path(tempfile.mkdtemp(prefix="ckptd-test-", dir="/dev/shm"))
    sock_dir = Path(tempfile.mkdtemp(prefix="ckptd-t-"))
    daemon = fake_gpu_daemon.start(tmp_path / "root", sock_dir / "d.sock", shm_dir, device_dir, tmp_path / "daemon.log")
    try:
        yield daemon, device_dir
    finally:
        daemon.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_ipc_saves_through_the_staging_buffer_the_daemon_opened(gpu_daemon, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    daemon, device_dir = gpu_daemon
    cuda = fakecuda.FakeCuda(lib=fakecuda.SharedDeviceLib(str(device_dir))).install(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    state = {
        "model": {f"w{i}": cuda.to_device(torch.randn(n, generator=gen)) for i, n in enumerate([300, 5000, 64, 2048])},
        "extra": {"cpu": torch.arange(10.0)},  # a CPU tensor: the shared-memory copy beside the staging buffer
    }
    saved = {}
    with CheckpointClient("ipc", address=daemon.address, rank=0, world_size=1, mode="ipc", on_error="raise") as ckpt:
        for step in (1, 2, 3):
            with torch.no_grad():
                for t in state["model"].values():
                    t.add_(1.0)
            handle = ckpt.save(step, state)
            assert handle.mode == "ipc" and ckpt.mode_in_use == "ipc", ckpt.mode_reason
            assert handle.wait_durable(timeout=60) is not None
            saved[step] = {k: v.clone() for k, v in state["model"].items()}
        assert len(cuda.lib.allocations) == 1  # one staging buffer, opened by the daemon once, reused by every save
        assert not any(c.kind == "D2H" for c in cuda.copies)  # the client copied device to device only
    for step in (2, 3):  # held in the daemon's memory (3) and read from its files (2): bit-exact
        target = {"model": {k: torch.zeros_like(v) for k, v in saved[step].items()}, "extra": {"cpu": torch.zeros(10)}}
        with CheckpointClient("ipc", address=daemon.address, rank=0, world_size=1, on_error="raise") as reader:
            assert reader.load(target, step=step) == step
        assert all(torch.equal(target["model"][k], v) for k, v in saved[step].items())
        assert torch.equal(target["extra"]["cpu"], torch.arange(10.0))


# The trainer's process, under the stand-in: saves once in mode "ipc", then dies by SIGKILL with
# its staging buffer open (a killed trainer never closes it).
KILLED_WITH_ITS_BUFFER_OPEN = """
import os, signal, sys
import pytest, torch
sys.path.insert(0, sys.argv[3])
import fakecuda
from ckptd.client import CheckpointClient
cuda = fakecuda.FakeCuda(lib=fakecuda.SharedDeviceLib(sys.argv[2])).install(pytest.MonkeyPatch())
state = {"model": {"w": cuda.to_device(torch.arange(4096.0))}}
ckpt = CheckpointClient("killed", address=sys.argv[1], rank=0, world_size=1, mode="ipc", on_error="raise")
handle = ckpt.save(1, state)
assert handle.mode == "ipc", ckpt.mode_reason
handle.wait_durable(timeout=60)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_trainers_staging_buffer_is_closed_when_its_client_ends(gpu_daemon) -> None:  # noqa: ANN001
    """The daemon's mapping of a staging buffer keeps the trainer's GPU memory allocated after the
    trainer died: it is closed when the client's Attach call ends, not at the job's next save."""
    daemon, device_dir = gpu_daemon
    tests_dir = str(Path(fakecuda.__file__).parent)
    killed = subprocess.run([sys.executable, "-c", KILLED_WITH_ITS_BUFFER_OPEN, daemon.address, str(device_dir), tests_dir],
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    assert "opened the staging buffer of job killed rank 0" in daemon.log_text()
    deadline = time.monotonic() + 10
    while "closing the staging buffer of job killed rank 0: its client ended" not in daemon.log_text():
        assert time.monotonic() < deadline, daemon.log_text()[-2000:]
        time.sleep(0.1)


def _counted(cuda: "fakecuda.FakeCuda", counts: dict[str, int]) -> None:
    """Count the torch-level device operations the client issues (before cuda.install); the
    pairs of a foreach copy, which the stand-in copies one by one, are not counted again."""
    inside: list[bool] = []
    for name in ("copy", "foreach_copy", "new_event"):
        fn = getattr(cuda, name)

        def counting(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            if inside:
                return _fn(*args, **kwargs)
            counts[_name] = counts.get(_name, 0) + 1
            inside.append(True)
            try:
                return _fn(*args, **kwargs)
            finally:
                inside.pop()

        setattr(cuda, name, counting)


@pytest.mark.parametrize("mode", ["overlap", "ipc"])
def test_a_save_issues_the_same_few_operations_whatever_the_number_of_tensors(gpu_daemon, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:  # noqa: ANN001
    daemon, device_dir = gpu_daemon
    cuda = fakecuda.FakeCuda(lib=fakecuda.SharedDeviceLib(str(device_dir)))
    counts: dict[str, int] = {}
    _counted(cuda, counts)
    cuda.install(monkeypatch)
    per_save = {}
    for n in (40, 400):
        state = {"model": {f"w{i}": cuda.to_device(torch.full((64,), float(i))) for i in range(n)}}
        with CheckpointClient(f"ops-{mode}-{n}", address=daemon.address, rank=0, world_size=1, mode=mode, on_error="raise") as ckpt:
            for step in (1, 2, 3):  # the first save of each of the daemon's two arena sets maps (and page-locks) it
                assert ckpt.save(step, state).wait_durable(timeout=60) is not None
            registered = len(cuda.lib.register_calls)
            seen = []
            for step in (4, 5, 6):
                counts.clear()
                handle = ckpt.save(step, state)
                handle.wait_snapshot(host=True)
                seen.append(dict(counts))
                assert handle.mode == mode and handle.wait_durable(timeout=60) is not None
            assert len(cuda.lib.register_calls) == registered  # nothing page-locked on the save path after the first saves
        assert seen[0] == seen[1] == seen[2]  # the plan is reused: every save issues the same operations
        per_save[n] = seen[0]
    # one foreach pack per group of small tensors, one event per copy group: not one operation per tensor
    assert per_save[40] == per_save[400], per_save
    assert per_save[400].get("foreach_copy", 0) <= 2 and per_save[400].get("new_event", 0) <= 6, per_save
