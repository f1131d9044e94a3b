"""A CPU stand-in for CUDA behind the client's DeviceBackend seam (ckptd.client.handoff).

Chosen CPU tensors play "device" tensors. Copies run the real plan (ckptd.client.devcopy) on a
worker thread that first waits for `gate` (so tests can hold a copy "in flight"); a fence
records itself and, like a stream waiting on an event, lets nothing after it run before the
copy is done (here: it waits). Also runnable as a script for crash tests:

    python fake_device.py die-mid-overlap ADDRESS JOB STEP   # overlap save whose copy never ends, then SIGKILL
"""

from __future__ import annotations

import mmap
import os
import signal
import sys
import threading
from typing import Any, Sequence

import torch

from ckptd.client.devcopy import item_of, plan_copies, run_copies
from ckptd.client.ipc import IpcUnavailable


class FakeCopy:
    def __init__(self, backend: "FakeBackend", label: str, work: Any) -> None:
        self.backend = backend
        self.label = label
        self.operations = 1
        self._done = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            if backend.hold is None or label in backend.hold:
                backend.gate.wait()
            try:
                if backend.fail_copies:
                    raise RuntimeError("simulated device error")
                work()
            except BaseException as exc:
                self.error = exc
            self._done.set()

        threading.Thread(target=run, daemon=True).start()

    def wait(self) -> None:
        if not self._done.wait(60):
            raise TimeoutError("fake copy never finished")
        if self.error is not None:
            raise self.error

    def fence(self, host: bool = False) -> None:
        self.backend.events.append(("fence", self.label, host))
        self._done.wait(60)


class FakeStaging:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.device = torch.device("cpu")
        self.uuid = "0" * 32
        self.handle = b"\x01" * 64
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8)
        self.staging_id = ""
        self.freed = False

    def free(self) -> None:
        self.freed = True


class FakeBackend:
    """owns(): the tensors passed in (by their memory); everything else is a CPU tensor."""

    def __init__(self, device_tensors: Sequence[torch.Tensor], staging_error: str | None = None) -> None:
        self.ptrs = {t.data_ptr() for t in device_tensors if t.numel()}
        self.gate = threading.Event()
        self.gate.set()
        self.hold: set[str] | None = None  # labels of the copies that wait for the gate (None: all)
        self.events: list[tuple] = []
        self.staging_error = staging_error
        self.stagings: list[FakeStaging] = []
        self.fail_copies = False
        self._maps: dict[str, mmap.mmap] = {}
        self.closed = False

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() > 0 and tensor.data_ptr() in self.ptrs

    def host_view(self, path: str, size: int) -> torch.Tensor:
        if path not in self._maps:
            fd = os.open(path, os.O_RDWR)
            try:
                self._maps[path] = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
        return torch.frombuffer(self._maps[path], dtype=torch.uint8)

    def copy(self, placements: Sequence[tuple[torch.Tensor, int, int]], dst: torch.Tensor, only: set[int]) -> FakeCopy:
        items = [item_of(t, off, n, "fake" if i in only else None) for i, (t, off, n) in enumerate(placements)]
        plan = plan_copies(items, small_bytes=4096)
        sources = [t for t, _, _ in placements]
        names = sorted(only)
        self.events.append(("copy", names))
        return FakeCopy(self, f"copy{len([e for e in self.events if e[0] == 'copy'])}", lambda: run_copies(plan, sources, dst))

    def staging(self, device: torch.device, nbytes: int) -> FakeStaging:
        if self.staging_error is not None:
            raise IpcUnavailable(self.staging_error)
        staging = FakeStaging(nbytes)
        self.stagings.append(staging)
        return staging

    def to_devices(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.events.append(("to_devices", len(pairs)))
        for host, target in pairs:
            target.copy_(host)

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def close(self) -> None:
        self.closed = True


def die_mid_overlap(address: str, job: str, step: int) -> None:
    """An overlap-mode save whose device copy never completes; then the process is killed."""
    from ckptd.client import CheckpointClient

    weights = torch.arange(4096, dtype=torch.float32)
    backend = FakeBackend([weights])
    backend.gate.clear()  # the copy stays in flight
    ckpt = CheckpointClient(job, address=address, rank=0, world_size=1, on_error="raise", timeout_s=5, _device_backend=backend)
    handle = ckpt.save(step, {"model": {"w": weights}})
    assert not handle.snapshot_done
    print("saved-not-committed", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    mode, address, job, step = sys.argv[1:5]
    if mode != "die-mid-overlap":
        raise SystemExit(f"unknown mode {mode}")
    die_mid_overlap(address, job, int(step))
