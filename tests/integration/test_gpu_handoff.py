"""The GPU hand-off modes on CPU: a real daemon, and a CPU stand-in for CUDA (fake_device.py).

What is tested here without a GPU: mode selection and fallbacks, the fences (optimizer pre-hook
installed once, handle.wait_snapshot, ckpt.fence), that overlap and ipc saves return before the
copy is done and commit only after it, that a snapshot whose copy never completes is never
persisted, the daemon's OpenStaging/CloseStaging validation, and restores through the device
path. tests/client/test_cuda_copier.py runs the real CUDA paths (marked gpu).
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from torch import nn

from ckptd.client import CheckpointClient, CheckpointError
from ckptd.client._handoff.modes import resolve_mode
from ckptd.demo.process import DaemonProcess
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("fake_device", HERE / "fake_device.py")
assert _spec is not None and _spec.loader is not None
fake_device = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_device)
FakeBackend = fake_device.FakeBackend
client_on = fake_device.client_on


@pytest.fixture
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    """The module's tests share one daemon (conftest.shared_daemon): each saves under its own job."""
    return shared_daemon


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(64, 64)  # 16 KiB weight: a "large" copy for the fake (small_bytes=4096)
        self.b = nn.Linear(64, 8)
        self.norm = nn.BatchNorm1d(8)  # buffers: changed by forward passes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(torch.relu(self.a(x))))


def training() -> tuple[Net, torch.optim.Optimizer]:
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    step(model, opt)  # optimizer state exists
    return model, opt


