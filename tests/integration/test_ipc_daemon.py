"""Mode "ipc" end to end on CPU: a real daemon opens the rank's staging buffer and drains it.

The client runs under the strict CUDA stand-in (tests/fakecuda.py) with SharedDeviceLib, whose
device memory lives in files; the daemon (tests/fake_gpu_daemon.py) loads the same library as its
CUDA runtime, so it opens the 64-byte IPC handle in its own process and copies the buffer into
its arenas with cudaMemcpy, the stand-in's rules enforced on both sides. Without it a daemon on
a CPU machine refuses the buffer and the client falls back to "overlap"
(tests/integration/test_gpu_handoff.py).
"""

from __future__ import annotations

import shutil
import tempfile
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
