"""A CPU stand-in for CUDA behind the client's DeviceBackend seam (ckptd.client._handoff.base).

Chosen CPU tensors play "device" tensors. Copies run the real plan (ckptd.client.devcopy) on a
worker thread that first waits for `gate` (so tests can hold a copy "in flight"); a fence
records itself and, like a stream waiting on an event, lets nothing after it run before the
copy is done (here: it waits).

Strict where CUDA is (tests/fakecuda.py has the rules and the library it keeps them with): each
arena mapping is page-locked once, whole, when `host_view` first maps it (`registrations`
counts the calls; a second registration of it would fail with 712), and every copy of the plan
into an arena must lie inside one registration, else `copy` raises CUDA's "invalid argument"
as torch would when the copy is issued. Staging buffers have 64-byte handles with zero bytes.
(tests/client/test_cuda_copier_mocked.py runs the real CudaBackend on fakecuda; this fake is for the
hand-off's bookkeeping with a real daemon.) Also runnable as a script for crash tests:

    python fake_device.py die-mid-overlap ADDRESS JOB STEP   # overlap save whose copy never ends, then SIGKILL
"""

from __future__ import annotations

import mmap
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

import torch

from ckptd.client import CheckpointClient
from ckptd.client.devcopy import DeviceCopyPlan, item_of, plan_copies, run_copies
from ckptd.client.staging_buffer import IpcUnavailable


if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script (crash tests): tests/ for fakecuda
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fakecuda  # noqa: E402  (tests/fakecuda.py)


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
        if host or self.backend.stream_fences_wait:
            self._done.wait(60)


class FakeStaging:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.device = torch.device("cpu")
        self.uuid = "0" * 32
        self.handle = fakecuda.ipc_handle(1, id(self))
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8)
        self.staging_id = ""
        self.freed = False

    def free(self) -> None:
        self.freed = True


class FakeRestore:
    """A load's host-to-device copies (ckptd.client._handoff.base.DeviceRestore), done at once;
    each call is recorded in `events` ("staging", bytes), ("upload", pairs), ("finish",)."""

    def __init__(self, events: list[tuple]) -> None:
        self.events = events

    def staging(self, nbytes: int) -> torch.Tensor:
        self.events.append(("staging", nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    def upload(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.events.append(("upload", len(pairs)))
        for host, target in pairs:
            target.copy_(host)

    def finish(self) -> None:
        self.events.append(("finish",))


class FakeBackend:
    """owns(): the tensors passed in (by their memory); everything else is a CPU tensor.

    lib: the strict CUDA library that keeps the arena registrations (fakecuda.FakeCudaLib).
    stream_fences_wait: a GPU-side fence (fence(host=False)) blocks the host until the copy is done,
    standing in for the compute stream that waits on the copy (the host is this fake's compute
    stream); False: it returns at once, as on a real GPU where only later kernels wait (a trainer
    whose device copy hangs still returns from save()).
    """

    def __init__(self, device_tensors: Sequence[torch.Tensor], staging_error: str | None = None) -> None:
        self.ptrs = {t.data_ptr() for t in device_tensors if t.numel()}
        self.gate = threading.Event()
        self.gate.set()
        self.hold: set[str] | None = None  # labels of the copies that wait for the gate (None: all)
        self.stream_fences_wait = True
        self.events: list[tuple] = []
        self.staging_error = staging_error
        self.stagings: list[FakeStaging] = []
        self.fail_copies = False
        self.lib = fakecuda.FakeCudaLib()
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}
        self.closed = False

    @property
    def registrations(self) -> int:
        """cudaHostRegister calls made (one per arena mapping, whatever the number of saves)."""
        return len(self.lib.register_calls)

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() > 0 and tensor.data_ptr() in self.ptrs

    def host_view(self, path: str, size: int) -> torch.Tensor:
        """The arena mapped once and page-locked once, whole (as ckptd.client.cuda_copier does)."""
        if path not in self._maps:
            fd = os.open(path, os.O_RDWR)
            try:
                mapped = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            host = torch.frombuffer(mapped, dtype=torch.uint8)
            code = self.lib.cudaHostRegister(host.data_ptr(), host.numel(), 1)
            if code != 0:
                raise RuntimeError(f"cudaHostRegister of arena {path} failed with CUDA error {code}")
            self._maps[path] = (mapped, host)
        return self._maps[path][1]

    def _check(self, plan: DeviceCopyPlan, dst: torch.Tensor) -> None:
        """Every copy of `plan` into host memory lies inside one registration, or CUDA's error."""
        if any(dst is host for _, host in self._maps.values()):
            spans = [(r.offset, r.nbytes) for r in plan.runs] + [(g.offset, g.span) for g in plan.gathers]
            for offset, nbytes in spans:
                problem = self.lib.host_copy_problem(dst.data_ptr() + offset, nbytes, asynchronous=True)
                if problem is not None:
                    raise RuntimeError(f"CUDA error: invalid argument\n(fakecuda: {problem})")

    def copy(self, placements: Sequence[tuple[torch.Tensor, int, int]], dst: torch.Tensor, only: set[int]) -> FakeCopy:
        items = [item_of(t, off, n, "fake" if i in only else None) for i, (t, off, n) in enumerate(placements)]
        plan = plan_copies(items, small_bytes=4096)
        self._check(plan, dst)
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

    def restore(self) -> "FakeRestore":
        return FakeRestore(self.events)

    def close(self) -> None:
        for _, host in self._maps.values():
            self.lib.cudaHostUnregister(host.data_ptr())
        self.closed = True


def client_on(backend: FakeBackend, job: str, **keywords: Any) -> CheckpointClient:
    """A CheckpointClient whose CUDA hand-off runs on `backend` (the CheckpointClient._device_backend seam)."""
    return type("FakeDeviceClient", (CheckpointClient,), {"_device_backend": backend})(job, **keywords)


def die_mid_overlap(address: str, job: str, step: int) -> None:
    """An overlap-mode save whose device copy never completes; then the process is killed."""
    weights = torch.arange(4096, dtype=torch.float32)
    backend = FakeBackend([weights])
    backend.gate.clear()  # the copy stays in flight
    backend.stream_fences_wait = False  # the GPU-side fence of the model's copy does not block the host
    ckpt = client_on(backend, job, address=address, rank=0, world_size=1, on_error="raise", timeout_s=5)
    handle = ckpt.save(step, {"model": {"w": weights}})
    assert not handle.snapshot_done
    print("saved-not-committed", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    mode, address, job, step = sys.argv[1:5]
    if mode != "die-mid-overlap":
        raise SystemExit(f"unknown mode {mode}")
    die_mid_overlap(address, job, int(step))