def step(model: Net, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(16, 64, generator=torch.Generator().manual_seed(1))).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def device_tensors(model: Net, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What plays the CUDA tensors: parameters, buffers and Adam's moments (not its step counters)."""
    out = list(model.parameters()) + [b for b in model.buffers() if b.numel() > 1]
    for st in opt.state.values():
        out += [st["exp_avg"], st["exp_avg_sq"]]
    return out


def snapshot(model: Net, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        out[f"o/{i}/exp_avg"] = st["exp_avg"].clone()
        out[f"o/{i}/exp_avg_sq"] = st["exp_avg_sq"].clone()
    return out


def assert_restored(model: Net, opt: torch.optim.Optimizer, expected: dict[str, torch.Tensor]) -> None:
    got = snapshot(model, opt)
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


# ------------------------------------------------------------------ without a daemon


@pytest.mark.parametrize(("requested", "expected"), [("auto", "overlap"), ("copy", "copy"), ("overlap", "overlap"), ("ipc", "ipc")])
def test_mode_in_use(requested: str, expected: str) -> None:
    assert resolve_mode(requested) == expected
    ckpt = CheckpointClient("j", address="unix:///nonexistent.sock", rank=0, world_size=1, mode=requested)
    assert ckpt.mode_in_use == expected and ckpt.mode_reason is None
    ckpt.close()


def test_unknown_mode_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="mode='fast': use one of auto, copy, overlap, ipc"):
        CheckpointClient("j", address="unix:///nonexistent.sock", rank=0, world_size=1, mode="fast")


def test_the_cuda_modules_are_not_imported_by_a_cpu_client(daemon) -> None:
    code = (
        "import sys, torch; from ckptd.client import CheckpointClient\n"
        f"c = CheckpointClient('lazy', address={daemon.address!r}, rank=0, world_size=1, on_error='raise')\n"
        "c.save(1, {'model': {'w': torch.ones(4)}}).wait_durable(); c.fence(); c.close()\n"
        "assert not {'ckptd.client.cuda_copier', 'ckptd.client.staging_buffer', 'ckptd.common.cudart'} & set(sys.modules), sys.modules.keys()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_gpu_benchmark_fails_fast_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the benchmark would run")
    script = HERE.parent / "bench" / "gpu_stall.py"
    out = subprocess.run([sys.executable, str(script), "--sizes", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr, out.stderr


# ------------------------------------------------------------------ CPU tensors: fences are no-ops


def test_cpu_state_fences_are_no_ops_and_the_hook_is_installed_once(daemon) -> None:
    model, opt = training()
    with CheckpointClient("cpu", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        h1 = ckpt.save(1, {"model": model, "optimizer": opt})
        assert h1.mode == "cpu"
        h1.wait_snapshot()  # a no-op fence: the bytes are in the arena already
        h1.wait_snapshot(host=True)  # waits for the commit, which a helper thread sends
        assert h1.snapshot_done and h1.ok
        with ckpt.fence():
            pass
        step(model, opt)  # the pre-hook runs: nothing pending, nothing happens
        ckpt.save(2, {"model": model, "optimizer": opt})
        assert len(opt._optimizer_step_pre_hooks) == 1
        assert h1.wait_durable(timeout=60) is not None
    assert len(opt._optimizer_step_pre_hooks) == 0  # close removes it


def test_copy_mode_installs_no_hook(daemon) -> None:
    model, opt = training()
    with CheckpointClient("cpy", address=daemon.address, rank=0, world_size=1, mode="copy", on_error="raise") as ckpt:
        ckpt.save(1, {"model": model, "optimizer": opt})
        assert len(opt._optimizer_step_pre_hooks) == 0


# ------------------------------------------------------------------ "device" tensors (the fake)


def test_overlap_returns_before_the_copy_and_the_optimizer_step_waits_for_it(daemon) -> None:
    model, opt = training()
    backend = FakeBackend(device_tensors(model, opt))
    expected = snapshot(model, opt)
    with client_on(backend, "ovl", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        backend.gate.clear()  # the copy of parameters and optimizer state is "in flight" until the gate opens
        backend.hold = {"copy2"}
        handle = ckpt.save(5, {"model": model, "optimizer": opt})
        assert handle.mode == "overlap" and not handle.snapshot_done and handle.ok
        copies = [e for e in backend.events if e[0] == "copy"]
        assert len(copies) == 2  # buffers first (fenced at once), then parameters and optimizer state
        assert backend.events[2] == ("fence", "copy1", False)  # the forward-mutated buffers: fenced in save
        threading.Timer(0.3, backend.gate.set).start()
        step(model, opt)  # the optimizer's pre-hook fences: the step runs after the copy
        assert ("fence", "copy2", False) in backend.events
        info = handle.wait_durable(timeout=60)
        assert info is not None and handle.snapshot_done
    fresh, fresh_opt = training()
    with CheckpointClient("ovl", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        assert ckpt.load({"model": fresh, "optimizer": fresh_opt}) == 5
    assert_restored(fresh, fresh_opt, expected)  # the state as it was at save(), not after the step


def test_wait_snapshot_and_fence_context_manager(daemon) -> None:
    model, opt = training()
    backend = FakeBackend(device_tensors(model, opt))
    with client_on(backend, "fnc", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        backend.gate.clear()
        backend.hold = {"copy2"}
        handle = ckpt.save(1, {"model": model, "optimizer": opt})
        threading.Timer(0.2, backend.gate.set).start()
        with ckpt.fence():
            assert any(e[0] == "fence" and e[1] == "copy2" for e in backend.events)
        handle.wait_snapshot(host=True)
        assert handle.snapshot_done
        before = len(backend.events)
        handle.wait_snapshot()
        ckpt.fence()
        assert len(backend.events) == before  # committed: the fences are no-ops now


def test_the_next_save_waits_for_the_previous_commit(daemon) -> None:
    model, opt = training()
    backend = FakeBackend(device_tensors(model, opt))
    with client_on(backend, "nxt", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        backend.gate.clear()
        backend.hold = {"copy2"}
        first = ckpt.save(1, {"model": model, "optimizer": opt})
        threading.Timer(0.3, backend.gate.set).start()
        second = ckpt.save(2, {"model": model, "optimizer": opt})
        assert first.snapshot_done and second.stall_s >= 0.2  # the wait shows as stall, not as a torn snapshot
        assert first.wait_durable(timeout=60) is not None and second.wait_durable(timeout=60) is not None
        assert [c.step for c in ckpt.list()] == [1, 2]


def test_copy_mode_waits_for_the_copy(daemon) -> None:
    model, opt = training()
    backend = FakeBackend(device_tensors(model, opt))
    with client_on(backend, "cm", address=daemon.address, rank=0, world_size=1, mode="copy", on_error="raise") as ckpt:
        backend.gate.clear()
        threading.Timer(0.3, backend.gate.set).start()
        handle = ckpt.save(1, {"model": model, "optimizer": opt})
        assert handle.mode == "copy" and handle.stall_s >= 0.25
        assert handle.copy_s is not None and 0.25 <= handle.copy_s <= handle.stall_s
        handle.wait_snapshot()  # the copies are done: nothing to fence, only the commit may be on its way
        assert not any(e[0] == "fence" for e in backend.events)
        assert handle.wait_durable(timeout=60) is not None


def test_a_failed_device_copy_is_aborted_and_never_persisted(daemon) -> None:
    model, opt = training()
    backend = FakeBackend(device_tensors(model, opt))
    backend.fail_copies = True
    with client_on(backend, "bad", address=daemon.address, rank=0, world_size=1, on_error="warn") as ckpt:
        handle = ckpt.save(1, {"model": model, "optimizer": opt})
        assert handle.wait_durable(timeout=60) is None
        assert not handle.ok and "simulated device error" in (handle.error or "")
        assert ckpt.failed_saves == 1  # counted (and logged) when it failed, not at the next save
        backend.fail_copies = False
        assert ckpt.save(2, {"model": model, "optimizer": opt}).wait_durable(timeout=60) is not None
        assert [c.step for c in ckpt.list()] == [2]


def test_a_trainer_killed_before_its_overlap_copy_completed_leaves_nothing(daemons) -> None:
    daemon = daemons.start("--save-timeout", "5")
    out = subprocess.run(
        [sys.executable, str(HERE / "fake_device.py"), "die-mid-overlap", daemon.address, "killed", "7"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == -9 and "saved-not-committed" in out.stdout, out.stderr
    with CheckpointClient("killed", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        deadline = time.monotonic() + 30
        while any(f.step == 7 for f in ckpt.status().in_flight) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ckpt.list() == []
        assert ckpt.status().failed_total == 1
        assert not (daemons.root / "killed" / "step-00000007").exists()
        # the arenas are free again: the restarted trainer saves the same step
        assert ckpt.save(7, {"model": {"w": torch.zeros(4096)}}).wait_durable(timeout=60) is not None


def test_each_arena_is_page_locked_once_however_many_saves(daemon) -> None:
    model, opt = training()
    backend = FakeBackend(device_tensors(model, opt))
    with client_on(backend, "pin", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        for s in range(1, 7):
            handle = ckpt.save(s, {"model": model, "optimizer": opt})
            step(model, opt)
            assert handle.wait_durable(timeout=60) is not None
        arenas = len(backend._maps)
        assert 1 <= arenas <= 2 and backend.registrations == arenas  # the arenas are reused, never re-registered
    assert backend.lib.registered == {}  # unregistered at close


def test_restore_goes_through_the_device_path(daemon) -> None:
    model, opt = training()
    expected = snapshot(model, opt)
    with CheckpointClient("rst", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        ckpt.save(3, {"model": model, "optimizer": opt}).wait_durable(timeout=60)
    fresh, fresh_opt = training()
    backend = FakeBackend(device_tensors(fresh, fresh_opt))
    with client_on(backend, "rst", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        assert ckpt.load({"model": fresh, "optimizer": fresh_opt}) == 3
    uploaded = sum(e[1] for e in backend.events if e[0] == "upload")
    assert uploaded == len(device_tensors(fresh, fresh_opt)) and backend.events[-1] == ("finish",)
    assert_restored(fresh, fresh_opt, expected)


# ------------------------------------------------------------------ ipc: fallbacks


def test_ipc_falls_back_to_overlap_once_with_the_reason(daemon, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = training()
    backend = FakeBackend(device_tensors(model, opt), staging_error="no GPU memory left for a 1.00 GiB staging buffer on cuda:0")
    caplog.set_level(logging.WARNING, logger="ckptd.client")
    with client_on(backend, "ipcf", address=daemon.address, rank=0, world_size=1, mode="ipc", on_error="raise") as ckpt:
        first = ckpt.save(1, {"model": model, "optimizer": opt})
        ckpt.save(2, {"model": model, "optimizer": opt})
        assert ckpt.mode_in_use == "overlap" and "no GPU memory left" in (ckpt.mode_reason or "")
        assert first.mode == "overlap" and first.wait_durable(timeout=60) is not None
    assert sum("cannot work here" in r.message for r in caplog.records) == 1


def test_ipc_falls_back_when_the_daemon_cannot_open_the_buffer(daemon) -> None:
    # this daemon has no CUDA: it answers OpenStaging with the reason instead of an id
    model, opt = training()
    backend = FakeBackend(device_tensors(model, opt))
    expected = snapshot(model, opt)
    with client_on(backend, "ipcd", address=daemon.address, rank=0, world_size=1, mode="ipc", on_error="raise") as ckpt:
        handle = ckpt.save(1, {"model": model, "optimizer": opt})
        assert ckpt.mode_in_use == "overlap"
        reason = ckpt.mode_reason or ""
        assert "GPU" in reason or "CUDA" in reason, reason
        assert backend.stagings and backend.stagings[0].freed
        assert handle.wait_durable(timeout=60) is not None
    fresh, fresh_opt = training()
    with CheckpointClient("ipcd", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        ckpt.load({"model": fresh, "optimizer": fresh_opt})
    assert_restored(fresh, fresh_opt, expected)


# ------------------------------------------------------------------ the daemon's staging RPCs


WHO = pb.RankId(job="stg", rank=0, world_size=1)


@pytest.mark.parametrize(
    ("request_", "code", "text"),
    [
        (pb.OpenStagingRequest(who=WHO, gpu_uuid="0" * 32, ipc_handle=b"x" * 10, nbytes=100), "INVALID_ARGUMENT", "64 bytes"),
        (pb.OpenStagingRequest(who=WHO, gpu_uuid="GPU-1", ipc_handle=b"x" * 64, nbytes=100), "INVALID_ARGUMENT", "32 lowercase hex"),
        (pb.OpenStagingRequest(who=WHO, gpu_uuid="0" * 32, ipc_handle=b"x" * 64, nbytes=0), "INVALID_ARGUMENT", "staging buffer of 0 bytes"),
    ],
)
def test_open_staging_validates_its_fields(daemon, request_: pb.OpenStagingRequest, code: str, text: str) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.CheckpointStub(channel).OpenStaging(request_, timeout=30)
    assert err.value.code().name == code and text in (err.value.details() or "")


def test_staging_calls_without_a_buffer(daemon) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.CheckpointStub(channel)
        answer = stub.OpenStaging(pb.OpenStagingRequest(who=WHO, gpu_uuid="0" * 32, ipc_handle=b"x" * 64, nbytes=4096), timeout=60)
        assert answer.staging_id == "" and answer.reason  # no CUDA here: a reason, not an error
        with pytest.raises(grpc.RpcError) as err:
            stub.CloseStaging(pb.CloseStagingRequest(who=WHO, staging_id="nope"), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        begin = stub.BeginSave(
            pb.BeginSaveRequest(
                who=WHO, step=1, fingerprint="f", timeout_s=30,
                tensors=[pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[4], box=pb.Box(offsets=[0], lengths=[4]))],
            ),
            timeout=30,
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.CommitSnapshot(pb.CommitSnapshotRequest(who=WHO, save_id=begin.save_id, staged=[pb.StagedRange(nbytes=4)]), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "staging_id" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.CommitSnapshot(pb.CommitSnapshotRequest(who=WHO, save_id=begin.save_id, staging_id="nope", staged=[pb.StagedRange(nbytes=4)]), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_handle_errors_surface_with_on_error_raise(daemon) -> None:
    model, opt = training()
    backend = FakeBackend(device_tensors(model, opt))
    backend.fail_copies = True
    with client_on(backend, "raise", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        handle = ckpt.save(1, {"model": model, "optimizer": opt})
        with pytest.raises(CheckpointError, match="simulated device error"):
            handle.wait_durable(timeout=60)


def test_copy_mode_returns_before_the_daemon_answers_the_commit(daemon) -> None:
    # the bytes are in the arena when save() returns; the commit goes from the helper thread
    model, opt = training()
    backend = FakeBackend(device_tensors(model, opt))
    expected = snapshot(model, opt)
    with client_on(backend, "cmc", address=daemon.address, rank=0, world_size=1, mode="copy", on_error="raise") as ckpt:
        commit = ckpt._rpc.commit
        ckpt._rpc.commit = lambda request: (time.sleep(0.5), commit(request))[1]  # a daemon slow to answer
        handle = ckpt.save(1, {"model": model, "optimizer": opt})
        assert handle.mode == "copy" and handle.stall_s < 0.4 and handle.copy_s is not None
        step(model, opt)  # the state may change at once: its bytes are in the arena already
        assert handle.wait_durable(timeout=60) is not None and handle.snapshot_done
    fresh, fresh_opt = training()
    with CheckpointClient("cmc", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        assert ckpt.load({"model": fresh, "optimizer": fresh_opt}) == 1
    assert_restored(fresh, fresh_opt, expected)


def test_a_failed_copy_in_copy_mode_aborts_the_save_at_once(daemon) -> None:
    model, opt = training()
    backend = FakeBackend(device_tensors(model, opt))
    backend.fail_copies = True
    with client_on(backend, "cmf", address=daemon.address, rank=0, world_size=1, mode="copy", on_error="warn") as ckpt:
        handle = ckpt.save(1, {"model": model, "optimizer": opt})
        assert not handle.ok and "simulated device error" in (handle.error or "")
        assert not ckpt.status().in_flight  # aborted by save() itself, not left to the daemon's watchdog
        backend.fail_copies = False
        assert ckpt.save(2, {"model": model, "optimizer": opt}).wait_durable(timeout=60) is not None
        assert [c.step for c in ckpt.list()] == [2]
